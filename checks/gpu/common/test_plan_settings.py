"""checks/gpu/common/plan_settings.py, and the PP=3 harness held to the plan it tests.

The plan is `flashnext plan --json` for the h200-tiny-pp3 profile on the real
12-layer tiny checkpoint with replayed facts of three H200s; vLLM 0.33.0's
own `vllm serve` parser (in the pinned env: FLASHNEXT_VLLM_PY) turns its argv
into LLM(...) arguments. When the profile changes, the plan's arguments
change with it, and every engine of the PP=3 harness (checks/gpu/pp3:
orchestrate.py's specs, engine.py's LLM(...) arguments) must follow, differing
only in the overrides it names.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

GPU = Path(__file__).resolve().parents[1]
REPO = GPU.parents[1]
sys.path.insert(0, str(GPU / "pp3"))
sys.path.insert(0, str(GPU / "common"))

import plan_settings  # noqa: E402
from tiny_plan import in_vllm, in_vllm_json, tiny_checkpoint, vllm_python, write_plan  # noqa: E402

PROFILE = "h200-tiny-pp3"
PLAN_SETTINGS = GPU / "common" / "plan_settings.py"


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("plan-settings")
    model, table = tiny_checkpoint(root, vllm_python(), layers=12)
    path = write_plan(root / "plan.json", model, table, PROFILE, gpus=3)
    return path, model, table


def settings(plan_path: Path, *overrides: str) -> dict:
    return in_vllm_json(str(PLAN_SETTINGS), str(plan_path), *overrides)


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
    out = in_vllm(str(PLAN_SETTINGS), str(plan[0]), "no_such_field=1")
    assert out.returncode != 0 and "'no_such_field' is not an EngineArgs field" in out.stderr


def test_a_patched_only_flag_overridden_to_none_never_reaches_the_parser(plan, tmp_path):
    """Stock's parser rejects the plan's --engram-config (no mmap_path there): an
    engine that unsets it must drop it before parsing. A value no parser takes
    shows it was never parsed."""
    doc = json.loads(plan[0].read_text())
    argv = doc["argv"]
    argv[argv.index("--engram-config") + 1] = '{"no_such_field": 1}'
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    out = settings(path, "engram_config=null")
    assert "engram_config" not in out["kwargs"] and out["overrides"] == {"engram_config": None}


def test_overrides_reach_a_serve_argv_by_name():
    """The rank-fit harness starts `vllm serve`'s own argv: overrides by EngineArgs name."""
    from plan_settings import argv_with_overrides

    argv = ["/m", "--pipeline-parallel-size", "3", "--engram-config", "{}", "--max-num-seqs", "4"]
    out = argv_with_overrides(argv, {
        "model": "/slice", "pipeline_parallel_size": 1, "load_format": "dummy",
        "skip_tokenizer_init": True, "engram_config": None,
        "additional_config": {"gdn_prefill_backend": "triton"},
    })  # fmt: skip
    assert out == [
        "/slice", "--pipeline-parallel-size", "1", "--max-num-seqs", "4",
        "--load-format", "dummy", "--skip-tokenizer-init",
        "--additional-config", '{"gdn_prefill_backend": "triton"}',
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--no- flag"):
        argv_with_overrides(argv, {"enable_prefix_caching": False})


# What a PP=3 harness engine may differ in from the plan, and why (pp3/engine.py).
PP3_OVERRIDES = {
    "model",  # the echo-drafter copy (MTP), the PLE-off stock copy
    "pipeline_parallel_size",  # PP=1: the reference
    "distributed_executor_backend",  # "mp": three ranks on one GPU (the emulation)
    "enforce_eager", "compilation_config",  # the eager modes
    "engram_config",  # PLE in VRAM (the PLE A/B, stock)
    "speculative_config", "disable_log_stats",  # MTP on in the profile's mode only
    "load_format",  # dummy weights for stock's copy
    "max_num_batched_tokens",  # the reference in other prefill chunks (spread-schedule)
}  # fmt: skip

ENGINE_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import engine
from plan_settings import _printable
out = {}
for name, spec in json.loads(open(sys.argv[2]).read()).items():
    kwargs, applied = engine.engine_kwargs(spec)
    out[name] = {"kwargs": {k: _printable(v) for k, v in kwargs.items()}, "overrides": applied}
print(json.dumps(out, default=str))
"""


def pp3_engines(plan_doc: dict, model: Path, table: Path) -> dict:
    """Every PP=3 harness engine's LLM(...) arguments and overrides, as engine.py builds them."""
    from types import SimpleNamespace

    import orchestrate

    args = SimpleNamespace(
        model=model, stock_model=model.parent / "stock", echo_model=model.parent / "echo",
        tables=table.parent, plan=plan_doc,
    )  # fmt: skip
    engines = orchestrate.diagnose_engines() + orchestrate.equality_engines()
    specs = {e.name: orchestrate.spec_for(e, args) for e in engines}
    path = table.parent / "specs.json"
    path.write_text(json.dumps(specs))
    return in_vllm_json("-c", ENGINE_SIDE, str(GPU / "pp3"), str(path))


def test_the_pp3_engines_run_the_plans_settings(plan):
    """Every PP=3 harness engine is the plan's engine but for named overrides."""
    import orchestrate

    path, model, table = plan
    doc = settings(path)["kwargs"]
    doc_argv = json.loads(path.read_text())["argv"]
    engines = pp3_engines(json.loads(path.read_text()), model, table)
    for name, engine in engines.items():
        kwargs, applied = engine["kwargs"], engine["overrides"]
        assert set(applied) <= PP3_OVERRIDES, (name, applied)
        for key in set(doc) | set(kwargs):
            if key not in applied:
                assert kwargs.get(key) == doc.get(key), (name, key)
    graphs = engines["pp3-graphs-offload-mtp"]
    # MTP turned on by the harness: the decode graphs the launcher's MTP plan
    # captures (a decode of n requests is 2n tokens), the plan's mode and mode.
    plan_compilation = json.loads(plan_settings.flag_value(doc_argv, "--compilation-config"))
    assert graphs["kwargs"]["compilation_config"] == plan_compilation | {
        "cudagraph_capture_sizes": [1, 2, 4, 8]
    }
    assert graphs["overrides"] == {
        "distributed_executor_backend": "mp",
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
        "disable_log_stats": False,
        "model": str(model.parent / "echo"),
        "compilation_config": graphs["kwargs"]["compilation_config"],
    }
    assert engines["pp1-eager-vram"]["overrides"] == {
        "pipeline_parallel_size": 1, "enforce_eager": True, "compilation_config": None,
    }  # fmt: skip
    rechunk = engines["pp1-eager-vram-rechunk"]
    assert rechunk["overrides"] == engines["pp1-eager-vram"]["overrides"] | {
        "max_num_batched_tokens": orchestrate.RECHUNK_TOKENS
    }
    assert rechunk["kwargs"]["max_num_batched_tokens"] != doc["max_num_batched_tokens"]


def test_the_pp3_engines_follow_a_changed_profile(plan):
    """A profile setting changed in the plan reaches every engine of the harness."""
    path, model, table = plan
    doc = json.loads(path.read_text())
    argv = doc["argv"]
    for flag, value in (("--max-num-seqs", "7"), ("--max-num-batched-tokens", "1024")):
        argv[argv.index(flag) + 1] = value
    engines = pp3_engines(doc, model, table)
    rechunk = engines.pop("pp1-eager-vram-rechunk")  # its own budget, by name
    assert {(e["kwargs"]["max_num_seqs"], e["kwargs"]["max_num_batched_tokens"])
            for e in engines.values()} == {(7, 1024)}  # fmt: skip
    assert rechunk["kwargs"]["max_num_seqs"] == 7


def test_engines_leave_the_plans_offload_env_only_in_vram_modes(plan):
    """The plan's environment is each engine's; VRAM modes drop the QSA offload variables."""
    from types import SimpleNamespace

    import orchestrate

    path, model, table = plan
    plan_doc = json.loads(path.read_text())
    args = SimpleNamespace(model=model, stock_model=model, echo_model=model,
                           tables=table.parent, plan=plan_doc)  # fmt: skip
    engines = {e.name: e for e in orchestrate.equality_engines()}
    offload = orchestrate.spec_for(engines["pp1-graphs-offload-mtp"], args)
    vram = orchestrate.spec_for(engines["pp1-eager-vram"], args)
    assert offload["env"] == plan_doc["env"] and offload["env_dropped"] == []
    assert vram["env_dropped"] == list(plan_settings.QSA_OFFLOAD_ENV)
    assert vram["env"] == {
        k: v for k, v in plan_doc["env"].items() if k not in plan_settings.QSA_OFFLOAD_ENV
    }
