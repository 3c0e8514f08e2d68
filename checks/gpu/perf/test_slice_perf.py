"""Issue 40 item 1's second basis on CPU: each rank's slice as an engine of its own
(rank_slice.py run for real), the dry run, the hand-off timer (gloo, the real code),
and the combination by hand on raw files made up for the test (not results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "rank_fit"))

import perf_contract  # noqa: E402
import projection  # noqa: E402
import rank_fit  # noqa: E402
import rank_slice  # noqa: E402
import slice_perf  # noqa: E402

RESULTS = HERE.parent / "results"
P1_INPUTS = RESULTS / "pp3_perf_inputs-h200-p1.json"
BANDWIDTH = RESULTS / "hbm_bandwidth-h200-b1.json"
SCRIPT = HERE / "slice_perf.py"


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    out = tmp_path_factory.mktemp("slices")
    return out, rank_slice.build(out)


def _run(*args, python=sys.executable):
    return subprocess.run([python, str(SCRIPT), *args], capture_output=True, text=True,
                          check=False)  # fmt: skip


def test_dry_run_starts_each_slice_alone_with_rank_fits_argv(sliced):
    out, doc = sliced
    proc = _run("run", "x", "--inputs", str(out), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    engines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [e["engine"] for e in engines] == ["slice0", "slice1", "slice2"]
    for e, rank in zip(engines, doc["ranks"], strict=True):
        assert e["argv"] == rank_fit.spec_argv(rank, out, [])
        assert e["argv"][e["argv"].index("--pipeline-parallel-size") + 1] == "1"
        assert e["argv"][0] == str(out / f"rank{rank['rank']}")  # the slice is the model
        b = rank_fit.budget(doc, rank)
        assert (e["ballast_free_bytes"], e["usable_bytes"]) == (b["target_free"], b["gate_budget"])
        assert [(c["kind"], c["concurrency"]) for c in e["cases"]] == [("decode", 1), ("decode", 4)]
    spec = slice_perf.spec_for(doc, 0, out)
    # The plan's environment, a 3090's kernels, and not the three-ranks-on-one-GPU shim.
    assert doc["plan_env"].items() <= spec["env"].items()
    assert spec["env"]["FLASHNEXT_PERF_3090_KERNELS"] == "1"
    assert "FLASHNEXT_PP_ONE_GPU" not in spec["env"]


def test_a_rank_not_in_the_inputs_is_refused(sliced):
    out, _ = sliced
    proc = _run("run", "x", "--inputs", str(out), "--ranks", "3", "--dry-run")
    assert proc.returncode != 0 and "no rank [3] in rank_fit.json (0-2)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(
    not os.environ.get("FLASHNEXT_VLLM_PY"),
    reason="FLASHNEXT_VLLM_PY unset: checks/run sets it (the pinned env's torch)",
)
def test_handoff_times_a_send_and_the_broadcast_between_processes(tmp_path):
    dest = tmp_path / "handoff.json"
    proc = _run("handoff", "--out", str(dest), "--backend", "gloo", "--iters", "5",
                "--rows", "1", "4", python=os.environ["FLASHNEXT_VLLM_PY"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(dest.read_text())
    assert doc["backend"] == "gloo" and doc["world"] == 3 and "test" in doc["transport"]
    assert set(doc["by_rows"]) == {"1", "4"}
    assert doc["by_rows"]["4"]["bytes"] == 4 * 10_240 * 2  # [rows, 2560 x 4] bf16
    for row in doc["by_rows"].values():
        assert row["send_ms"] > 0 and row["broadcast_ms"] > 0


def test_handoff_refuses_a_world_without_a_receiver(tmp_path):
    proc = _run("handoff", "--out", str(tmp_path / "h.json"), "--world", "1")
    assert proc.returncode == 2 and "--world 2 or more" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "h.json").exists()


def _made_up_slice(span_ms: float, sampler_us: float, rows: int) -> dict:
    """A slice engine's raw record, made up for the test (not a result)."""
    window = {"rank": 0, "decode_rows": [rows], "execute_gpu_span_ms": span_ms,
              "host_critical_ms": 0.5, "sample_tokens": {"gpu_us_median": sampler_us}}  # fmt: skip
    profile = [{"rank": 0, "compute_ms_per_step": span_ms - 1}]
    cases = [{"kind": "decode", "concurrency": c, "ranks": [window], "decode_tok_s": 99.0,
              "profile": profile} for c in (1, 4)]  # fmt: skip
    return {"ok": True, "cases": cases}


def test_combine_adds_each_rank_alone_and_the_handoffs_by_hand():
    inputs = json.loads(P1_INPUTS.read_text())
    bandwidth = json.loads(BANDWIDTH.read_text())
    raws = {0: _made_up_slice(5.0, 400.0, 1), 1: _made_up_slice(5.0, 400.0, 1),
            2: _made_up_slice(6.0, 500.0, 1)}  # fmt: skip
    hand = {"by_rows": {"1": {"send_ms": 0.2, "broadcast_ms": 0.1},
                        "4": {"send_ms": 0.3, "broadcast_ms": 0.1}}}  # fmt: skip
    doc = slice_perf.combine(raws, hand, inputs, bandwidth)
    one = doc["batches"][0]
    # 5 + 5 + (6 + the last rank's 0.5 ms sampler) + 2 sends of 0.2 + the 0.1 broadcast
    assert [s["span_ms"] for s in one["ranks"]] == [5.0, 5.0, 6.5]
    assert one["h200_token_ms"] == pytest.approx(17.0)
    assert one["h200_tok_s"] == pytest.approx(1000 / 17.0)
    links = projection.Links(bandwidth["results"]["read"]["bytes_per_s"],
                             bandwidth["results"]["h2d_pinned"]["bytes_per_s"])  # fmt: skip
    steps = []
    for r, span in enumerate([5.0, 5.0, 6.5]):  # combine's rows and context (3,000 + 64 / 2)
        b = perf_contract.rank_bytes_of(inputs, r)
        hbm = projection.hbm_bytes_per_step(b, inputs["config"], rows=1, context=3_032,
                                            kv_in_vram=False)["total"]  # fmt: skip
        pcie = projection.pcie_bytes_per_step(b, inputs["config"], rows=1, context=3_032,
                                              kv_in_vram=False)  # fmt: skip
        steps.append(projection.MeasuredStep(span, 0.5, pcie, hbm))
    assert one["projected_3090_tok_s"] == pytest.approx(
        1000 / (projection.round_ms(steps, links) + 0.5)
    )
    # Without the hand-offs nothing is added up.
    assert slice_perf.combine(raws, None, inputs, bandwidth)["batches"][0]["h200_token_ms"] is None
