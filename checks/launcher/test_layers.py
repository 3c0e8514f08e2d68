"""The launcher's import graph draws DESIGN's picture: no loop, nothing imports upward.

Every `import` in the package (module level and inside functions alike: a
deferred import is still a dependency) is read with `ast`, never executed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "launcher" / "src" / "flashnext"

# The layer order, declared once, bottom first: a module may import its own layer
# and the ones below, never one above. Keys are the package's top-level names.
LAYERS: tuple[tuple[str, ...], ...] = (
    # no logic
    (
        "__init__",
        "units",
        "atomic",
        "write_errors",
        "read_errors",
        "invocation",
        "checkout",
        "input_files",
    ),  # fmt: skip
    ("facts",),  # every read of the host and the checkpoint (stored schemes, scheme map too)
    ("profiles",),  # profiles
    ("plan",),  # pure: partition, placement, kv sizing, plan, command
    ("table",),  # the PLE table file: prepare, verify (its layout arithmetic too)
    ("checks",),  # pure checks, one Finding: preflight, `checkpoint check`
    ("checkpoint",),  # what changes the checkpoint: fix (proved by the check), mtp-int4
    ("skeleton",),  # the checkpoint's reference inventory, its metadata as fix leaves it
    ("assess",),  # facts → plan → findings, for the commands
    ("render",),  # output for people and programs
    ("serve", "tools"),  # supervise vLLM; bench, report
    ("cli", "__main__"),  # Click only
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Modules of the package that `path` imports (a `from P import m` of a submodule
    counts as importing P.m)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))  # fmt: skip
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m == "flashnext" or m.startswith("flashnext.")}


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path, name) if m in files and m != name}
        for name, path in files.items()
    }


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer_of(top: str) -> int:
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"flashnext.{top} is in no layer: add it to LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if _layer_of(_top(dst)) > _layer_of(_top(src)):
                bad.append(f"{src} (layer {_layer_of(_top(src))}) imports {dst} "
                           f"(layer {_layer_of(_top(dst))})")  # fmt: skip
    return bad


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (loop := visit(node)):
            return loop
    return None


def test_every_module_is_in_a_layer():
    for name in _graph():
        _layer_of(_top(name))


def test_nothing_imports_upward():
    assert upward_imports(_graph()) == []


def test_no_import_loop():
    assert find_loop(_graph()) is None


def test_the_walk_sees_a_loop_and_an_upward_import():
    # The same functions over a made-up graph: what the real one must never show.
    graph = {"flashnext.plan.a": {"flashnext.plan.b"}, "flashnext.plan.b": {"flashnext.plan.a"}}
    assert find_loop(graph) == ["flashnext.plan.a", "flashnext.plan.b", "flashnext.plan.a"]
    assert upward_imports({"flashnext.facts.x": {"flashnext.render"}}) == [
        f"flashnext.facts.x (layer 1) imports flashnext.render (layer {_layer_of('render')})"
    ]


ALIAS_MARK = "sys.modules[__name__]"


def test_no_module_is_an_alias_of_another():
    # A module that replaces itself in sys.modules is a second name for another room
    # (the old flashnext.bench, partition, qsa_sizing): import the real path instead.
    aliases = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
               if ALIAS_MARK in p.read_text()]  # fmt: skip
    assert aliases == []


def test_deferred_and_relative_imports_count(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from flashnext.plan import command\nfrom . import units\n")
    assert _imports(f, "flashnext.m") == {
        "flashnext.plan", "flashnext.plan.command", "flashnext", "flashnext.units"
    }  # fmt: skip


def readme_floors() -> list[set[str]]:
    """The README's drawing of the floors (Layout), top first: each line's first column
    (before a run of spaces) names the floor's modules; an indented line continues."""
    readme = (PACKAGE.parents[2] / "README.md").read_text()
    block = readme.split("<!-- layers: top first", 1)[1].split("```text\n", 1)[1]
    floors = []
    for line in block.split("\n```", 1)[0].splitlines():
        if not line.startswith(" "):
            names = re.split(r"\s{2,}", line, maxsplit=1)[0].split()
            floors.append({n.removesuffix("/").removesuffix(".py") for n in names})
    return floors


def test_the_readme_draws_the_floors_as_they_are():
    assert readme_floors() == [set(floor) for floor in reversed(LAYERS)]
