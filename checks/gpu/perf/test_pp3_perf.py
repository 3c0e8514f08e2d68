"""Issue 27's harness on CPU: `pp3_perf.py prepare` for real (the full
skeleton, `flashnext plan` on the replayed 3090 facts, the sparse table),
the engines' argv against the plan, the dry run, the contract's schema and
the projection's arithmetic. Figures in the fixtures below are made up for
the test and labelled so: they are not results."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))

import perf_cases  # noqa: E402
import perf_contract  # noqa: E402
import perf_engine  # noqa: E402
import plan_settings  # noqa: E402
import pp3_perf  # noqa: E402
import projection  # noqa: E402
import seed_config  # noqa: E402
import step_probe  # noqa: E402
from tiny_plan import in_vllm_last_json  # noqa: E402

RESULTS = HERE.parent / "results"
BANDWIDTH = RESULTS / "hbm_bandwidth-h200-b1.json"
# Run p1 (engine offload): c=4's worker died in its profile window (results, not made up).
P1_RAW = RESULTS / "pp3_perf_raw-h200-p1-offload.json"
P1_INPUTS = RESULTS / "pp3_perf_inputs-h200-p1.json"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("pp3_perf")
    pp3_perf.prepare(work, [], None)
    return work


@pytest.fixture(scope="module")
def inputs(work):
    return json.loads((work / "inputs.json").read_text())


def _options(argv: list[str]) -> dict[str, str | None]:
    """`--flag value` / `--flag` pairs of a serve argv (the model positional first)."""
    out: dict[str, str | None] = {"MODEL": argv[0]}
    i = 1
    while i < len(argv):
        flag = argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[flag], i = argv[i + 1], i + 2
        else:
            out[flag], i = None, i + 1
    return out


OVERRIDE_FLAGS = {
    "load_format": "--load-format",
    "skip_tokenizer_init": "--skip-tokenizer-init",
    "additional_config": "--additional-config",
    "max_model_len": "--max-model-len",
}


@pytest.mark.parametrize("name", ["offload", "offload-262k", "vram"])
def test_argv_is_the_3x3090_plans_but_the_named_overrides(inputs, name):
    engine = pp3_perf.engines_named([name])[0]
    plan = inputs["plans"]["0"]
    assert plan["profile"] == "3x3090"
    argv, overrides = pp3_perf.engine_argv(plan, engine)
    ours, theirs = _options(argv), _options(plan["argv"][2:])
    changed = {f for f in ours.keys() | theirs.keys() if ours.get(f, "?") != theirs.get(f, "?")}
    assert changed == {OVERRIDE_FLAGS[k] for k in overrides}
    assert ours["--load-format"] == "dummy"
    assert json.loads(ours["--additional-config"]) == {"gdn_prefill_backend": "triton"}
    # The plan's own: PP 3, graphs, the mapped table, the scheduler, the KV bytes.
    for flag in ("--pipeline-parallel-size", "--compilation-config", "--engram-config",
                 "--max-num-seqs", "--max-num-batched-tokens", "--kv-cache-memory-bytes",
                 "--gpu-memory-utilization"):  # fmt: skip
        assert ours[flag] == theirs[flag]
    assert ours["--pipeline-parallel-size"] == "3"
    assert json.loads(ours["--compilation-config"])["cudagraph_mode"] == "FULL_DECODE_ONLY"
    assert json.loads(ours["--engram-config"])["mmap_path"] == inputs["table"]["path"]
    assert ("max_model_len" in overrides) == (name == "vram")


@pytest.mark.parametrize("name", ["offload", "vram"])
def test_env_is_the_plans_plus_the_shim_less_offload_only_in_vram(inputs, name):
    engine = pp3_perf.engines_named([name])[0]
    plan = inputs["plans"]["0"]
    env, changes = pp3_perf.engine_env(plan, engine)
    assert plan["env"]["VLLM_QSA_KV_OFFLOAD"] == "1"
    kept = {k: v for k, v in plan["env"].items() if k not in changes["env_dropped"]}
    assert {k: env[k] for k in kept} == kept
    assert set(env) - set(kept) == set(changes["env_added"])
    assert env["FLASHNEXT_PP_ONE_GPU"] == "1" and env["FLASHNEXT_PERF_3090_KERNELS"] == "1"
    assert changes["env_added"]["TEARDOWN_CUPTI"] == "0"  # profiler windows under graphs
    offload_env = list(plan_settings.QSA_OFFLOAD_ENV)
    assert changes["env_dropped"] == ([] if name == "offload" else offload_env)


def test_rank_bytes_add_up_to_the_plans_weights(inputs):
    plan = inputs["plans"]["0"]
    for r, b in enumerate(inputs["rank_bytes"]):
        total = b["dense_bytes"] + b["routed_expert_bytes"] + b["embedding_bytes"]
        assert total == plan["ranks"][r]["weight_bytes"]
        assert (b["gdn_layers"], b["qsa_layers"], b["moe_layers"]) == (12, 4, 16)
    assert sum(b["dense_bytes"] for b in inputs["rank_bytes"]) == plan["decode"]["dense_bytes"]
    routed = sum(b["routed_expert_bytes"] for b in inputs["rank_bytes"])
    assert routed == plan["decode"]["routed_expert_bytes"]


def test_table_is_sparse_at_the_real_size(inputs):
    table = Path(inputs["table"]["path"])
    assert table.stat().st_size == inputs["table"]["bytes"] == 102_400_491_520  # RESULTS.md r0-r6
    assert inputs["table"]["allocated_bytes"] < 1 << 20
    assert json.loads(Path(f"{table}.json").read_text())


def test_dry_run_prints_the_engines_without_vllm(work, inputs):
    proc = subprocess.run(
        [sys.executable, str(HERE / "pp3_perf.py"), "run", "t0", "--work", str(work),
         "--only", "offload", "offload-262k", "vram", "--dry-run"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [d["engine"] for d in lines] == ["offload", "offload-262k", "vram"]
    for d in lines:
        assert d["argv"][:2] == ["vllm", "serve"]
        assert d["ballast_free_bytes"] == 3 * inputs["card_free_bytes"] == 3 * 25_390_219_264
    assert lines[1]["cases"] == [{"kind": "ttft", "concurrency": 1, "prompt_tokens": 262_142}]
    assert "vllm" not in proc.stderr.lower()


def test_mtp_engine_needs_its_plan(inputs):
    with pytest.raises(SystemExit, match="prepare --mtp 1"):
        pp3_perf.spec_for(pp3_perf.engines_named(["mtp1"])[0], inputs)


# `flashnext plan --json --facts checks/fixtures/facts/3x3090-nvme.json --model M
# --table T --mtp K --max-model-len 131072`, M the full skeleton after `flashnext
# checkpoint mtp-int4` (pp3_perf prepare --mtp 1 2, 2026-12-05; 3 min on 2 cores).
PLANS = HERE.parents[2] / "checks" / "fixtures" / "plans"


def test_a_k_the_3x3090_plan_refuses_runs_on_k1s_argv_with_the_pool_it_needs():
    """K=2 does not fit rank 2's pool at any length (GDN state of K + 1 blocks
    per group); its draft step is measured on K=1's MTP argv with K=2 drafts
    and a KV pool grown to hold one full-length request, and says so."""
    plans = {k: json.loads((PLANS / f"3x3090-skeleton-mtp{k}.json").read_text()) for k in "12"}
    mtp2 = plans["2"]["mtp"]
    assert (
        not mtp2["fits"]
        and mtp2["load"]["fits"]
        and "--speculative-config" not in plans["2"]["argv"]
    )
    assert mtp2["blocks_per_request"] > mtp2["pool_blocks"]
    spec = pp3_perf.spec_for(pp3_perf.engines_named(["mtp2"])[0], {"plans": plans})
    ours, k1 = _options(spec["argv"]), _options(plans["1"]["argv"][2:])
    assert json.loads(ours["--speculative-config"]) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    kv = int(ours["--kv-cache-memory-bytes"])
    per_block = mtp2["kv_cache_memory_bytes"] / mtp2["pool_blocks"]
    assert kv / per_block >= mtp2["blocks_per_request"] + pp3_perf.KV_POOL_MARGIN_BLOCKS
    assert kv / per_block < mtp2["blocks_per_request"] + pp3_perf.KV_POOL_MARGIN_BLOCKS + 1
    changed = {f for f in ours.keys() | k1.keys() if ours.get(f, "?") != k1.get(f, "?")}
    overridden = {OVERRIDE_FLAGS[k] for k in spec["overrides"] if k in OVERRIDE_FLAGS}
    assert changed - overridden == {
        "--speculative-config", "--kv-cache-memory-bytes", "--compilation-config"
    }  # fmt: skip
    # a decode of n requests is 3n tokens: each of the profile's sizes x 3 is captured
    sizes = json.loads(ours["--compilation-config"])["cudagraph_capture_sizes"]
    assert sizes == [1, 2, 3, 4, 6, 12] == spec["beyond_3090"]["cudagraph_capture_sizes"]
    assert spec["mode"] == "offload, KV pool beyond 3x3090"
    assert spec["beyond_3090"]["why"] == mtp2["reason"]
    assert spec["beyond_3090"]["kv_cache_memory_bytes"] == {"plan": mtp2["kv_cache_memory_bytes"],
                                                           "run": kv}  # fmt: skip
    # K=1 fits: its own plan, nothing restated.
    one = pp3_perf.spec_for(pp3_perf.engines_named(["mtp1"])[0], {"plans": plans})
    assert one["beyond_3090"] is None and one["mode"] == "offload"
    # Where the drafter does not even load, nothing can be restated.
    refused = {**plans, "2": {**plans["2"], "mtp": {**mtp2, "load": {"fits": False}}}}
    with pytest.raises(SystemExit, match="does not fit"):
        pp3_perf.spec_for(pp3_perf.engines_named(["mtp2"])[0], {"plans": refused})


def test_the_cuts_before_is_k1s_argv_with_the_profiles_capture_sizes_alone(inputs):
    """mtp1-before: K=1's MTP argv but for the decode graphs the plan adds for
    MTP (flashnext.plan.decode_graphs), recorded as an override."""
    one = json.loads((PLANS / "3x3090-skeleton-mtp1.json").read_text())
    plans = {"0": inputs["plans"]["0"], "1": one}
    before, after = (pp3_perf.spec_for(pp3_perf.engines_named([n])[0], {"plans": plans})
                     for n in ("mtp1-before", "mtp1"))  # fmt: skip
    ours, theirs = _options(before["argv"]), _options(after["argv"])
    assert {f for f in ours.keys() | theirs.keys() if ours.get(f) != theirs.get(f)} == {
        "--compilation-config"
    }
    sizes = [
        json.loads(o["--compilation-config"])["cudagraph_capture_sizes"] for o in (ours, theirs)
    ]
    assert sizes == [[1, 2, 4], [1, 2, 4, 8]]
    assert before["overrides"]["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4]
    assert (before["mtp_k"], before["mode"]) == (1, "offload")
    assert perf_cases.CUT[:2] == ("mtp1-before", "mtp1")


# vLLM 0.33.0's own `vllm serve` parser and config builder on each engine's argv, as
# perf_engine.py builds the engine (rank_fit_worker.engine_args): an argv vLLM would
# refuse is found here, not in device time.
VLLM_SIDE = """
import json, sys
gpu, inputs_path = sys.argv[1], sys.argv[2]
for folder in ("perf", "pp3", "rank_fit", "common"):
    sys.path.insert(0, f"{gpu}/{folder}")
