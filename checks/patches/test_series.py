"""The real series: consistent with its files, manifest, README and proofs.

test_text_prerequisites_are_declared applies the series to copies of the
stock vLLM 0.33.0 files it touches, read from the pinned env's pristine tree
(FLASHNEXT_VLLM_ENV/stock, which checks/patches/run and checks/run set).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.machinery import SourceFileLoader
from importlib.util import module_from_spec, spec_from_loader
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.33.0" / "series"
README = REPO / "patches" / "README.md"
# DEP-3 fields every header carries (Forwarded always: a missing one reads "yes").
REQUIRED_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")
# The one dialect of this series: these fields, in this order (Depends only
# where a patch needs others at run time, Applies-After only where its hunks
# need the text of patches Depends does not name), then a line "---".
DIALECT = (
    "Description",
    "Author",
    "Origin",
    "Bug",
    "Forwarded",
    "Last-Update",
    "Spec-Row",
    "Depends",
    "Applies-After",
    "Proof",
)
OPTIONAL_FIELDS = ("Depends", "Applies-After")


def _load_apply():
    loader = SourceFileLoader("patches_apply", str(REPO / "patches" / "apply"))
    module = module_from_spec(spec_from_loader("patches_apply", loader))
    sys.modules["patches_apply"] = module  # dataclasses look their module up
    loader.exec_module(module)
    return module


apply = _load_apply()
NAMES = apply.read_series(SERIES)


def header(name: str) -> list[str]:
    """Lines before the first diff header."""
    lines = []
    for line in (SERIES.parent / name).read_text().splitlines():
        if re.match(r"^--- (a/|/dev/null)", line):
            break
        lines.append(line)
    return lines


def test_series_lists_exactly_the_patch_files() -> None:
    apply.check_series_matches_files(SERIES, NAMES)
    assert NAMES, "empty series"


def test_manifest_covers_every_modified_file() -> None:
    hashes = apply.read_manifest(SERIES.parent / apply.MANIFEST_NAME)
    modified = {rel for n in NAMES for rel in apply.parse_patch(SERIES.parent / n).modifies}
    assert sorted(modified - set(hashes)) == [], "run patches/apply --write-manifest"


@pytest.mark.parametrize("name", NAMES)
def test_patch_header_is_dep3(name: str) -> None:
    lines = header(name)
    fields = {m.group(1) for ln in lines if (m := re.match(r"^([A-Z][A-Za-z-]*): ", ln))}
    assert set(REQUIRED_FIELDS) <= fields, sorted(set(REQUIRED_FIELDS) - fields)
    long = [ln for ln in lines if len(ln) >= 80]
    assert long == [], "header lines must be under 80 characters"


@pytest.mark.parametrize("name", NAMES)
def test_patch_header_is_the_series_dialect(name: str) -> None:
    lines = header(name)
    fields = [m.group(1) for ln in lines if (m := re.match(r"^([A-Z][A-Za-z-]*): ", ln))]
    want = [f for f in DIALECT if f not in OPTIONAL_FIELDS or f in fields]
    assert fields == want, f"header fields {fields}, the series dialect is {want}"
    assert lines[-1] == "---", "end the header with a line '---'"
    author = next(ln for ln in lines if ln.startswith("Author: "))
    assert author == "Author: flashnext"
    origin = next(ln for ln in lines if ln.startswith("Origin: "))
    assert origin.startswith("Origin: other, flashnext; ")


def test_prerequisites_come_first_in_the_series() -> None:
    """patches/apply's own check (it refuses a series that lacks one)."""
    _, patches = apply.load(SERIES)
    depends = {p.name: p.depends for p in patches}
    assert set(depends["0022-qsa-offload-layer.patch"]) >= {
        "0020-qsa-offload-block-size.patch",
        "0021-qsa-offload-kernels.patch",
    }


def _stock_site() -> Path:
    """The pinned env's pristine site dir (ENV/stock holds vllm/)."""
    env = os.environ.get("FLASHNEXT_VLLM_ENV")
    if not env:
        pytest.fail(
            "needs the pristine vLLM 0.33.0 tree: set FLASHNEXT_VLLM_ENV to the env"
            " pins/build-env prints (checks/patches/run and checks/run do)",
            pytrace=False,
        )
    return Path(env) / "stock"


def _prerequisites(patches) -> dict[str, set[str]]:
    """Every patch's prerequisites by its headers (Depends and Applies-After), transitively."""
    direct = {p.name: set(p.depends) | set(p.applies_after) for p in patches}
    closure: dict[str, set[str]] = {}
    for name in NAMES:  # series order: prerequisites come first (apply.load checks it)
        closure[name] = set(direct[name])
        for dep in direct[name]:
            closure[name] |= closure[dep]
    return closure


