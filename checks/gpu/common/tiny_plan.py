"""The plan a harness's CPU tests hold its engines to.

`flashnext plan --json` of a profile on the real tiny checkpoint
(../tiny/tiny_model.py) and its packed PLE table, with replayed facts of the
lent H200 (checks/launcher/h200_tiny_facts.py), the card repeated for a
multi-GPU profile as the PP=3 emulation does. Each harness's run script
writes the same plan on the GPU host from that host's facts.

Runs in the launcher's venv (the test's python); the checkpoint is written by
the pinned vLLM env's python (FLASHNEXT_VLLM_PY), as the harnesses write it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

GPU = Path(__file__).resolve().parents[1]
REPO = GPU.parents[1]


def tiny_checkpoint(root: Path, vllm_python: str, layers: int | None = None) -> tuple[Path, Path]:
    """(model dir, packed PLE table) under root: tiny/ (or tiny<layers>/) and tables/."""
    model = root / ("tiny" if layers is None else f"tiny{layers}")
    table = root / "tables" / "ple-packed.bin"
    table.parent.mkdir(parents=True, exist_ok=True)
    extra = [] if layers is None else ["--layers", str(layers)]
    tiny_model = GPU / "tiny" / "tiny_model.py"
    subprocess.run([vllm_python, str(tiny_model), str(model), *extra], check=True)
    subprocess.run(
        [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(model),
         "--out", str(table), "--force"],
        check=True, capture_output=True,
    )  # fmt: skip
    return model, table


def write_plan(
    dest: Path, model: Path, table: Path, profile: str, *, gpus: int = 1, mtp: int | None = None
) -> Path:
    """`flashnext plan --json --profile PROFILE [--mtp N]` on replayed H200 facts, at dest."""
    sys.path.insert(0, str(REPO / "checks" / "launcher"))
    sys.path.insert(0, str(GPU / "pp3"))
    from emulation import replicate_gpu
    from h200_tiny_facts import h200_facts

    facts = h200_facts(model, table, 8000)
    if gpus > 1:
        facts = replicate_gpu(facts, gpus)
    facts_path = dest.with_suffix(".facts.json")
    facts_path.write_text(json.dumps(facts))
    out = subprocess.run(
        [sys.executable, "-m", "flashnext", "plan", "--json", "--facts", str(facts_path),
         "--profile", profile, "--model", str(model), "--table", str(table),
         *([] if mtp is None else ["--mtp", str(mtp)])],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    dest.write_text(out.stdout)
    return dest


def with_flag(plan: dict, flag: str, value: str) -> dict:
    """The plan as a changed profile would write it: `flag`'s value replaced."""
    argv = list(plan["argv"])
    argv[argv.index(flag) + 1] = value
    return {**plan, "argv": argv}