import pp3_perf
from rank_fit_worker import engine_args
inputs = json.load(open(inputs_path))
out = {}
for name in ("offload", "offload-262k", "vram"):
    argv, _ = pp3_perf.engine_argv(inputs["plans"]["0"], pp3_perf.engines_named([name])[0])
    args = engine_args(argv)
    cfg = args.create_engine_config()
    out[name] = {
        "pp": cfg.parallel_config.pipeline_parallel_size,
        "load_format": str(cfg.load_config.load_format),
        "skip_tokenizer_init": cfg.model_config.skip_tokenizer_init,
        "kv_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "mmap": cfg.engram_config.mmap_path if cfg.engram_config else None,
    }
print("RESULT " + json.dumps(out))
"""


def test_vllm_builds_every_engines_config_from_its_argv(work, inputs):
    python = os.environ.get("FLASHNEXT_VLLM_PY")
    if not python:
        pytest.skip("FLASHNEXT_VLLM_PY unset: checks/run sets it (the pinned vLLM env)")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([python, "-c", VLLM_SIDE, str(HERE.parent), str(work / "inputs.json")],
                          capture_output=True, text=True, env=env, timeout=600,
                          check=False)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    plan = _options(inputs["plans"]["0"]["argv"][2:])
    for name, got in json.loads(lines[-1].removeprefix("RESULT ")).items():
        assert got == {
            "pp": 3,
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "kv_bytes": int(plan["--kv-cache-memory-bytes"]),
            "max_num_seqs": int(plan["--max-num-seqs"]),
            "max_num_batched_tokens": int(plan["--max-num-batched-tokens"]),
            "mmap": inputs["table"]["path"],
        }, name


# The perf shim in the pinned vLLM: the PP=3 shim's patch and the 3090's kernels, each
# only when asked, both through the PP=3 shim's import hook; nothing of vLLM at start.
SHIM_PROBE = """
import json, os, sys
at_start = sorted(m for m in sys.modules if "vllm" in m)
from vllm.config import ParallelConfig
from vllm.model_executor.layers.quantization.utils.humming import priority
config = ParallelConfig(pipeline_parallel_size=3, distributed_executor_backend="mp")
print(json.dumps({"vllm_at_start": at_start, "gpu": config.get_local_gpu_index(2),
                  "humming": sorted(priority._HUMMING_PREFERRED_CAPABILITIES)}))
