"""What a speed figure rests on (issue 40 item 5): `plan`'s speed rows and `bench
--json`'s `projection` name a run and its date, or say there is none. The contract
figures below are made up for the test and labelled so: they are not results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from flashnext.plan import speed_basis
from flashnext.tools import bench

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import rec  # noqa: E402

# A made-up contract's projection (not a result): its figures only feed the arithmetic.
MADE_UP_CONTRACT = {
    "projection_3090": {"c1_tok_s": 50.0, "c4_tok_s": 100.0, "seed_config": {"within_15pct": True}}
}


def test_every_basis_is_its_results_files_projection():
    """An entry is a contract's figures, never typed in: each names a file of this
    repository whose projection_3090 has exactly its figures."""
    for profile, basis in speed_basis.MEASURED.items():
        doc = json.loads((REPO / basis.run).read_text())
        assert basis == speed_basis.from_contract(profile, basis.run, basis.date, doc)
        assert basis.date[:4].isdigit() and basis.what == speed_basis.EMULATION


def test_a_projection_that_misses_the_field_report_gives_no_basis():
    for seed in ({"within_15pct": False}, {"within_15pct": None}, None):
        doc = {"projection_3090": {"c1_tok_s": 50.0, "c4_tok_s": 100.0, "seed_config": seed}}
        with pytest.raises(ValueError, match="does not reproduce the field report"):
            speed_basis.from_contract("3x3090", "r.json", "2026-12-07", doc)


def test_no_basis_says_so():
    assert speed_basis.describe(speed_basis.basis_for("3x3090")) == "no measured basis yet"
    assert speed_basis.to_json(None)["basis"] is None


def _summary(c1, c4):
    records = [rec(0.0, [0.5 + i / c1 for i in range(9)])]
    records += [rec(0.0, [0.5 + i * 4 / c4 for i in range(9)], conc=4, run=r) for r in range(4)]
    return bench.summarize(records)


def test_bench_json_names_the_projection_it_is_held_to(monkeypatch):
    plan = {"profile": "3x3090", "decode": {"tokens_per_s": 189.57}}
    result = bench.build_result(
        bench.BenchConfig("http://x:1", "m"),
        [rec(0.0, [0.5 + i / 40 for i in range(9)])],
        bench.fingerprint(None, plan, None),
    )
    none = result["projection"]
    assert none["says"] == "no measured basis yet" and none["basis"] is None
    assert [r["projected"] for r in none["rows"]] == [None, None, None]
    assert none["rows"][0]["measured"] == pytest.approx(40.0)

    basis = speed_basis.from_contract(
        "3x3090", "checks/gpu/results/made-up.json", "2026-12-07", MADE_UP_CONTRACT
    )
    monkeypatch.setitem(speed_basis.MEASURED, "3x3090", basis)
    got = speed_basis.bench_comparison(_summary(40.0, 80.0), plan)
    assert got["basis"]["run"] == "checks/gpu/results/made-up.json"
    assert "2026-12-07" in got["says"] and "not measured on 3090s" in got["says"]
    rows = {r["metric"]: r for r in got["rows"]}
    assert rows["decode tok/s, c=1"]["ratio"] == pytest.approx(40.0 / 50.0)
    assert rows["decode tok/s, c=4"]["projected"] == 100.0
    # The contract projects no TTFT: none is compared, none invented.
    assert rows["TTFT s"]["projected"] is None


def test_plan_rows_show_a_basis_with_its_run_and_date(monkeypatch):
    from flashnext.render import speed_rows

    assert speed_rows("3x3090")[0][1] == "no measured basis yet"
    basis = speed_basis.from_contract("3x3090", "r.json", "2026-12-07", MADE_UP_CONTRACT)
    monkeypatch.setitem(speed_basis.MEASURED, "3x3090", basis)
    (_, value, why), = speed_rows("3x3090")  # fmt: skip
    assert value == "50 / 100" and "r.json (2026-12-07)" in why
