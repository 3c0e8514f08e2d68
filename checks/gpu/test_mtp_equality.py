"""The MTP equality run's bookkeeping (checks/gpu/mtp_equality.py) on recorded-shape runs.

No engine runs here: the records are what in_vllm_worker.py writes (generated
ids, top-k logprobs, vLLM's spec-decode counters), so the verdict is checked
before a GPU call depends on it. That vLLM 0.33.0 builds the two engines'
configs is checked in checks/patches/test_tiny_gpu_checkpoint.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import in_vllm_worker
import mtp_equality
import pytest


def request(ids, margin=3.0):
    """One request's record: generated ids and a top-2 logprob pair per step."""
    return {
        "output_ids": list(ids),
        "output_logprobs": [{str(t): -0.1, "7": -0.1 - margin} for t in ids],
        "prompt_logprobs": [],
    }


def engines(off_ids, on_ids, counts, cases=("100x1", "3000x4")):
    return {
        "mtp-off": {"cases": {c: [request(i) for i in off_ids] for c in cases}},
        "mtp-on": {
            "cases": {c: [request(i) for i in on_ids] for c in cases},
            "spec_decode": counts,
        },  # fmt: skip
        "timing-mtp-off": {"timing": [{"decode_tok_s": 200.0}]},
        "timing-mtp-on": {"timing": [{"decode_tok_s": 300.0}]},
    }


COUNTS = {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 36}


def test_only_the_on_engine_drafts_with_mtp():
    args = SimpleNamespace(model="/m", tables=mtp_equality.Path("/t"), gpu_memory_utilization=0.05,
                           speculative_tokens=3)  # fmt: skip
    specs = {r.name: mtp_equality.engine_spec(r, args, {"100x1": [[1, 2]]}, [5] * 10)
             for r in mtp_equality.runs()}  # fmt: skip
    assert set(specs) == {"mtp-off", "mtp-on", "timing-mtp-off", "timing-mtp-on"}
    mtp = {"method": "mtp", "num_speculative_tokens": 3}
    assert specs["mtp-on"]["speculative_config"] == specs["timing-mtp-on"]["speculative_config"]
    assert specs["mtp-on"]["speculative_config"] == mtp
    assert "speculative_config" not in specs["mtp-off"]
    for spec in specs.values():
        assert spec["graphs"] == "full_decode_only" and spec["table"].endswith("ple-packed.bin")
        assert spec["max_new_tokens"] == mtp_equality.NEW_TOKENS
        assert spec["prompt_logprobs"] is False
    assert specs["timing-mtp-on"]["cases"] == {} and specs["timing-mtp-on"]["timed_batches"]
    assert specs["mtp-on"]["timed_batches"] == []


def test_equal_ids_and_acceptance_in_the_band_pass():
    v = mtp_equality.verdict(engines([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], COUNTS))
    assert v["ok"] is True
    assert [r["equal"] for r in v["cases"]] == [True, True]
    assert v["acceptance"] == pytest.approx(0.45)
    assert v["decode_ratio_on_over_off"] == pytest.approx(1.5)


def test_a_parting_names_the_position_and_the_margin_there():
    v = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 9, 3]], COUNTS))
    row = v["cases"][0]
    assert v["ok"] is False and row["equal"] is False
    assert (row["request"], row["position"]) == (0, 1)
    assert row["margin"] == pytest.approx(3.0)
    assert "generated token 1: 2 without MTP, 9 with" in row["why"]


def test_a_shorter_output_is_unequal():
    row = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 2]], COUNTS))["cases"][0]
    assert row["equal"] is False and row["position"] == 2


@pytest.mark.parametrize(
    "counts",
    [
        {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 2},  # random drafter: ~0
        {"drafts": 40, "draft_tokens": 80, "accepted_tokens": 79},  # rejections never ran
        {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0},  # nothing drafted
    ],
)
def test_acceptance_outside_the_band_fails_even_when_equal(counts):
    v = mtp_equality.verdict(engines([[1, 2, 3]], [[1, 2, 3]], counts))
    assert all(r["equal"] for r in v["cases"])
    assert v["ok"] is False


def test_a_failed_engine_fails_the_run():
    records = engines([[1, 2, 3]], [[1, 2, 3]], COUNTS)
    records["mtp-on"] = {"run": "mtp-on", "error": "exit 1", "log_tail": []}
    v = mtp_equality.verdict(records)
    assert v["ok"] is False and v["errors"] == {"mtp-on": "exit 1"}
    assert v["cases"][0]["why"] == "mtp-on has no result"


@dataclass
class Counter:  # vllm.v1.metrics.reader.Counter's fields
    name: str
    labels: dict[str, str]
    value: int


def test_the_workers_counts_sum_vllms_spec_decode_counters():
    metrics = [
        Counter("vllm:spec_decode_num_draft_tokens", {"engine": "0"}, 80),
        Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "0"}, 30),
        Counter("vllm:spec_decode_num_accepted_tokens", {"engine": "1"}, 6),
        Counter("vllm:spec_decode_num_drafts", {"engine": "0"}, 40),
        Counter("vllm:prompt_tokens", {"engine": "0"}, 999),
    ]
    assert in_vllm_worker.spec_decode_counts(metrics) == COUNTS


def test_markdown_renders():
    result = {
        "run_id": "t", "speculative_tokens": 2,
        "host": {"gpu": "GPU", "torch": "2.11", "note": "note"},
        "verdict": mtp_equality.verdict(engines([[1, 2, 3]], [[1, 9, 3]], COUNTS)),
    }  # fmt: skip
    text = mtp_equality.markdown(result)
    assert "| 100 | 1 | False | request 0, generated token 1" in text
    assert "acceptance (accepted / drafted tokens): 0.450" in text and "ok: False" in text