"""


@pytest.mark.parametrize(
    ("switches", "expected"),
    [
        ({}, {"vllm_at_start": [], "gpu": 2, "humming": [90]}),
        ({"FLASHNEXT_PP_ONE_GPU": "1"}, {"vllm_at_start": [], "gpu": 0, "humming": [90]}),
        ({"FLASHNEXT_PERF_3090_KERNELS": "1"}, {"vllm_at_start": [], "gpu": 2, "humming": []}),
        (
            {"FLASHNEXT_PP_ONE_GPU": "1", "FLASHNEXT_PERF_3090_KERNELS": "1"},
            {"vllm_at_start": [], "gpu": 0, "humming": []},
        ),
    ],
)
def test_the_perf_shim_patches_only_what_is_asked(switches, expected):
    python = os.environ.get("FLASHNEXT_VLLM_PY")
    if not python:
        pytest.skip("FLASHNEXT_VLLM_PY unset: checks/run sets it (the pinned vLLM env)")
    unset = ("FLASHNEXT_PP_ONE_GPU", "FLASHNEXT_PERF_3090_KERNELS", "FLASHNEXT_PERF_MEMORY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env |= {"PYTHONPATH": str(pp3_perf.SHIM_DIR), "VLLM_TARGET_DEVICE": "cpu", **switches}
    proc = subprocess.run([python, "-c", SHIM_PROBE], capture_output=True, text=True, env=env,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == expected


# The probe's PLE wrappers on patch 0012's real HostRowGather (CPU, a small table): the
# select is timed apart from the whole gather, whose other parts (on a GPU: the wait for
# the step's ids, the H2D copy) are made slow here by a 50 ms copy to the device rows.
PLE_PROBE = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
import step_probe
from vllm.models.qwen4_exp.common.ple_mmap import HostRowGather

step_probe._STATE["records"] = []
wrapped = [step_probe._wrap_ple_gather(), step_probe._wrap_ple_gather()]
table = torch.arange(64 * 8, dtype=torch.bfloat16).reshape(64, 8)
g = HostRowGather(table, max_rows=16, device="cpu")
rows = g.device_rows

class SlowCopy:
    def __getitem__(self, key):
        target = rows[key]
        class Target:
            def copy_(self, src, non_blocking=False):
                time.sleep(0.05)
                return target.copy_(src)
        return Target()

g.device_rows = SlowCopy()
ids = torch.tensor([5, 0, 63, 7, 7])
n = g.gather(ids)
print(json.dumps({"wrapped": wrapped, "n": n, "records": step_probe._STATE["records"],
                  "rows_ok": bool(torch.equal(rows[:n], table[ids]))}))
"""


def test_probe_times_the_ple_select_apart_from_the_whole_gather():
    got = in_vllm_last_json("-c", PLE_PROBE, str(HERE))
    both = {"ple_gather": True, "ple_select": True}
    assert got["wrapped"] == [both, both] and got["n"] == 5 and got["rows_ok"]
    # once each (wrapping twice does not nest), the select first: it runs inside gather
    assert [r["kind"] for r in got["records"]] == ["ple_select", "ple_gather"]
    select, gather = got["records"]
    assert select["bytes"] == gather["bytes"] == 5 * 8 * 2  # rows x row bytes (bf16)
    assert gather["wall_us"] >= 50_000 > select["wall_us"]


# p1's rank 0 profile, in torch's own event types: two kernels, the NCCL
# broadcast's GPU annotation over its kernel, and a gloo send's annotation.
PROFILE_EVENTS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent
import step_probe
def event(i, name, us, annotation=False):
    return FunctionEvent(i, name, 0, 0, us, use_device="cuda", device_type=DeviceType.CUDA,
                         stack=[], input_shapes=[], is_user_annotation=annotation)
events = EventList([event(1, "Marlin", 2000), event(2, "ncclDevKernel_Broadcast", 700),
                    event(3, "nccl:broadcast", 700, True), event(4, "gloo:send", 76000, True)],
                   use_device="cuda")
events._build_tree()  # as the profiler does before key_averages
print(json.dumps(step_probe.profile_summary(events.key_averages(), steps=2)))
"""


def test_gpu_busy_time_counts_kernels_and_not_the_annotations_over_them():
    got = in_vllm_last_json("-c", PROFILE_EVENTS, str(HERE))
    assert got["gpu_busy_ms_per_step"] == (2000 + 700) / 1e3 / 2
    # The NCCL kernel's time (its wait for the peer included) is kept apart.
    assert (got["nccl_kernel_ms_per_step"], got["compute_ms_per_step"]) == (0.35, 1.0)
    assert [k["name"] for k in got["top_kernels"]] == ["Marlin", "ncclDevKernel_Broadcast"]
    assert [a["name"] for a in got["annotations"]] == ["gloo:send", "nccl:broadcast"]


def test_window_summary_has_the_whole_gather_and_its_select_apart():
    # made up: 4 decode steps, each with a 27 ms gather() of which 0.3 ms is the select
    steps = [{"kind": "execute_model", "tokens": 1, "decode": True, "wall_us": 30_000.0}] * 4
    ple = [{"kind": "ple_gather", "wall_us": 27_000.0, "bytes": 3840},
           {"kind": "ple_select", "wall_us": 300.0, "bytes": 3840}] * 4  # fmt: skip
    out = step_probe.summarize(steps + ple, "decode-c1", 0, wall_s=0.16)
    assert out["step_period_ms"] == pytest.approx(40.0) and out["decode_steps"] == 4
    assert out["ple_gather"]["wall_us_per_step"] == pytest.approx(27_000.0)
    assert out["ple_select"]["wall_us_per_step"] == pytest.approx(300.0)
    assert out["ple_select"]["calls"] == 4 and out["ple_select"]["bytes"] == 4 * 3840
    assert out["mtp_propose"] == {"calls": 0, "wall_us_median": None, "wall_us_per_step": 0.0,
                                  "gpu_us_median": None, "bytes": 0}  # fmt: skip


def _step(t0, t1, decode, tokens=1):
    return {"kind": "execute_model", "tokens": tokens, "decode": decode, "t0": t0, "t1": t1,
            "wall_us": (t1 - t0) * 1e6}  # fmt: skip


def test_window_times_decode_steps_apart_from_the_prompts_prefill():
    """Made-up times (s): two 100 ms prefill chunks, then three decode steps of
    30 ms whose host waits 25 ms for the step's input, then launches the graph."""
    records = [_step(0.0, 0.1, False, 512), _step(0.1, 0.2, False, 512)]
    for i in range(3):
        t0 = 0.2 + 0.03 * i
        records += [
            {"kind": "pp_recv", "t0": t0, "t1": t0 + 0.025, "wall_us": 25_000.0},
            {"kind": "graph_replay", "t0": t0 + 0.0252 + 0.0001 * i, "gpu_idle": True},
            _step(t0, t0 + 0.026, True),
        ]
    out = step_probe.summarize(records, "decode-c1", 1, wall_s=0.29, t_end=0.29)
    assert out["steps"] == 5 and out["step_period_ms"] == pytest.approx(58.0)  # prefill in
    assert out["decode_tail_steps"] == 3
    assert out["decode_period_ms"] == pytest.approx(30.0)  # (0.29 - 0.2) / 3
    # wait end -> graph launch: 0.2, 0.3, 0.4 ms; the median
    assert out["host_critical_steps"] == 3
    assert out["host_critical_ms"] == pytest.approx(0.3)
    assert out["execute_wall_ms"] == pytest.approx(26.0)  # the waits are in it
    # a later rank whose stream was still busy at the launch (waiting for the
    # previous rank's tensors): its host prepared the step in time, 0 on the path
    early = [{"kind": "pp_recv", "t1": 3.001}, {"kind": "graph_replay", "t0": 3.002,
             "gpu_idle": False}, _step(3.0, 3.003, True)]  # fmt: skip
    assert step_probe.host_critical_us(early[2], early) == 0.0
    # rank 0: the ids are on the host where the PLE gather's _select starts, and
    # its GPU waits for what the host does after that, busy stream or not
    rank0 = [{"kind": "ple_select", "t0": 4.001}, {"kind": "graph_replay", "t0": 4.0015,
             "gpu_idle": False}, _step(4.0, 4.002, True)]  # fmt: skip
    assert step_probe.host_critical_us(rank0[2], rank0) == pytest.approx(500.0)
    # an eager step (no graph) launched all it did by its return
    eager = [{"kind": "ple_select", "t0": 1.010, "wall_us": 40.0}, _step(1.0, 1.012, True)]
    assert step_probe.host_critical_us(eager[1], eager) == pytest.approx(2000.0)
    # no host wait in the step (the host ran ahead) or no timestamps (p1): none
    assert step_probe.host_critical_us(_step(2.0, 2.001, True), records) is None
    assert step_probe.host_critical_us({"kind": "execute_model"}, records) is None
    # a window whose steps are all prefill has no decode period
    assert step_probe.summarize(records[:2], "x", 0, 0.2, t_end=0.2)["decode_period_ms"] is None