def _fails_to_apply(stock: Path, patches, scratch: Path) -> list[str]:
    """Apply patches in order to copies of the stock files; the names that did not apply.

    A patch that does not apply cleanly is left out (GNU patch --dry-run first,
    with patches/apply's own flags), and the rest go on without it.
    """
    shutil.rmtree(scratch, ignore_errors=True)
    for rel in sorted({rel for p in patches for rel in p.modifies}):
        (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(stock / rel, scratch / rel)
    patch_bin = apply.find_patch_bin()
    failed = []
    for patch in patches:
        check = apply.patch_command(patch_bin, scratch, patch.path, dry_run=True)
        if subprocess.run(check, capture_output=True, check=False).returncode != 0:
            failed.append(patch.name)
            continue
        command = apply.patch_command(patch_bin, scratch, patch.path)
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return failed


def test_text_prerequisites_are_declared(tmp_path: Path) -> None:
    """Leave each patch out in turn: what then fails to apply must need it by its headers.

    patches/apply refuses a series that lists a patch without its Depends and
    Applies-After entries before it. For that to stand for "every listed
    patch applies", each patch whose hunks fail without patch P must name P,
    or a prerequisite that needs P (Depends or Applies-After, transitively).
    And an Applies-After entry must be real: without P, the patch fails.
    """
    _, patches = apply.load(SERIES)
    stock = _stock_site()
    hashes = apply.read_manifest(SERIES.parent / apply.MANIFEST_NAME)
    touched = sorted({rel for p in patches for rel in p.modifies})
    changed = [rel for rel in touched if apply.sha256_file(stock / rel) != hashes[rel]]
    assert changed == [], f"{stock} is not the pristine tree"
    scratch = tmp_path / "tree"
    assert _fails_to_apply(stock, patches, scratch) == [], "the full series does not apply"
    needs = _prerequisites(patches)

    problems = []
    for left_out in patches:
        rest = [p for p in patches if p is not left_out]
        failed = _fails_to_apply(stock, rest, scratch)
        for name in failed:
            if left_out.name not in needs[name]:
                problems.append(
                    f"{name} does not apply without {left_out.name}, and its headers do not"
                    f" say so: add Applies-After: {left_out.name}"
                )
        for patch in rest:
            if left_out.name in patch.applies_after and patch.name not in failed:
                problems.append(
                    f"{patch.name} applies without {left_out.name}: drop it from Applies-After"
                )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", NAMES)
def test_readme_has_a_row(name: str) -> None:
    patch_id = name.removesuffix(".patch")
    rows = [ln for ln in README.read_text().splitlines() if ln.startswith(f"| {patch_id} |")]
    assert len(rows) == 1, f"patches/README.md needs one table row for {patch_id}"


def test_readme_rows_are_series_entries() -> None:
    ids = {n.removesuffix(".patch") for n in NAMES}
    rows = re.findall(r"^\| (\d{4}-[a-z0-9-]+) \|", README.read_text(), re.M)
    assert sorted(set(rows) - ids) == []


UPSTREAM = "https://github.com/vllm-project/vllm/"
NOT_FOUND = "not found upstream (searched vllm-project/vllm issues and PRs: "


def field(name: str, key: str) -> str:
    """A header field's value, its continuation lines joined."""
    text = "\n".join(header(name))
    match = re.search(rf"^{key}: (.*(?:\n .*)*)", text, re.M)
    return " ".join(match.group(1).split()) if match else ""


def readme_upstream(name: str) -> str:
    """The series table's last cell for a patch: where upstream stands."""
    patch_id = name.removesuffix(".patch")
    row = next(ln for ln in README.read_text().splitlines() if ln.startswith(f"| {patch_id} |"))
    return row.rstrip(" |").rsplit(" | ", 1)[1]


@pytest.mark.parametrize("name", NAMES)
def test_bug_names_upstream_or_the_search(name: str) -> None:
    """Bug: an upstream vLLM issue/PR URL the table names too, or "not found upstream"
    with the terms searched, which the table says as well; Forwarded stays "no"."""
    bug, cell = field(name, "Bug"), readme_upstream(name)
    if bug.startswith(UPSTREAM):
        assert re.fullmatch(rf"{UPSTREAM}(issues|pull)/\d+", bug), bug
        assert f"]({bug})" in cell, f"patches/README.md's upstream column must link {bug}"
        assert not cell.startswith("not found"), cell
    else:
        assert bug.startswith(NOT_FOUND) and bug.endswith(")"), (
            f"{name}: Bug must be an upstream URL or '{NOT_FOUND}<terms>)', not {bug!r}"
        )
        assert cell.startswith("not found"), f"{name}: the table says {cell!r}"
    assert field(name, "Forwarded") == "no"


def test_bug_check_fails_on_a_mismatch(monkeypatch) -> None:
    """The check above can fail: a Bug URL the table does not link."""
    name = next(n for n in NAMES if field(n, "Bug").startswith(UPSTREAM))
    real = field
    monkeypatch.setitem(
        globals(), "field",
        lambda n, k: f"{UPSTREAM}issues/1" if k == "Bug" else real(n, k),
    )  # fmt: skip
    with pytest.raises(AssertionError, match="upstream column must link"):
        test_bug_names_upstream_or_the_search(name)


@pytest.mark.parametrize("name", NAMES)
def test_patch_has_a_proof(name: str) -> None:
    """A proves() test here, or (kernels without a vLLM caller yet) a named checks/ path."""
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    mentioned = re.findall(r"^\s*PATCH\w* = \"([^\"]+)\"|proves\(\"([^\"]+)\"", sources, re.M)
    if name in {a or b for a, b in mentioned}:
        return
    named = re.findall(r"\b(checks/[\w./-]*\w)", "\n".join(header(name)))
    assert named, f"no proves({name!r}) test in checks/patches and no proof named in its header"
    missing = [path for path in named if not (REPO / path).exists()]
    assert missing == [], f"{name} names proofs that do not exist"
