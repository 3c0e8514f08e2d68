"""Preflight's checks: one small module per domain, and each one's checks in the registry.

A check is a public function of a domain module (helpers start with `_`); one that is
defined but missing from flashnext.checks.preflight.CHECKS would never run.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from pathlib import Path

import flashnext.checks
from flashnext.checks.preflight import CHECKS

MAX_LINES = 600
# The package's modules that hold no checks: the Finding type, the input and its shared
# helpers, the registry itself, and `checkpoint check`'s findings (not preflight's).
NOT_DOMAINS = {"finding", "inputs", "preflight", "checkpoint_metadata"}


def domain_modules() -> list[types.ModuleType]:
    names = sorted(m.name for m in pkgutil.iter_modules(flashnext.checks.__path__))
    return [importlib.import_module(f"flashnext.checks.{n}") for n in names if n not in NOT_DOMAINS]


def checks_of(module: types.ModuleType) -> list:
    """The module's own public functions: its checks."""
    return [
        fn
        for name, fn in inspect.getmembers(module, inspect.isfunction)
        if not name.startswith("_") and fn.__module__ == module.__name__
    ]


def unregistered(modules: list[types.ModuleType], registry) -> list[str]:
    return [f"{m.__name__}.{fn.__name__}" for m in modules for fn in checks_of(m)
            if fn not in registry]  # fmt: skip


def test_every_checks_module_is_small():
    for path in sorted(Path(flashnext.checks.__file__).parent.glob("*.py")):
        assert len(path.read_text().splitlines()) <= MAX_LINES, path.name


def test_every_domain_module_is_in_the_registry():
    modules = domain_modules()
    assert {m.__name__.rpartition(".")[2] for m in modules} == {
        "gpu", "host", "rank_fit", "mtp", "model", "table", "vllm_env", "port"
    }  # fmt: skip
    for module in modules:
        assert checks_of(module), f"{module.__name__} has no check"
    assert unregistered(modules, CHECKS) == []


def test_the_registry_holds_checks_of_domain_modules_only():
    domains = {m.__name__ for m in domain_modules()}
    for fn in CHECKS:
        assert fn.__module__ in domains, fn


def test_a_check_defined_but_not_registered_is_named():
    module = types.ModuleType("flashnext.checks.example")
    exec("def example(inp):\n    yield from ()\n\ndef _helper(inp):\n    pass\n", module.__dict__)
    assert unregistered([module], CHECKS) == ["flashnext.checks.example.example"]
    assert unregistered([module], (module.example,)) == []