def test_p1_ran_the_same_kernel_on_the_same_shape_four_times_slower_on_the_last_rank():
    """RESULTS.md p1, "three processes on one GPU time-slice": Humming's INT6
    GEMM of one shape, 256 decode calls on each of ranks 1 and 2, took over 4x
    as long a call on rank 2. Ranks sharing the card: what timeshare.py and
    the calibration are for (not a rank's own kernel time)."""
    profiles = json.loads(P1_RAW.read_text())["cases"][0]["profile"]

    def per_call(rank: int) -> tuple[int, float]:
        (kernel,) = [
            k for k in profiles[rank]["top_kernels"] if "Shape<0u, 2560u, 6144u>" in k["name"]
        ]
        return kernel["calls"], kernel["device_us"] / kernel["calls"]

    (calls1, us1), (calls2, us2) = per_call(1), per_call(2)
    assert calls1 == calls2 == 256 and round(us1, 1) == 27.7 and round(us2, 1) == 119.8
    assert us2 / us1 > 4


# The profiler is armed and starts at the step completing `settle` decode steps
# in a row, through the real wrapper and torch.profiler (on CPU).
PROFILE_ARMING = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
import torch
import step_probe

step_probe._STATE.update(records=[], window=None, profiling=None, armed=None, profiled_steps=0,
                         profiled_other_steps=0, installed={"rank": 0})
worker = types.SimpleNamespace(execute_model=lambda so: torch.ones(8).sum())
step_probe._wrap_timed(worker, "execute_model", "execute_model", False,
                       lambda so: step_probe._step_shape(so, 0))
def step(decode):
    n = 1 if decode else 512
    return types.SimpleNamespace(num_scheduled_tokens={"a": n}, scheduled_new_reqs=[],
                                 total_num_scheduled_tokens=n)
step_probe.profile_begin(None, 2)
started = []
for decode in (False, True, False, True, True, True, False):
    worker.execute_model(step(decode))
    started.append(step_probe._STATE["profiling"] is not None)
got = step_probe.profile_end(None)
unarmed = step_probe.profile_end(None)
step_probe.profile_begin(None, 3)
worker.execute_model(step(True))
never = step_probe.profile_end(None)
print(json.dumps({"started": started, "steps": got["steps"], "other": got["other_steps"],
                  "kernels": "kernels" in got, "unarmed": unarmed, "never": never}))
"""


def test_the_profiler_starts_after_settle_decode_steps_in_a_row():
    got = in_vllm_last_json("-c", PROFILE_ARMING, str(HERE))
    # prefill, decode, prefill (the run restarts), decode, decode: started there
    assert got["started"] == [False, False, False, False, True, True, True]
    # the two decode steps from the start on, then the prefill after them
    assert (got["steps"], got["other"], got["kernels"]) == (2, 1, True)
    assert got["unarmed"] == {"rank": 0, "error": "not profiled: profile_begin was not called"}
    assert got["never"] == {"rank": 0, "error": "not profiled: no decode steps in a row came"}


def test_scheduler_clock_times_the_engine_cores_calls_per_window():
    class Scheduler:  # the two calls perf_engine wraps on vLLM's Scheduler instance
        def schedule(self, throttle=False):
            time.sleep(0.002)
            return "batch"

        def update_from_output(self, scheduler_output, model_output):
            return {0: model_output}

    scheduler = Scheduler()
    clock = perf_engine.SchedulerClock(scheduler)
    assert scheduler.schedule() == "batch"
    clock.begin()  # a window starts: earlier calls are not in it
    assert scheduler.schedule(True) == "batch"
    assert scheduler.update_from_output("batch", "out") == {0: "out"}
    got = clock.summary()
    assert got["schedule"]["calls"] == 1 and got["schedule"]["us_median"] >= 2000
    assert got["update_from_output"]["calls"] == 1
    assert got["update_from_output"]["us_median"] < got["schedule"]["us_median"]


def test_decode_cases_arm_the_profile_past_the_prefill(inputs):
    cases = pp3_perf.cases_for(pp3_perf.ENGINES[0], 262_144)
    settle = {c["concurrency"]: c["profile_settle_steps"] for c in cases if c["kind"] == "decode"}
    assert settle == {1: 1, 4: 6}


# --- a case that dies: its stage, its measured window, the engine's error -------


def _p1_c4_without_its_outcome() -> dict:
    """p1's c=4 case as the engine had it when its profile window died."""
    case = json.loads(P1_RAW.read_text())["cases"][1]
    assert case["kind"] == "decode" and case["concurrency"] == 4 and "profile" not in case
    return {k: v for k, v in case.items() if k not in ("ok", "error")}


def test_a_case_dying_in_its_profile_window_keeps_its_decode_and_is_the_engines_error():
    raw = json.loads(P1_RAW.read_text())
    c1 = raw["cases"][0]
    c4 = _p1_c4_without_its_outcome()
    c4 |= perf_engine.failed_case("profile window", RuntimeError("cancelled"))
    assert c4["ok"] is False and c4["profile_failed"] is True and c4["stage"] == "profile window"
    assert c4["decode_tok_s"] == raw["cases"][1]["decode_tok_s"] and len(c4["ranks"]) == 3
    got = perf_engine.outcome([c1, c4])
    assert got["ok"] is False and got["memory_serving"] is None and got["memory_serving_skipped"]
    assert got["error"] == (
        "case decode c=4 3000 tokens died in its profile window: RuntimeError: cancelled"
    )
    assert perf_contract.window_complete(c4)
    # Dying before the window ended: no profile_failed, and the contract does not use it.
    early = _p1_c4_without_its_outcome() | perf_engine.failed_case("decode window", OSError("x"))
    assert "profile_failed" not in early and not perf_contract.window_complete(early)
    assert "died in its decode window: OSError: x" in perf_engine.outcome([early])["error"]
    # All ok (or skipped): the serving memory is read (no skip) and the engine is ok.
    assert perf_engine.outcome([c1, {"kind": "ttft", "skipped": "too long"}]) == {"ok": True}


def _contract_of(raw: dict) -> dict:
    inputs = json.loads(P1_INPUTS.read_text())
    bandwidth = json.loads(BANDWIDTH.read_text())
    return perf_contract.build("p1", inputs, {"offload": raw}, bandwidth)


