"""The A/B orchestrator's bookkeeping (checks/gpu/ab/in_vllm_ab.py) on recorded-shape runs.

No engine runs here: the records are what in_vllm_worker.py writes, so the
verdict table, the sensitivity flag and the markdown are checked before a
GPU call depends on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

import in_vllm_ab  # noqa: E402
from test_logprob_compare import base, changed  # noqa: E402

CASE = "100x1"


def record(name, prompt_request):
    return {"run": name, "cases": {CASE: [prompt_request]}, "timing": []}


def test_verdicts_mark_equal_runs_and_a_changed_sensitivity_run():
    runs = in_vllm_ab.all_runs()
    records = {run.name: record(run.name, base()) for run in runs if not run.timed}
    records["sensitivity-eager"] = record(
        "sensitivity-eager", changed(base(), 2, {50: -0.1, 51: -0.3})
    )
    rows, changed_flag = in_vllm_ab.verdicts(records, runs)
    by_run = {r["run"]: r for r in rows}
    assert changed_flag is True
    assert not by_run["sensitivity-eager"]["equal"]
    assert all(r["equal"] for r in rows if r["mode"] != "sensitivity")
    assert {r["run"] for r in rows} == {run.name for run in runs if run.mode not in ("a", "timing")}


def test_a_failed_engine_is_a_row_that_is_not_equal():
    runs = in_vllm_ab.all_runs()
    records = {run.name: record(run.name, base()) for run in runs if not run.timed}
    records["c-eager"] = {"run": "c-eager", "error": "exit 1", "log_tail": ["boom"]}
    rows, _ = in_vllm_ab.verdicts(records, runs)
    failed = [r for r in rows if r["run"] == "c-eager"]
    assert failed == [
        {"run": "c-eager", "mode": "c", "graphs": "eager", "equal": False, "error": "exit 1"}
    ]


def test_markdown_and_timing_ratios_render():
    runs = in_vllm_ab.all_runs()
    records = {run.name: record(run.name, base()) for run in runs if not run.timed}
    timing = {
        "batch": 1, "prompt_tokens": 3000, "ttft_s": 0.2, "decode_tok_s": 200.0,
        "ple_gather_decode": {"mean_us": 400.0}, "ple_gather_prefill": {"mean_us": 1400.0},
    }  # fmt: skip
    records["timing-b"] = {"timing": [timing]}
    records["timing-c"] = {"timing": [timing | {"decode_tok_s": 150.0}]}
    rows, flag = in_vllm_ab.verdicts(records, runs)
    result = {
        "run_id": "t",
        "host": {"gpu": "GPU", "torch": "2.11", "note": "note"},
        "runs": rows,
        "sensitivity_changed": flag,
        "timing": in_vllm_ab.timing_ratios(records),
    }
    assert result["timing"][0]["decode_ratio_c_over_b"] == 0.75
    text = in_vllm_ab.markdown(json.loads(json.dumps(result)))
    assert "| b-packed-eager | eager | 100 | 1 | True |" in text
    assert "| 1 | 0.200 / 0.200 | 1.00 | 200.0 / 150.0 | 0.75 | 400 / 400 |" in text
