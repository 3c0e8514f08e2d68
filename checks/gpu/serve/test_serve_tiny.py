"""serve-tiny's parts one at a time: the launcher's JSON read as one line each, the
results JSON from the steps, and /proc read for what is left of a server (a real
process titled like vLLM's engine). The whole run, step by step, against the
stand-in `vllm`: checks/launcher/test_serve_tiny_script.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_procs import env_differences, leftovers  # noqa: E402
from serve_readout import bench_line, plan_line, preflight_lines  # noqa: E402
from serve_result import Facts, Step, document  # noqa: E402


def decode(concurrency: int, median: float | None) -> dict:
    agg = {"median": median} if median is not None else None
    return {"concurrency": concurrency, "aggregate_tok_s": agg, "ttft_s": {"median": 0.05}}


def bench_doc(*decodes, rejected=(), spec=None) -> dict:
    return {
        "summary": {"decode": list(decodes), "prefill": []},
        "rejected": list(rejected),
        "spec_decode": spec,
    }


def write(tmp_path: Path, name: str, doc: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


def test_bench_passes_with_both_concurrencies_and_nothing_rejected(tmp_path):
    path = write(tmp_path, "b.json", bench_doc(decode(1, 70.7), decode(4, 299.4)))
    assert bench_line(path, 0) == (True, "c=1 70.7 tok/s, TTFT 50 ms; c=4 299.4 tok/s, TTFT 50 ms")


def test_bench_fails_without_c4_a_rejected_run_or_mtp_drafts(tmp_path):
    only_c1 = write(tmp_path, "a.json", bench_doc(decode(1, 70.7)))
    assert bench_line(only_c1, 0)[0] is False
    why = {"phase": "decode", "concurrency": 4, "run": 1, "why": "stream ended without [DONE]"}
    rejected = write(tmp_path, "r.json", bench_doc(decode(1, 1.0), decode(4, 1.0), rejected=[why]))
    ok, line = bench_line(rejected, 0)
    assert not ok and line.endswith("rejected decode c=4 run 1: stream ended without [DONE]")
    no_drafts = write(tmp_path, "m.json", bench_doc(decode(1, 1.0), decode(4, None)))
    ok, line = bench_line(no_drafts, 1)
    assert not ok and "c=4 (no aggregate window)" in line
    assert line.endswith("MTP K=1 asked, but the server's /metrics counted no draft tokens")
    assert bench_line(tmp_path / "missing.json", 0)[1].startswith("no bench JSON (")


def test_preflight_lines_name_each_finding_that_is_not_ok(tmp_path):
    findings = [
        {"level": "ok", "id": "gpu.count", "measured": "1x", "required": "1x", "message": "m",
         "fix": ""},
        {"level": "fail", "id": "gpu0.vram", "measured": "40 GiB", "required": ">= 75 GiB",
         "message": "too small", "fix": "use the card"},
    ]  # fmt: skip
    path = write(tmp_path, "p.json", {"profile": "h200-tiny", "findings": findings})
    assert preflight_lines(path) == [
        "  fail gpu0.vram: 40 GiB (required >= 75 GiB): too small; fix: use the card",
        "  profile h200-tiny: 1 failed, 0 warnings, 1 ok",
    ]
    assert preflight_lines(tmp_path / "none.json")[0].startswith("no preflight JSON (")


def test_plan_line_reads_the_pipeline_and_mtp_from_the_argv():
    argv = ["vllm", "serve", "m", "--pipeline-parallel-size", "3", "--speculative-config",
            json.dumps({"method": "mtp", "num_speculative_tokens": 2})]  # fmt: skip
    plan = {"argv": argv, "kv_cache_memory_bytes": {"value": 5}, "pinned_bytes_needed": 7}
    assert plan_line(plan) == "PP 3 - MTP K=2 - kv 5 bytes, pinned 7 bytes"
    assert plan_line({"argv": ["vllm"]}) == ""


def test_the_result_reads_the_bench_only_when_this_run_wrote_it(tmp_path):
    write(tmp_path, "bench.json", bench_doc(decode(1, 2.0), decode(4, 8.0)))
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 << 20}
    write(tmp_path, "preflight.json", {"facts": {"gpu": {"devices": [h100]}}})
    facts = Facts(profile="h200-tiny", emulated=False, mtp_k=0, pp_size=1, gpu_count=1)
    steps = [Step("preflight", "ok", 1, ""), Step("bench", "ok", 1, ""), Step("stop", "ok", 1, ""),
             Step("processes", "ok", 1, ""), Step("gpu", "skipped", 0, "")]  # fmt: skip
    doc = document(facts, steps, failed=False, seconds=3, out=tmp_path)
    assert doc["serve"] == {"health": False, "smoke": False, "bench_c1_tok_s": 2.0,
                            "bench_c4_tok_s": 8.0, "clean_stop": True}  # fmt: skip
    assert doc["devices"] == 1
    assert doc["card"] == h100 | {
        "source": "preflight.json's facts: probed on this host by preflight"
    }
    assert doc["replayed_facts"] is doc["emulation"] is doc["mtp"] is None
    skipped = [Step("bench", "skipped", 0, "no server"), *steps[2:4], Step("gpu", "FAILED", 0, "")]
    doc = document(facts, skipped, failed=True, seconds=3, out=tmp_path)
    assert doc["card"] is None  # no preflight in this run: its file is not this run's
    assert doc["serve"]["bench_c1_tok_s"] is None and doc["serve"]["clean_stop"] is False


def execed(pid: int, argv0: bytes, within_s: float = 10.0) -> None:
    """Wait until `pid` runs its own program: before exec, /proc shows the parent's
    argv and environment."""
    deadline = time.monotonic() + within_s
    while not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(argv0):
        assert time.monotonic() < deadline, f"{pid} never ran {argv0!r}"
        time.sleep(0.01)


def test_a_process_titled_like_the_engine_is_left_and_named():
    prefix = f"TESTST{os.getpid()}::"
    decoy = subprocess.Popen([f"{prefix}EngineCore_DP0", "60"], executable="sleep")
    try:
        execed(decoy.pid, prefix.encode())
        found = leftovers(None, "1", prefix, [])
        assert found == [f"{decoy.pid} (titled {prefix}): {prefix}EngineCore_DP0 60"]
        assert leftovers(None, "1", prefix, [decoy.pid])[0].startswith(
            f"{decoy.pid} (seen under serve)"
        )
    finally:
        decoy.kill()
        decoy.wait()
    assert leftovers(None, "1", prefix, []) == []


def test_the_shim_env_is_read_back_from_the_process():
    env = {"FLASHNEXT_PP_ONE_GPU": "1", "PYTHONPATH": "/shim:/other"}
    proc = subprocess.Popen(["sleep", "60"], env=env)
    try:
        execed(proc.pid, b"sleep")
        assert env_differences(proc.pid, ["FLASHNEXT_PP_ONE_GPU=1", "PYTHONPATH=/shim:/x"]) == (
            True,
            "",
        )
        ok, why = env_differences(proc.pid, ["NCCL_IB_DISABLE=1", "PYTHONPATH=/elsewhere"])
        assert not ok and why == (
            "NCCL_IB_DISABLE=(unset), not 1; PYTHONPATH starts with /shim, not /elsewhere"
        )
        assert env_differences(proc.pid, []) == (False, "")  # nothing asked: not proven
    finally:
        proc.kill()
        proc.wait()