def test_contract_sets_each_ranks_predicted_start_peak_beside_what_p1_measured():
    """Issue 27 item 5 on p1's real record: the plan's start_peak prediction
    per rank (its terms too) next to the process's NVML and reserved peaks; p1
    kept no allocated peak (the sampler keeps it from p2 on)."""
    doc = _contract_of(json.loads(P1_RAW.read_text()))
    inputs = json.loads(P1_INPUTS.read_text())
    raw = json.loads(P1_RAW.read_text())
    memory = doc["start_memory"]
    assert [m["rank"] for m in memory] == [0, 1, 2]
    for m, planned, seen in zip(memory, inputs["plans"]["0"]["ranks"], raw["memory_start"],
                                strict=True):  # fmt: skip
        assert m["predicted_bytes"] == planned["start_peak"]["predicted_bytes"]
        assert sum(m["predicted_terms"].values()) <= m["predicted_bytes"]
        assert {"weights", "cuda_context", "marlin_repack"} <= set(m["predicted_terms"])
        assert m["nvml_bytes"] == seen["peaks"]["start"]["nvml"]
        assert m["reserved_bytes"] == seen["peaks"]["start"]["reserved"]
        assert m["allocated_bytes"] is None
        assert m["nvml_over_predicted_bytes"] == m["nvml_bytes"] - m["predicted_bytes"]
    # p1: every rank's process took 1.3-2.6 GB more than the plan predicted.
    over = [m["nvml_over_predicted_bytes"] for m in memory]
    assert all(1.3e9 < x < 2.6e9 for x in over), over
    # Outside torch's allocator every rank held the same 784,334,848 B, the plan's
    # CUDA context term to within 1%: the excess is all in the allocator's reserve.
    for m in memory:
        assert m["outside_allocator_bytes"] == 784_334_848
        assert abs(m["outside_allocator_bytes"] / m["predicted_terms"]["cuda_context"] - 1) < 0.01
        assert m["reserved_over_predicted_bytes"] == (
            m["reserved_bytes"] - (m["predicted_bytes"] - m["predicted_terms"]["cuda_context"])
        )
    reserved_over = [m["reserved_over_predicted_bytes"] for m in memory]
    assert [round(x / 1e9, 2) for x in reserved_over] == [1.37, 2.33, 2.52]


def test_contract_of_p1_uses_the_c4_window_its_profile_window_lost():
    raw = json.loads(P1_RAW.read_text())
    doc = _contract_of(raw)
    c4 = {r["rank"]: r for r in doc["ranks"] if r["batch"] == 4}
    for rank, window in enumerate(raw["cases"][1]["ranks"]):
        assert c4[rank]["hbm_bytes_per_step"] is not None  # the window's rows: kept
        assert c4[rank]["gpu_busy_ms"] is None  # the profile died
        # p1's window period counts the prompts' prefill chunks (88 steps, 64 decode)
        # and its execute_model wall time the waits: neither is a decode figure
        assert window["steps"] > window["decode_steps"] and "decode_period_ms" not in window
        assert c4[rank]["step_ms"] is None and c4[rank]["cpu_ms"] is None
    assert [c["stage"] for c in doc["engines"]["offload"]["failed_cases"]] == [None]  # p1: no stage
    assert doc["engines"]["offload"]["failed_cases"][0]["window_kept"] is True
    # p1's c=1 profile summed GPU-side annotations (157 ms busy in a 38 ms step) and
    # has no compute split: no busy time is taken from it, so nothing is projected.
    c1 = [r for r in doc["ranks"] if r["batch"] == 1]
    assert [r["gpu_busy_ms"] for r in c1] == [None] * 3
    assert doc["projection_3090"]["c1_tok_s"] is None
    assert doc["projection_3090"]["c4_tok_s"] is None  # needs every rank's GPU busy time
    # p1 timed only the whole gather() call (mostly the wait for ids): no ple_gather_us
    rank0 = [r for r in doc["ranks"] if r["rank"] == 0]
    assert [r["ple_gather_us"] for r in rank0] == [None, None]
    assert [r["ple_gather_us"] for r in doc["ranks"] if r["rank"] != 0] == [0.0] * 4
    assert {"ranks[0].ple_gather_us", "ranks[3].ple_gather_us"} <= set(doc["missing"])
    # The same case marked as dying before its window ended is not used.
    raw["cases"][1]["stage"] = "decode window"
    early = _contract_of(raw)
    assert all(r["hbm_bytes_per_step"] is None for r in early["ranks"] if r["batch"] == 4)
    assert early["engines"]["offload"]["failed_cases"][0]["window_kept"] is False


# --- projection: made-up inputs (a test fixture, not a result) ---------------

FAKE_LINKS = projection.Links(h200_read_bytes_per_s=4e12, h200_h2d_bytes_per_s=50e9,
                              b3090_bytes_per_s=1e12, link_3090_bytes_per_s=25e9)  # fmt: skip


def test_projection_scales_device_time_and_moves_host_reads_to_the_3090_link():
    # made up: 10 ms busy of which 1 ms is 50 MB of host reads at 50 GB/s; 2 ms CPU.
    step = projection.MeasuredStep(gpu_busy_ms=10.0, cpu_ms=2.0, pcie_bytes=50_000_000,
                                   hbm_bytes=1_000_000_000)  # fmt: skip
    got = projection.project_step_ms(step, FAKE_LINKS, "bandwidth")
    # (10 - 1) ms x 4 = 36 ms (above the 1 GB / 1 TB/s = 1 ms floor) + 50 MB / 25 GB/s = 2 ms
    assert got["gpu_ms"] == pytest.approx(38.0)
    assert got["step_ms"] == pytest.approx(40.0)
    floor = projection.MeasuredStep(0.1, 0.0, 0, 5_000_000_000)  # made up: the floor binds
    assert projection.project_step_ms(floor, FAKE_LINKS, "bandwidth")["gpu_ms"] == pytest.approx(
        5.0
    )


def test_streaming_rule_scales_the_bytes_and_carries_the_rest_over():
    # made up: the same step. Its 1 GB streams in 0.25 ms at the H200's 4 TB/s and in
    # 1 ms at the 3090's 1 TB/s; the other 8.75 ms of the 9 ms device time (launches,
    # small kernels) carry over as measured; host reads 2 ms at the 3090's link.
    step = projection.MeasuredStep(10.0, 2.0, 50_000_000, 1_000_000_000)
    got = projection.project_step_ms(step, FAKE_LINKS)  # the contract's rule
    assert projection.RULE == "streaming"
    assert (got["streaming_ms"], got["carried_ms"]) == (pytest.approx(1.0), pytest.approx(8.75))
    assert got["gpu_ms"] == pytest.approx(1.0 + 8.75 + 2.0)
    assert got["step_ms"] == pytest.approx(13.75)
    # All streaming on the H200 (1 GB in 0.25 ms): all of it scales, as under "bandwidth".
    tight = projection.MeasuredStep(0.25, 0.0, 0, 1_000_000_000)
    both = [projection.project_step_ms(tight, FAKE_LINKS, r)["gpu_ms"] for r in projection.RULES]
    assert both == [pytest.approx(1.0), pytest.approx(1.0)]
    with pytest.raises(ValueError, match="unknown projection rule"):
        projection.project_step_ms(step, FAKE_LINKS, "compute")


def test_projection_adds_the_ranks_in_turn_and_counts_mtp_acceptance():
    s = projection.MeasuredStep(2.5, 0.0, 0, 0)  # made up: 2.5 ms busy -> 10 ms on the 3090
    out = projection.project_3090([s, s, s], [s, s, s], [s, s, s], FAKE_LINKS, rule="bandwidth",
                                  mtp1_draft_ms=2.5, acceptance_rate=0.5)  # fmt: skip
    assert out["c1_tok_s"] == pytest.approx(1000 / 30)
    assert out["c4_tok_s"] == pytest.approx(4000 / 30)
    assert out["mtp1_c1_tok_s"] == pytest.approx(1.5 * 1000 / 40)
    assert "no pipeline overlap" in out["basis"] and out["basis"].startswith("rule bandwidth")
    # No bytes counted: "streaming" carries the 2.5 ms over, the draft's too.
    kept = projection.project_3090([s, s, s], None, [s, s, s], FAKE_LINKS,
                                   mtp1_draft_ms=2.5, acceptance_rate=0.5)  # fmt: skip
    assert kept["c1_tok_s"] == pytest.approx(1000 / 7.5)
    assert kept["mtp1_c1_tok_s"] == pytest.approx(1.5 * 1000 / 10)
    none = projection.project_3090([s], None, None, FAKE_LINKS)
    assert none["c4_tok_s"] is None and none["mtp1_c1_tok_s"] is None


