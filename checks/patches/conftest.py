"""Patch proofs: run the same tests against the stock and the patched vLLM tree.

    pytest checks/patches --vllm-tree=stock     # every `proves` test must xfail
    pytest checks/patches --vllm-tree=patched   # every test must pass

`@pytest.mark.proves("NNNN-topic.patch")` marks a test that shows what a patch
fixes. On the stock tree it becomes `xfail(strict=True)`: the test has to fail
there, and a pass (the patch stopped mattering, or the test stopped testing)
fails the suite. Pass `raises=SomeError` to accept only that failure on stock.
On the patched tree the test must pass, and the patch must be in the tree's
stamp (`vllm/_flashnext_patches.json`, written by patches/apply) with the hash
of the patch file in this checkout: a stale env is an error, not a pass.

The tree is whatever `import vllm` finds (put ENV/stock first on PYTHONPATH for
the stock run). `--vllm-tree` states which one it should be; a mismatch is a
usage error. Tests without `proves` (e.g. of patches/apply) need no vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.33.0" / "series"
PINNED_VERSION = "0.33.0"
STAMP_NAME = "_flashnext_patches.json"
_TREE_KEY = pytest.StashKey["VllmTree"]()
# Why a proves-test cannot count on this tree; it then fails in setup.
_PROBLEM_KEY = pytest.StashKey[str]()


@dataclass(frozen=True)
class VllmTree:
    """The vLLM package the tests import, as found on sys.path."""

    package_dir: Path
    version: str
    # name -> sha256 of each applied patch; None on a stock (unstamped) tree.
    applied: dict[str, str] | None

    @property
    def kind(self) -> str:
        return "stock" if self.applied is None else "patched"


def series_names() -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in SERIES.read_text().splitlines())
    return [ln for ln in lines if ln]


def find_vllm_tree() -> VllmTree:
    """Locate vllm without importing it (importing costs 5-13 s)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise pytest.UsageError(
            "vllm is not importable: run with the env python from pins/build-env "
            "(and ENV/stock first on PYTHONPATH for --vllm-tree=stock)"
        )
    package_dir = Path(spec.origin).parent
    text = (package_dir / "_version.py").read_text()
    match = re.search(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)""", text, re.M)
    version = match.group(1) if match else "unknown"
    stamp = package_dir / STAMP_NAME
    applied = None
    if stamp.exists():
        try:
            entries = json.loads(stamp.read_text())["patches"]
            applied = {p["name"]: p["sha256"] for p in entries}
        except (ValueError, KeyError, TypeError) as err:
            raise pytest.UsageError(
                f"{stamp} is unreadable ({err!r}): rebuild the env with pins/build-env"
            ) from err
    return VllmTree(package_dir, version, applied)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--vllm-tree",
        choices=("stock", "patched", "auto"),
        default="auto",
        help="which vLLM tree the imported vllm must be: stock (proofs must xfail "
        "strictly), patched (proofs must pass), auto (read the tree's stamp).",
    )


def pytest_configure(config: pytest.Config) -> None:
    # The proofs run vLLM's CPU platform, offline (CPU_TESTING.md); set before
    # the first `import vllm`, which happens inside the tests.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    config.addinivalue_line(
        "markers",
        "proves(patch, raises=None): test shows what patch NNNN-topic.patch fixes; "
        "strict xfail on the stock vLLM tree, must pass on the patched tree.",
    )


def _tree(config: pytest.Config) -> VllmTree:
    if _TREE_KEY not in config.stash:
        tree = find_vllm_tree()
        wanted = config.getoption("--vllm-tree")
        if tree.version != PINNED_VERSION:
            raise pytest.UsageError(
                f"vllm at {tree.package_dir} is {tree.version}, the proofs are for "
                f"{PINNED_VERSION}: use the env from pins/build-env"
            )
        if wanted != "auto" and wanted != tree.kind:
            raise pytest.UsageError(
                f"--vllm-tree={wanted} but vllm at {tree.package_dir} is the {tree.kind}"
                f" tree ({STAMP_NAME} {'absent' if tree.applied is None else 'present'});"
                " put ENV/stock first on PYTHONPATH for stock, leave it off for patched"
            )
        config.stash[_TREE_KEY] = tree
    return config.stash[_TREE_KEY]


def _proves_problem(patch: str, tree: VllmTree, series: list[str]) -> str | None:
    """Why a proof cannot count on this tree, or None."""
    if patch not in series:
        return f"proves({patch!r}): no such entry in {SERIES.relative_to(REPO)}"
    if tree.applied is None:
        return None
    if patch not in tree.applied:
        return f"{patch} is in the series but not applied to {tree.package_dir}: rebuild the env"
    current = hashlib.sha256((SERIES.parent / patch).read_bytes()).hexdigest()
    if tree.applied[patch] != current:
        return f"{patch} changed since {tree.package_dir} was patched: rebuild the env"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    proofs = [item for item in items if item.get_closest_marker("proves")]
    if not proofs:
        return
    tree = _tree(config)
    series = series_names()
    for item in proofs:
        marker = item.get_closest_marker("proves")
        if len(marker.args) != 1 or not isinstance(marker.args[0], str):
            raise pytest.UsageError(f"{item.nodeid}: use @pytest.mark.proves('NNNN-topic.patch')")
        patch = marker.args[0]
        problem = _proves_problem(patch, tree, series)
        if problem:
            item.stash[_PROBLEM_KEY] = problem
        elif tree.applied is None:
            item.add_marker(
                pytest.mark.xfail(
                    strict=True,
                    raises=marker.kwargs.get("raises"),
                    reason=f"stock vLLM {tree.version} lacks {patch}",
                )
            )


def pytest_runtest_setup(item: pytest.Item) -> None:
    problem = item.stash.get(_PROBLEM_KEY, None)
    if problem:
        pytest.fail(problem, pytrace=False)


def pytest_report_header(config: pytest.Config) -> str:
    try:
        tree = find_vllm_tree()
    except pytest.UsageError:
        return "vllm tree: not importable (only tests without proves can run)"
    extra = "" if tree.applied is None else f", {len(tree.applied)} patch(es) applied"
    return f"vllm tree: {tree.kind} {tree.version} at {tree.package_dir}{extra}"


@pytest.fixture(scope="module", autouse=True)
def _release_distributed_after_module():
    """Tests share one process: leave vLLM's process groups as each module found them."""
    yield
    helper = sys.modules.get("tiny_qwen4_exp")  # only set up if a test imported it
    if helper is not None:
        helper.release_single_process_distributed()


@pytest.fixture(scope="session")
def vllm_tree(request: pytest.FixtureRequest) -> VllmTree:
    """The tree under test; also checks it against --vllm-tree."""
    return _tree(request.config)
