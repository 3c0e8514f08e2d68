"""The real series: consistent with its files, manifest, README and proofs."""

from __future__ import annotations

import re
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
# where a patch needs others at run time), then a line "---".
DIALECT = (
    "Description",
    "Author",
    "Origin",
    "Bug",
    "Forwarded",
    "Last-Update",
    "Spec-Row",
    "Depends",
    "Proof",
)


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
    want = [f for f in DIALECT if f != "Depends" or "Depends" in fields]
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


@pytest.mark.parametrize("name", NAMES)
def test_readme_has_a_row(name: str) -> None:
    patch_id = name.removesuffix(".patch")
    rows = [ln for ln in README.read_text().splitlines() if ln.startswith(f"| {patch_id} |")]
    assert len(rows) == 1, f"patches/README.md needs one table row for {patch_id}"


def test_readme_rows_are_series_entries() -> None:
    ids = {n.removesuffix(".patch") for n in NAMES}
    rows = re.findall(r"^\| (\d{4}-[a-z0-9-]+) \|", README.read_text(), re.M)
    assert sorted(set(rows) - ids) == []


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