def test_hbm_bytes_terms_by_hand():
    config = {  # made up, shaped like the model's text_config
        "num_experts": 4, "num_experts_per_tok": 2, "linear_num_key_heads": 1,
        "linear_key_head_dim": 2, "linear_num_value_heads": 1, "linear_value_head_dim": 2,
        "linear_conv_kernel_dim": 2, "mamba_ssm_dtype": "float32", "indexer_kv_heads": 1,
        "indexer_head_dim": 4, "indexer_compress_ratio": 4, "indexer_budget": 8,
        "num_key_value_heads": 1, "head_dim": 4,
    }  # fmt: skip
    rank = projection.RankBytes(dense_bytes=100, routed_expert_bytes=800, moe_layers=2,
                                embedding_row_bytes=3, gdn_layers=1, qsa_layers=1)  # fmt: skip
    terms = projection.hbm_bytes_per_step(rank, config, rows=1, context=16, kv_in_vram=True)
    # experts: 2 of 4 per row -> 2 x 400 x 2/4 = 400; GDN: 2 x (1*2*2*4 + 6*1*2) = 56;
    # indexer: 16/4 x 8 = 32; K/V: min(16, 8) x 1*4*2*2 = 128
    assert terms == {"dense_weights": 100, "routed_experts": 400, "embedding_rows": 3,
                     "gdn_state": 56, "qsa_indexer": 32, "qsa_kv": 128, "total": 719}  # fmt: skip
    assert projection.pcie_bytes_per_step(rank, config, rows=1, context=16, kv_in_vram=False) == 128
    off = projection.hbm_bytes_per_step(rank, config, rows=1, context=16, kv_in_vram=False)
    assert off["qsa_kv"] == 0
    assert projection.expected_distinct_experts(2, 2, 4) == pytest.approx(4 * (1 - 0.25))


# --- the contract: raw files made up for the test (not results) ---------------


def _fake_raw(inputs, engine, mtp_k=0, profile=True, pid_visible=True):
    n = len(inputs["plans"]["0"]["ranks"])
    window = [{"rank": r, "decode_rows": [1], "step_period_ms": 40.0, "decode_period_ms": 30.0,
               "execute_wall_ms": 27.0, "host_critical_ms": 2.5 if r == n - 1 else 2.0,
               "sample_tokens": {"wall_us_median": 500.0 if r == n - 1 else None},
               "ple_gather": {"calls": 64 if r == 0 else 0,
                              "wall_us_per_step": 25_000.0 if r == 0 else None},
               "ple_select": {"calls": 64 if r == 0 else 0,
                              "wall_us_per_step": 40.0 if r == 0 else None},
               "mtp_propose": {"gpu_us_median": 3000.0 if mtp_k and r == n - 1 else None}}
              for r in range(n)]  # fmt: skip
    # busy 9 ms a step, of which 1 ms is NCCL's: the contract takes the 8 ms of compute;
    # 3/4 of it beside another rank's kernel, 4 ms by fair share
    busy = {
        "gpu_busy_ms_per_step": 9.0,
        "compute_ms_per_step": 8.0,
        "time_sharing": {
            "busy_ms_per_step": 8.0,
            "alone_ms_per_step": 2.0,
            "fair_ms_per_step": 4.0,
            "shared_fraction": 0.75,
            "ranks": 3,
        },
    }
    prof = [{"rank": r} | busy for r in range(n)] if profile else None
    memory = [{"pid_visible": pid_visible, "peaks": {"start": {"nvml": 23 << 30},
                                                     "serving": {"nvml": 22 << 30}}}
              for _ in range(n)]  # fmt: skip
    scheduler = {
        "schedule": {"calls": 64, "us_median": 300.0, "us_total": 19_200.0},
        "update_from_output": {"calls": 64, "us_median": 150.0, "us_total": 9_600.0},
    }
    cases = [{"kind": "decode", "concurrency": c, "prompt_tokens": 3000, "new_tokens": 64,
              "ok": True, "ttft_s": 2.0, "decode_tok_s": 30.0, "ranks": window, "profile": prof,
              "scheduler": scheduler}
             for c in (1, 4)]  # fmt: skip
    cases.append({"kind": "ttft", "concurrency": 1, "prompt_tokens": 48_000, "ok": True,
                  "ttft_s": 27.0})  # fmt: skip
    return {"ok": True, "spec": {"mode": "offload", "mtp_k": mtp_k, "overrides": {}},
            "cases": cases, "memory_start": memory, "memory_serving": memory}  # fmt: skip


def test_contract_has_exactly_the_issues_fields(inputs):
    bandwidth = json.loads(BANDWIDTH.read_text())
    raws = {"offload": _fake_raw(inputs, "offload")}
    doc = perf_contract.build("test", inputs, raws, bandwidth)
    assert doc["model"] == "full-size, dummy weights" and doc["emulated"] is True
    assert "torch 2.11" in doc["note"] and "dummy weights" in doc["note"]
    assert all(tuple(run) == perf_contract.RUN_KEYS for run in doc["runs"])
    assert all(tuple(row) == perf_contract.RANK_KEYS for row in doc["ranks"])
    assert tuple(doc["projection_3090"]) == perf_contract.PROJECTION_KEYS
    assert tuple(doc["cut"]) == perf_contract.CUT_KEYS
    assert [(r["rank"], r["batch"]) for r in doc["ranks"]] == [(r, b) for b in (1, 4)
                                                               for r in range(3)]  # fmt: skip
    row = doc["ranks"][0]
    assert row["planned_bytes"] == inputs["plans"]["0"]["ranks"][0]["committed_bytes"]
    # the decode steps' period and the host's share of the critical path, not the
    # window's period with its prefill nor execute_model's wall time with its waits
    assert row["step_ms"] == 30.0
    assert row["cpu_ms"] == 2.0 and doc["ranks"][2]["cpu_ms"] == 2.5
    medians = {"schedule_us_median": 300.0, "update_from_output_us_median": 150.0}
    assert doc["scheduler"] == [{"batch": b} | medians for b in (1, 4)]
    # the host gather proper (_select), not the whole gather() call with its wait for ids
    assert row["ple_gather_us"] == 40.0 and doc["ranks"][1]["ple_gather_us"] == 0.0
    assert row["roofline_fraction"] == pytest.approx(
        row["hbm_bytes_per_step"] / 8e-3 / bandwidth["results"]["read"]["bytes_per_s"]
    )
    assert doc["projection_3090"]["c1_tok_s"] > 0
    # The seed check is the offload engine's own projection, judged (made-up steps).
    seed = doc["projection_3090"]["seed_config"]
    assert seed["c1_tok_s"] == doc["projection_3090"]["c1_tok_s"]
    assert seed["c4_tok_s"] == doc["projection_3090"]["c4_tok_s"]
    assert isinstance(seed["within_15pct"], bool)
    assert set(seed["by_rule"]) == {"streaming", "bandwidth"}
    # MTP did not run: its projection is null and listed; so is the cut.
    assert doc["projection_3090"]["mtp1_c1_tok_s"] is None
    assert {"projection_3090.mtp1_c1_tok_s", "cut.what", "cut.before", "cut.after"} <= set(
        doc["missing"]
    )
    assert not [m for m in doc["missing"] if m.startswith("ranks")]


