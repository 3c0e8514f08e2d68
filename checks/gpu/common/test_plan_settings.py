"""checks/gpu/common/plan_settings.py, and the PP=3 harness held to the plan it tests.

The plan is `flashnext plan --json` for the h200-tiny-pp3 profile on the real
12-layer tiny checkpoint with replayed facts of three H200s; vLLM 0.33.0's
own `vllm serve` parser (in the pinned env: FLASHNEXT_VLLM_PY) turns its argv
into LLM(...) arguments. When the profile changes, the plan's arguments
change with it, and the harness's engine (checks/gpu/pp3/engine.py) must
follow: the last test fails until it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1]
REPO = GPU.parents[1]
sys.path.insert(0, str(GPU / "pp3"))
sys.path.insert(0, str(REPO / "checks" / "launcher"))

import engine as pp3_engine  # noqa: E402

PROFILE = "h200-tiny-pp3"


def vllm_python() -> str:
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.skip("FLASHNEXT_VLLM_PY is not set (checks/run sets it to the pinned vLLM env)")
    return py


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    from h200_tiny_facts import h200_facts
    from test_profile_h200_tiny_pp3 import three_h200s

    py = vllm_python()
    root = tmp_path_factory.mktemp("plan-settings")
    model, table = root / "tiny12", root / "ple.bin"
    tiny_model = GPU / "tiny" / "tiny_model.py"
    subprocess.run([py, str(tiny_model), str(model), "--layers", "12"], check=True)
    subprocess.run(
        [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(model),
         "--out", str(table), "--force"],
        check=True, capture_output=True,
    )  # fmt: skip
    facts = root / "three.json"
    facts.write_text(json.dumps(three_h200s(h200_facts(model, table, 8000))))
    out = subprocess.run(
        [sys.executable, "-m", "flashnext", "plan", "--json", "--facts", str(facts),
         "--profile", PROFILE, "--model", str(model), "--table", str(table)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    path = root / "plan.json"
    path.write_text(out.stdout)
    return path, model, table


def settings(plan_path: Path, *overrides: str) -> dict:
    out = subprocess.run(
        [vllm_python(), str(GPU / "common" / "plan_settings.py"), str(plan_path), *overrides],
        capture_output=True, text=True, env=os.environ | {"VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_the_plan_becomes_the_profiles_engine_arguments(plan):
    from flashnext.profiles import available_profiles

    path, model, table = plan
    profile = available_profiles()[PROFILE]
    doc = settings(path)
    kw, env = doc["kwargs"], doc["env"]
    assert kw["model"] == str(model) and kw["engram_config"]["mmap_path"] == str(table)
    assert kw["pipeline_parallel_size"] == profile.parallel.pipeline_parallel_size == 3
    assert (kw["max_model_len"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (
        profile.scheduler.max_model_len,
        profile.scheduler.max_num_seqs,
        profile.scheduler.max_num_batched_tokens,
    )
    assert kw["enable_prefix_caching"] is profile.scheduler.enable_prefix_caching is False
    assert kw["kv_cache_memory_bytes"] == profile.memory.kv_cache_memory_bytes_max
    assert kw["gpu_memory_utilization"] == profile.memory.gpu_memory_utilization
    assert kw["additional_config"] == profile.vllm.additional_config
    assert env["VLLM_QSA_KV_OFFLOAD"] == "1"
    assert env["VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS"] == str(profile.qsa_offload.chunk_tokens)
    assert doc["overrides"] == {}


def test_overrides_are_named_and_recorded(plan):
    doc = settings(plan[0], "enforce_eager=true", "compilation_config=null")
    assert doc["kwargs"]["enforce_eager"] is True and "compilation_config" not in doc["kwargs"]
    assert doc["overrides"] == {"enforce_eager": True, "compilation_config": None}
    out = subprocess.run(
        [vllm_python(), str(GPU / "common" / "plan_settings.py"), str(plan[0]), "no_such_field=1"],
        capture_output=True, text=True, env=os.environ | {"VLLM_TARGET_DEVICE": "cpu"},
    )  # fmt: skip
    assert out.returncode != 0 and "'no_such_field' is not an EngineArgs field" in out.stderr


def test_the_pp3_engine_runs_the_profiles_settings(plan):
    """The PP=3 harness still builds LLM(...) itself; it must equal the plan in
    everything but the PLE table path and the emulation's executor."""
    path, model, table = plan
    doc = settings(path)["kwargs"]
    spec = {"model": str(model), "pp": 3, "graphs": "full_decode_only", "table": str(table)}
    ours = pp3_engine.engine_kwargs(spec)
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                 "enable_prefix_caching", "kv_cache_memory_bytes", "gpu_memory_utilization",
                 "additional_config", "language_model_only", "pipeline_parallel_size"):  # fmt: skip
        assert ours[name] == doc[name], name
    from flashnext.profiles import available_profiles

    graphs = available_profiles()[PROFILE].compilation
    assert ours["compilation_config"] == {
        "mode": graphs.mode,
        "cudagraph_mode": graphs.cudagraph_mode,
        "cudagraph_capture_sizes": list(graphs.cudagraph_capture_sizes),
    }
    assert ours["distributed_executor_backend"] == "mp"  # the one-GPU emulation's override
