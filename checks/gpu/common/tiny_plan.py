"""The plan a harness's CPU tests hold its engines to.

`flashnext plan --json` of a profile on the real tiny checkpoint
(../tiny/tiny_model.py) and its packed PLE table, with replayed facts of the
lent H200 (checks/launcher/h200_tiny_facts.py), the card repeated for a
multi-GPU profile as the PP=3 emulation does. Each harness's run script
writes the same plan on the GPU host from that host's facts.

Runs in the launcher's venv (the test's python); the checkpoint is written by
the pinned vLLM env's python (FLASHNEXT_VLLM_PY), as the harnesses write it,
and the tests run their vLLM side there too (`in_vllm`, `in_vllm_json`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

GPU = Path(__file__).resolve().parents[1]
REPO = GPU.parents[1]


def vllm_python() -> str:
    """The pinned vLLM env's python; the test is skipped where it is not set."""
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.skip("FLASHNEXT_VLLM_PY is not set (checks/run sets it to the pinned vLLM env)")
    return py


def in_vllm(*args: str) -> subprocess.CompletedProcess:
    """The pinned vLLM env's python with args, on CPU."""
    return subprocess.run(
        [vllm_python(), *args],
        capture_output=True, text=True, env=os.environ | {"VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip


def in_vllm_json(*args: str) -> Any:
    """What `in_vllm` printed, as JSON; the run must succeed."""
    out = in_vllm(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def in_vllm_last_json(*args: str) -> Any:
    """The last line `in_vllm` printed, as JSON (for a script that may log to
    stdout before its result); the run must succeed."""
    out = in_vllm(*args)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


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