def test_contract_reports_each_ks_draft_cost_and_the_tok_s_at_the_cited_rate(inputs):
    """Issue 27 item 1: per K, the draft step on the last rank and what the
    measured round gives at the profile's acceptance, the launcher's
    speculative arithmetic counting the tokens (made-up raws and rate)."""
    bandwidth = json.loads(BANDWIDTH.read_text())
    one = inputs["plans"]["0"] | {"mtp": {"projection": {"acceptance_rate": 0.65}}}
    mtp_inputs = inputs | {"plans": inputs["plans"] | {"1": one}}
    raws = {name: _fake_raw(inputs, name, mtp_k=k) for name, k in
            (("offload", 0), ("mtp1", 1), ("mtp2", 2))}  # fmt: skip
    raws["mtp2"]["spec"]["mode"] = "offload, KV pool beyond 3x3090"
    doc = perf_contract.build("test", mtp_inputs, raws, bandwidth)
    rows = {row["mtp_k"]: row for row in doc["mtp"]}
    assert list(rows) == [1, 2] and all(tuple(r) == perf_contract.MTP_KEYS for r in doc["mtp"])
    # the last rank's propose (3,000 us) and its decode period (30 ms)
    assert (rows[1]["draft_ms"], rows[1]["h200_round_ms"]) == (3.0, 30.0)
    assert rows[1]["tokens_per_round"] == pytest.approx(1.65)
    assert rows[2]["tokens_per_round"] == pytest.approx(1 + 0.65 + 0.65**2)
    assert rows[2]["h200_tok_s"] == pytest.approx((1 + 0.65 + 0.65**2) * 1000 / 30)
    assert rows[1]["projected_3090_c1_tok_s"] == pytest.approx(
        doc["projection_3090"]["mtp1_c1_tok_s"]
    )
    assert rows[2]["projected_3090_c1_tok_s"] > rows[1]["projected_3090_c1_tok_s"]
    assert rows[2]["mode"].endswith("beyond 3x3090") and rows[1]["measured_decode_tok_s"] == 30.0
    assert "mtp[K=3]" in doc["missing"] and not [m for m in doc["missing"] if "K=1" in m]
    # No cited rate: the draft cost stands, what it would give does not.
    bare = perf_contract.build("test", inputs, raws, bandwidth)["mtp"][0]
    assert bare["draft_ms"] == 3.0 and bare["h200_tok_s"] is None


def test_contract_cut_is_c4_decode_before_and_after_in_the_same_run(inputs):
    bandwidth = json.loads(BANDWIDTH.read_text())
    raws = {name: _fake_raw(inputs, name, mtp_k=1) for name in ("mtp1-before", "mtp1")}
    raws["mtp1-before"]["cases"][1]["decode_tok_s"] = 20.0  # made up: c=4 eager
    cut = perf_contract.build("test", inputs, raws, bandwidth)["cut"]
    assert (cut["before"], cut["after"]) == (20.0, 30.0) and cut["what"] == perf_cases.CUT[2]
    alone = perf_contract.build("test", inputs, {"mtp1": raws["mtp1"]}, bandwidth)
    assert alone["cut"]["before"] is None and "cut.before" in alone["missing"]
    nothing = perf_contract.build("test", inputs, {}, bandwidth)["cut"]
    assert nothing == dict.fromkeys(perf_contract.CUT_KEYS)


def test_contract_takes_the_gpu_time_the_calibration_upheld(inputs):
    bandwidth = json.loads(BANDWIDTH.read_text())
    raws = {"offload": _fake_raw(inputs, "offload")}
    read = bandwidth["results"]["read"]["bytes_per_s"]

    def contract(model):
        calibration = {"verdict": {"model": model, "tolerance": 0.2}} if model != "-" else None
        return perf_contract.build("test", inputs, raws, bandwidth, calibration)

    fair, busy, neither, none = (contract(m) for m in ("fair", "busy", None, "-"))
    row = fair["ranks"][0]
    assert row["gpu_busy_ms"] == 8.0  # the profiler's figure stays in the row
    assert row["roofline_fraction"] == pytest.approx(row["hbm_bytes_per_step"] / 4e-3 / read)
    assert fair["time_sharing"]["gpu_time"] == "fair"
    assert fair["time_sharing"]["ranks"][0] == {"rank": 0, "batch": 1, "busy_ms_per_step": 8.0,
                                                "alone_ms_per_step": 2.0, "fair_ms_per_step": 4.0,
                                                "shared_fraction": 0.75, "ranks": 3}  # fmt: skip
    # half the GPU time a step: a faster projection than busy's
    assert fair["projection_3090"]["c1_tok_s"] > busy["projection_3090"]["c1_tok_s"]
    assert fair["projection_3090"]["basis"].startswith("GPU time: fair (shared_gpu_calibration")
    assert busy["projection_3090"]["basis"].startswith("GPU time: busy (shared_gpu_calibration")
    for doc, why in ((neither, "upheld neither"), (none, "no shared_gpu_calibration")):
        assert doc["time_sharing"]["gpu_time"] == "busy"
        assert doc["projection_3090"]["c1_tok_s"] == busy["projection_3090"]["c1_tok_s"]
        assert "an upper bound" in doc["projection_3090"]["basis"] and why in doc[
            "projection_3090"]["basis"]  # fmt: skip


def test_contract_leaves_null_what_was_not_measured(inputs):
    bandwidth = json.loads(BANDWIDTH.read_text())
    raws = {"offload": _fake_raw(inputs, "offload", profile=False, pid_visible=False)}
    doc = perf_contract.build("test", inputs, raws, bandwidth)
    for i, row in enumerate(doc["ranks"]):
        for key in ("gpu_busy_ms", "roofline_fraction", "start_peak_bytes", "serving_peak_bytes"):
            assert row[key] is None and f"ranks[{i}].{key}" in doc["missing"]
        assert row["hbm_bytes_per_step"] is not None  # computed, not measured
    assert doc["projection_3090"]["c1_tok_s"] is None and doc["projection_3090"]["basis"] is None
    empty = perf_contract.build("test", inputs, {}, bandwidth)
    assert empty["runs"] == [] and "runs" in empty["missing"]
    assert all(row["step_ms"] is None for row in empty["ranks"])


# --- issue 40: the seed configuration and the bytes per token ------------------


def test_seed_config_is_judged_against_the_field_report_by_hand():
    assert seed_config.miss(80.0, 80.0, 80.0) == 0.0
    assert seed_config.miss(68.0, 80.0, 80.0) == pytest.approx(0.15)
    assert seed_config.miss(160.0, 152.0, 155.0) == pytest.approx(5 / 155)
    assert seed_config.judged(80.0, None)["within_15pct"] is None
    assert seed_config.judged(69.0, 150.0)["within_15pct"] is True
    assert seed_config.judged(67.0, 150.0)["within_15pct"] is False


def test_seed_config_projects_every_rule_and_names_the_one_that_misses():
    """Made up (not results): each rank 4 ms of GPU time a step at c=1 for 1 GB, 8 ms
    at c=4 for 2 GB. "streaming": 1 GB at the 3090's 1 TB/s (1 ms) + the 3.75 ms the
    H200 did not spend streaming (4 - 1 GB at 4 TB/s) = 4.75 ms a rank, 14.25 a token:
    70.2 tok/s, 12% under 80; c=4 4000 / (3 x (2 + 7.5)) = 140.4, 7.6% under 152.
    "bandwidth": 4 ms x 4 = 16 ms a rank: 20.8 tok/s, the term that misses."""
    c1 = [projection.MeasuredStep(4.0, 0.0, 0, 1_000_000_000)] * 3
    c4 = [projection.MeasuredStep(8.0, 0.0, 0, 2_000_000_000)] * 3
    seed = seed_config.seed_config(c1, c4, FAKE_LINKS, {1: 30.0, 4: 57.0})
    assert (seed["rule"], seed["field_report_c1"], seed["field_report_c4"]) == (
        "streaming", 80.0, [152.0, 155.0])  # fmt: skip
    assert seed["c1_tok_s"] == pytest.approx(1000 / 14.25)
    assert seed["c4_tok_s"] == pytest.approx(4000 / 28.5)
    assert seed["within_15pct"] is True
    assert seed["c1_ranks"][0] == {"gpu_ms": pytest.approx(4.75), "streaming_ms": 1.0,
                                   "carried_ms": 3.75, "cpu_ms": 0.0,
                                   "step_ms": pytest.approx(4.75)}  # fmt: skip
    bandwidth = seed["by_rule"]["bandwidth"]
    assert bandwidth["c1_tok_s"] == pytest.approx(1000 / 48) and bandwidth["within_15pct"] is False
    assert seed["c4_over_c1"] == {"h200_emulation": pytest.approx(1.9),
                                  "field_report": [1.9, 1.9375]}  # fmt: skip


