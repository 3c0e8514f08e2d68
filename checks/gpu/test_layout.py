"""checks/gpu's folders share one import namespace: the harnesses and their tests put
sibling folders on sys.path and import modules by their bare names, and pytest runs
the whole suite in one process. Two modules of one name in two folders then resolve
to whichever was imported first (pp3's and perf's contract.py once did)."""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> set[str]:
    """The bare module names a file imports, at any depth (function-level too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def import_circles(root: Path) -> list[list[str]]:
    """Each circle of bare-name imports among root's modules (tests included: nothing
    imports a test, so a test is never in one)."""
    files = {p.stem: p for p in root.rglob("*.py")
             if p.name not in PER_PROCESS and "results" not in p.parts}  # fmt: skip
    graph = {name: sorted(_imports(p) & files.keys() - {name}) for name, p in files.items()}
    circles, done = [], set()

    def walk(name: str, path: list[str]) -> None:
        for dep in graph[name]:
            if dep in path:
                circles.append(path[path.index(dep) :] + [dep])
            elif dep not in done:
                walk(dep, [*path, dep])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            walk(name, [name])
    return circles


def test_no_two_harness_modules_import_each_other(tmp_path):
    # A circle makes the import order decide which half of a module exists
    # (issue 43: perf_contract and pp3_perf once imported each other).
    assert import_circles(GPU) == []
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    assert import_circles(tmp_path) == [["a", "b", "a"]]
