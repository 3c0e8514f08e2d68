"""The A/B's and the MTP run's engines held to the h200-tiny plans they test.

The plans are `flashnext plan --json` of the h200-tiny profile (MTP off, and
with `--mtp 1`, `--mtp 2`) on the real tiny checkpoint with replayed facts of
the lent H200 (tiny_plan.py), as checks/gpu/ab/run-in-vllm writes them on the
GPU host. Each engine's LLM(...) arguments are what in_vllm_worker.py builds
from the spec its orchestrator writes (in_vllm_ab.py, mtp_equality.py), under
vLLM 0.33.0 (FLASHNEXT_VLLM_PY). An engine differs from its plan only in the
overrides its harness names, and a profile setting changed in the plan
reaches every engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

GPU = Path(__file__).resolve().parents[1]
for folder in ("common", "ab", "mtp"):
    sys.path.insert(0, str(GPU / folder))

import in_vllm_ab  # noqa: E402
import mtp_equality  # noqa: E402
from plan_settings import QSA_OFFLOAD_ENV  # noqa: E402
from tiny_plan import in_vllm_json, tiny_checkpoint, vllm_python, with_flag, write_plan  # noqa: E402

PROFILE = in_vllm_ab.PROFILE
KS = [1, 2]
GAIN = 8.0

# What an A/B engine may differ in from the plan, and why (in_vllm_ab.run_overrides).
AB_OVERRIDES = {
    "enforce_eager", "compilation_config",  # the eager runs
    "engram_config",  # stock's own PLE (no --engram-config); the page-aligned table
}  # fmt: skip
# What an MTP engine may differ in from its K's plan (mtp_equality.engine_spec).
MTP_OVERRIDES = {
    "model",  # the echo-drafter copy
    "disable_log_stats",  # vLLM's spec-decode counters
    "cpu_offload_gb", "cpu_offload_params",  # the drafter in VRAM but in the serving setup
}  # fmt: skip

ENGINE_SIDE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import in_vllm_worker
from plan_settings import _printable
out = {"engines": {}, "plans": {}}
for name, spec in json.loads(open(sys.argv[2]).read()).items():
    kwargs, applied = in_vllm_worker.engine_kwargs(spec)
    printable = {k: _printable(v) for k, v in kwargs.items()}
    out["engines"][name] = {"kwargs": printable, "overrides": applied}
    plain, _ = in_vllm_worker.engine_kwargs({"plan": spec["plan"], "overrides": {}})
    out["plans"][name] = {k: _printable(v) for k, v in plain.items()}
print(json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """(model, table, {K: plan}) with K = 0 the plan without MTP."""
    root = tmp_path_factory.mktemp("tiny-engines")
    model, table = tiny_checkpoint(root, vllm_python())
    docs = {}
    for k in (0, *KS):
        path = write_plan(root / f"plan-mtp{k}.json", model, table, PROFILE, mtp=k or None)
        docs[k] = json.loads(path.read_text())
    return model, table, docs


def harness_args(model: Path, table: Path, docs: dict[int, dict]) -> SimpleNamespace:
    return SimpleNamespace(
        model=model, tables=table.parent, plan=docs[0], gpu_memory_utilization=None,
        mtp_plans={k: docs[k] for k in KS}, drafter_models={GAIN: model.parent / "echo-g8"},
    )  # fmt: skip


def ab_specs(args) -> dict[str, dict]:
    cases, timed = {"100x1": [[5, 6]]}, [[7, 8]] * 4
    return {r.name: in_vllm_ab.worker_spec(r, args, cases, timed) for r in in_vllm_ab.all_runs()}


def mtp_specs(args) -> dict[str, dict]:
    arms = mtp_equality.compared_arms(KS, [GAIN]) + mtp_equality.timed_arms(KS, GAIN)
    return {a.name: mtp_equality.engine_spec(a, args, {"100x1": [[5, 6]]}, [7, 8]) for a in arms}


def engines(specs: dict[str, dict], tmp: Path) -> dict:
    """Each spec's LLM(...) arguments and overrides, as in_vllm_worker.py builds them,
    and the arguments of its plan alone."""
    path = tmp / "specs.json"
    path.write_text(json.dumps(specs))
    return in_vllm_json("-c", ENGINE_SIDE, str(GPU / "ab"), str(path))


def assert_plan_but_overrides(built: dict, allowed: set[str]) -> None:
    for name, engine in built["engines"].items():
        kwargs, applied, plan = engine["kwargs"], engine["overrides"], built["plans"][name]
        assert set(applied) <= allowed, (name, applied)
        for key in set(plan) | set(kwargs):
            if key not in applied:
                assert kwargs.get(key) == plan.get(key), (name, key)


def test_the_plans_are_the_profiles_with_mtp_only_where_asked(plans):
    from flashnext.profiles import available_profiles

    model, table, docs = plans
    profile = available_profiles()[PROFILE]
    for k, doc in docs.items():
        argv = doc["argv"]
        assert doc["profile"] == PROFILE and argv[2] == str(model)
        assert argv[argv.index("--max-num-seqs") + 1] == str(profile.scheduler.max_num_seqs)
        assert json.loads(argv[argv.index("--engram-config") + 1])["mmap_path"] == str(table)
        assert mtp_equality.plan_tokens(doc) == k
        assert doc["env"] == docs[0]["env"]
        assert ("--cpu-offload-params" in argv) == bool(k)


def test_the_ab_engines_run_the_plans_settings(plans, tmp_path):
    model, table, docs = plans
    specs = ab_specs(harness_args(model, table, docs))
    built = engines(specs, tmp_path)
    assert_plan_but_overrides(built, AB_OVERRIDES)
    got = {name: e["overrides"] for name, e in built["engines"].items()}
    eager = {"enforce_eager": True, "compilation_config": None}
    assert got["a-eager"] == eager | {"engram_config": None}
    assert got["a-full_decode_only"] == {"engram_config": None}
    assert "engram_config" not in built["engines"]["a-eager"]["kwargs"]  # stock's parser
    aligned = {"engram_config": {"mmap_path": str(table.parent / "ple-aligned.bin")}}
    assert got["b-aligned-full_decode_only"] == aligned
    assert got["b-packed-eager"] == got["c-eager"] == got["sensitivity-eager"] == eager
    assert got["c-full_decode_only"] == got["timing-b"] == got["timing-c"] == {}
    for name, spec in specs.items():  # the plan's environment, offload only where offloaded
        offload = name.startswith(("c-", "sensitivity", "timing-c"))
        dropped = [] if offload else list(QSA_OFFLOAD_ENV)
        assert spec["env_dropped"] == dropped, name
        plan_env = {k: v for k, v in docs[0]["env"].items() if k not in dropped}
        assert spec["env"] == plan_env | in_vllm_ab.HARNESS_ENV, name


def test_the_mtp_engines_run_their_ks_plans_settings(plans, tmp_path):
    model, table, docs = plans
    specs = mtp_specs(harness_args(model, table, docs))
    built = engines(specs, tmp_path)
    assert_plan_but_overrides(built, MTP_OVERRIDES)
    got = {name: e["overrides"] for name, e in built["engines"].items()}
    echo = {"model": str(model.parent / "echo-g8"), "disable_log_stats": False}
    in_vram = {"cpu_offload_gb": None, "cpu_offload_params": None}
    assert got["mtp-on-offload-k2-g8"] == echo  # the serving setup: the plan as it is
    assert got["mtp-on-k1-g8"] == got["mtp-on-k2-g8"] == echo | in_vram
    assert got["mtp-off"] == got["mtp-off-offload"] == got["timing-mtp-off"] == {}
    for k in KS:
        mtp = built["engines"][f"mtp-on-k{k}-g8"]["kwargs"]["speculative_config"]
        assert str(mtp["num_speculative_tokens"]) == str(k), mtp
    serving = built["engines"]["mtp-on-offload-k2-g8"]["kwargs"]
    assert (
        serving["cpu_offload_params"]
        == built["plans"]["mtp-on-offload-k2-g8"]["cpu_offload_params"]
    )


def test_the_ab_and_mtp_engines_follow_a_changed_profile(plans, tmp_path):
    """A profile setting changed in the plans reaches every engine of both harnesses."""
    model, table, docs = plans
    changed = {}
    for k, doc in docs.items():
        doc = with_flag(doc, "--max-num-seqs", "7")
        changed[k] = with_flag(doc, "--max-num-batched-tokens", "1024") | {
            "env": doc["env"] | {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.5"}
        }
    args = harness_args(model, table, changed)
    specs = {f"ab/{n}": s for n, s in ab_specs(args).items()}
    specs |= {f"mtp/{n}": s for n, s in mtp_specs(args).items()}
    built = engines(specs, tmp_path)["engines"]
    assert {(e["kwargs"]["max_num_seqs"], e["kwargs"]["max_num_batched_tokens"])
            for e in built.values()} == {(7, 1024)}  # fmt: skip
    alloc = {s["env"]["PYTORCH_CUDA_ALLOC_CONF"] for s in specs.values()}
    assert alloc == {"garbage_collection_threshold:0.5"}