def test_seed_config_of_p1_projects_nothing_and_keeps_its_measured_ratio():
    """p1 alone: no rank's GPU time apart (its profile summed annotations, NCCL's wait
    and 6 prefill chunks, and kept no kernel intervals), so no rule can project the
    seed configuration from it. What it measured directly, c=4 over c=1 decode tok/s
    (66.2 / 34.8), lies inside the field report's 152-155 over 80."""
    doc = _contract_of(json.loads(P1_RAW.read_text()))
    seed = doc["projection_3090"]["seed_config"]
    assert (seed["c1_tok_s"], seed["c4_tok_s"], seed["within_15pct"]) == (None, None, None)
    assert {f"projection_3090.seed_config.{k}" for k in perf_contract.SEED_KEYS} <= set(
        doc["missing"]
    )
    ratio = seed["c4_over_c1"]
    assert ratio["h200_emulation"] == pytest.approx(1.902, abs=1e-3)
    assert ratio["field_report"][0] <= ratio["h200_emulation"] <= ratio["field_report"][1]
    # p1's plan predates decode.terms: the bytes are the plan's, the terms missing.
    assert doc["bytes_per_token"]["plan"] == 4_937_480_040
    assert doc["bytes_per_token"]["terms"] is None and "bytes_per_token.terms" in doc["missing"]


def test_bytes_per_token_reconciles_the_field_report_from_the_plans_terms(inputs):
    bandwidth = json.loads(BANDWIDTH.read_text())
    doc = perf_contract.build("test", inputs, {}, bandwidth)["bytes_per_token"]
    assert (doc["plan"], doc["field_report"]) == (4_937_480_040, 5.83e9)
    rows = {r["name"]: r for r in doc["terms"]}
    assert sum(r["plan"] for r in rows.values()) == doc["plan"]
    # The report's dense is the plan's plus the vision tower, whole; its experts ours.
    assert rows["vision_tower"]["field_report"] == rows["vision_tower"]["stored_bytes"]
    assert doc["field_report_reconstructed"] - doc["plan"] == rows["vision_tower"]["stored_bytes"]
    assert doc["reconciled"] is True and "plan's figure stands" in doc["verdict"]
    # 36 GDN layers x 2 x (48 x 128 x 128 x 4 B + 10,240 x 3 x 2 B), counted by neither
    gdn = rows["gdn_state"]
    assert gdn["a_token_reads"] == 36 * 2 * (48 * 128 * 128 * 4 + 10_240 * 3 * 2)
    assert gdn["plan"] == gdn["field_report"] == 0


def test_contract_takes_the_terms_from_the_skeleton_for_a_plan_without_them(work, tmp_path):
    """p1's and p2's plans predate decode.terms: `contract --model` counts them from the
    skeleton's headers, and refuses a checkpoint that is not the plan's."""
    raw = tmp_path / "raw"
    raw.mkdir()
    out = subprocess.run(
        [sys.executable, str(HERE / "pp3_perf.py"), "contract", "h200-p1", "--inputs",
         str(P1_INPUTS), "--raw", str(raw), "--out-dir", str(tmp_path), "--model",
         str(work / "model")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "pp3_perf-h200-p1.json").read_text())
    assert doc["bytes_per_token"]["reconciled"] is True
    inputs = json.loads(P1_INPUTS.read_text())
    inputs["plans"]["0"]["decode"]["bytes_per_token"] += 1  # not this checkpoint's plan
    (tmp_path / "other.json").write_text(json.dumps(inputs))
    bad = subprocess.run(
        [sys.executable, str(HERE / "pp3_perf.py"), "contract", "x", "--inputs",
         str(tmp_path / "other.json"), "--raw", str(raw), "--out-dir", str(tmp_path / "no"),
         "--model", str(work / "model")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and "pass the skeleton prepare made" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "no").exists()


def test_memory_sampler_keeps_each_kinds_peak_per_phase(monkeypatch):
    for switch in ("FLASHNEXT_PP_ONE_GPU", "FLASHNEXT_PERF_3090_KERNELS", "FLASHNEXT_PERF_MEMORY"):
        monkeypatch.delenv(switch, raising=False)
    path = HERE / "onegpu_perf" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("_perf_shim_under_test", path)
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    assert shim.PERF_SAMPLER is None  # off unless the harness asks
    sampler = shim.MemorySampler()
    sampler.record((5, None, 3))  # (nvml, reserved, allocated); None: not seen
    sampler.record((4, 7, 9))
    start = sampler.close_phase("serving")
    sampler.record((1, 2, 1))
    assert start["peaks"]["start"] == {"nvml": 5, "reserved": 7, "allocated": 9}
    assert sampler.close_phase("end")["peaks"]["serving"] == {
        "nvml": 1,
        "reserved": 2,
        "allocated": 1,
    }


def test_the_contract_takes_the_bandwidth_of_the_card_that_ran(tmp_path, capsys):
    """A call for the H200 may get an H100: its runs are projected only by that
    card's own measured bandwidth; p1's raw file with each card's record (card.py)."""
    raw = json.loads(P1_RAW.read_text())
    h200 = {"name": "NVIDIA H200", "memory_total_bytes": 143771 << 20}
    h100 = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 << 20}
    out = tmp_path / "out"
    for card, code in ((h100, 2), (h200, 0)):
        raws = tmp_path / card["name"].replace(" ", "_")
        raws.mkdir()
        (raws / "pp3_perf_raw-p1-offload.json").write_text(json.dumps(raw | {"card": card}))
        argv = ["contract", "p1", "--inputs", str(P1_INPUTS), "--raw", str(raws),
                "--out-dir", str(out), "--bandwidth", str(BANDWIDTH)]  # fmt: skip
        assert pp3_perf.main(argv) == code
    assert (
        "the runs ran on NVIDIA H100 80GB HBM3, " + str(BANDWIDTH) + " was measured on NVIDIA H200"
    ) in capsys.readouterr().err
    assert json.loads((out / "pp3_perf-p1.json").read_text())["cards"] == [h200]


def test_run_refuses_a_card_without_three_3090s_of_free_memory(work, monkeypatch, capsys):
    busy = {"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 81559 << 20,
            "memory_free_bytes": 40000 << 20}  # fmt: skip
    monkeypatch.setattr(pp3_perf, "card_now", lambda: busy)
    argv = ["run", "t", "--work", str(work), "--out", str(work / "o"), "--raw", str(work / "r"),
            "--only", "offload"]  # fmt: skip
    assert pp3_perf.main(argv) == 2
    err = capsys.readouterr().err
    assert "pp3_perf: pp3_perf (three 3090 ranks) needs 70.9 GiB free on one card" in err
    assert not (work / "r").exists()  # refused before anything ran
