"""checks/gpu's folders share one import namespace: the harnesses and their tests put
sibling folders on sys.path and import modules by their bare names, and pytest runs
the whole suite in one process. Two modules of one name in two folders then resolve
to whichever was imported first (pp3's and perf's contract.py once did)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

GPU = Path(__file__).resolve().parent
# A sitecustomize is never imported by name: Python runs the first one on PYTHONPATH,
# and each shim folder is put first for its own engines only.
PER_PROCESS = {"sitecustomize.py"}


def test_no_two_harness_modules_share_a_name():
    where: dict[str, list[str]] = defaultdict(list)
    for path in GPU.rglob("*.py"):
        if path.name not in PER_PROCESS and "results" not in path.parts:
            where[path.name].append(str(path.relative_to(GPU)))
    assert {n: p for n, p in where.items() if len(p) > 1} == {}
