"""`flashnext preflight`'s table and --json, byte for byte (golden files): what its checks
say, in which order, and how they are shown, across every domain (golden_preflight.py)."""

from __future__ import annotations

import pytest
from golden_preflight import CASES, GOLDEN_DIR, run_case, write_inputs


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden-preflight")
    write_inputs(path)
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_preflight_output_equals_the_golden_files(work, name, monkeypatch):
    monkeypatch.chdir(work)
    for file, text in run_case(work, name).items():
        # On a difference: checks/launcher/golden/preflight/regenerate, then review the diff.
        assert text == (GOLDEN_DIR / file).read_text(), file


def test_every_golden_file_belongs_to_a_case():
    names = {
        f"{n}.{s}" for n, case in CASES.items() for s in ("txt", "json")[0 if case.table else 1 :]
    }
    on_disk = {p.name for p in GOLDEN_DIR.iterdir() if p.suffix in (".txt", ".json")}
    assert on_disk == names
