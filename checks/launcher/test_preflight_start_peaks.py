"""rank{r}.start: each card's free memory against its rank's predicted start peak.

The prediction is plan/start_peak.py's (held to the rank-fit run of record in
test_start_peak.py); the profile's measured figures stay for the MTP load check.
The failure kinds themselves are variants in lead_fixtures.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from flashnext.assess import assess
from flashnext.plan.planner import PlanOptions
from flashnext.profiles import available_profiles
from lead_fixtures import base_facts

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "checks" / "gpu" / "results"
sys.path.insert(0, str(REPO / "checks" / "gpu" / "rank_fit"))

from rank_fit import RUN_OF_RECORD  # noqa: E402  (the run the gpu suite holds to the plan)


def test_the_profiles_start_peaks_are_the_run_of_records():
    merged = json.loads((RESULTS / f"rank_fit-{RUN_OF_RECORD}.json").read_text())
    measured = tuple(r["peak_bytes"] for r in sorted(merged["ranks"], key=lambda r: r["rank"]))
    assert all(r["ok"] for r in merged["ranks"])
    assert available_profiles()["3x3090"].memory.measured_start_peak_bytes == measured


def test_each_rank_is_checked_on_its_own_card(full_skeleton, full_model):
    opts = PlanOptions(model_dir=str(full_skeleton), table_path="/nvme/flashnext/ple-table.bin")
    a = assess(base_facts(), opts, None, model=full_model)
    start = {f.id: f for f in a.findings if f.id.endswith(".start")}
    assert sorted(start) == ["rank0.start", "rank1.start", "rank2.start"]
    for rank, planned in enumerate(a.plan.ranks):
        f = start[f"rank{rank}.start"]
        assert f.level == "ok"
        need = planned.start_peak.predicted_bytes
        assert (f.measured_bytes, f.required_bytes) == (25_390_219_264, need)
