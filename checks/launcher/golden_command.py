"""The golden files of the shipped profile's exact `vllm serve` argv and environment.

One argument per line (`3x3090.argv`) and one `NAME=VALUE` per line, sorted
(`3x3090.env`), from `flashnext plan --json` on the full skeleton checkpoint
(`--fixed-metadata`) and the replayed facts checks/fixtures/facts/3x3090-nvme.json,
with the paths below. test_golden_command.py compares them byte for byte;
`checks/launcher/golden/regenerate` rewrites them (then read the diff).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
FACTS = HERE.parents[1] / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
# Relative to the directory the skeleton is written in, so no temp path leaks in.
MODEL_ARG = "Qwen3.8-Flash-Next"
TABLE_ARG = "/nvme/flashnext/ple-table.bin"
PLAN_ARGS = ["plan", "--json", "--facts", str(FACTS), "--model", MODEL_ARG, "--table", TABLE_ARG]


def golden_files(plan: dict) -> dict[str, str]:
    """File name → exact text, from `plan --json`'s argv and env."""
    for arg in plan["argv"]:
        assert "\n" not in arg, arg  # one argument per line must stay unambiguous
    return {
        "3x3090.argv": "".join(f"{arg}\n" for arg in plan["argv"]),
        "3x3090.env": "".join(f"{k}={v}\n" for k, v in sorted(plan["env"].items())),
    }


def main() -> None:
    """`plan --json` on stdin → the golden files rewritten."""
    for name, text in golden_files(json.load(sys.stdin)).items():
        (GOLDEN_DIR / name).write_text(text)
        print(f"wrote {GOLDEN_DIR / name}")


if __name__ == "__main__":
    main()
