"""The rank-fit harness (issue 12) on CPU: the slices are the plan's ranks.

rank_slice.py is run for real (the full skeleton, `flashnext plan` on the
replayed 3x3090 facts); the GPU side's bookkeeping (budget, verdict, merge)
is checked on records in the worker's schema. The slices' argv goes through
the real vLLM 0.33.0 (the pinned env, FLASHNEXT_VLLM_PY): its serve parser,
EngineArgs and config path accept each slice as the model the rank builds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import rank_fit
import rank_fit_worker
import rank_slice
from flashnext.checkpoint.targets import ple_ignore_pattern
from flashnext.facts.model_derived import TEXT_PREFIX
from flashnext.skeleton.inventory import build_inventory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "common"))

from tiny_plan import with_flag  # noqa: E402

LAYER = re.compile(r"(\.layers\.)(\d+)\.")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_fit")
    doc = rank_slice.build(out)
    return out, doc


def slice_config(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}" / "config.json").read_text())


def test_each_slice_holds_exactly_the_weights_the_plan_gives_its_rank(inputs):
    out, doc = inputs
    assert [r["layers"] for r in doc["ranks"]] == [[0, 16], [16, 32], [32, 48]]
    for r in doc["ranks"]:
        body = sum(
            rank_slice.tensor_bytes(e)
            for e in build_inventory(slice_config(out, r["rank"])).entries
            if e.group == "body"
        )
        extra = sum(r["slice_extra_bytes"].values())
        assert body - extra == r["planned"]["weight_bytes"], r["rank"]
    # The ends: rank 0 builds the LM head it does not hold, rank 2 the embedding.
    assert set(doc["ranks"][0]["slice_extra_bytes"]) == {"lm_head", "final_mixer_norm"}
    assert set(doc["ranks"][1]["slice_extra_bytes"]) == {
        "embed_tokens",
        "lm_head",
        "final_mixer_norm",
    }
    assert set(doc["ranks"][2]["slice_extra_bytes"]) == {"embed_tokens"}


def test_slices_keep_the_ranks_layer_pattern_and_the_ple_layer_on_rank_0(inputs):
    out, doc = inputs
    for r in doc["ranks"]:
        text = slice_config(out, r["rank"])["text_config"]
        assert text["num_hidden_layers"] == 16
        assert r["qsa_layers"] == [3, 7, 11, 15]
        assert r["qsa_layers"] == [i - r["layers"][0] for i in r["planned"]["qsa_layers"]], (
            "the slice's QSA layers are the rank's"
        )
        assert text["hidden_size"] == 2560 and text["num_experts"] == 512
    assert [r["ple_layer_ids"] for r in doc["ranks"]] == [[2], [], []]


def test_ignore_list_is_the_full_ones_for_the_ranks_layers_renumbered(inputs):
    """The unquantized modules of the rank's layers, renumbered, and the PLE table where
    the slice has it (`checkpoint fix` adds it, as to the full skeleton's)."""
    out, doc = inputs
    full_ignore = build_inventory(_full_config()).ignore
    for r in doc["ranks"]:
        lo, hi = r["layers"]
        expected = [
            ple_ignore_pattern(f"{TEXT_PREFIX}layers.{i - 1}.ple.ple_embedding.ngram_embedding")
            for i in r["ple_layer_ids"]  # one-indexed
        ]
        for name in full_ignore:
            m = LAYER.search(name)
            if m is None:
                expected.append(name)
            elif lo <= int(m.group(2)) < hi:
                start, end = m.span(2)
                expected.append(f"{name[:start]}{int(m.group(2)) - lo}{name[end:]}")
        got = slice_config(out, r["rank"])["quantization_config"]["ignore"]
        assert sorted(got) == sorted(expected), r["rank"]


def _full_config() -> dict:
    from flashnext.skeleton.configs import full_config

    return full_config()


def test_argv_is_the_plans_with_only_the_named_overrides(inputs):
    _, doc = inputs
    plan_argv = None
    for r in doc["ranks"]:
        assert r["argv"] == rank_slice.rank_argv(doc["plan_argv"], r["overrides"])
        assert r["overrides"] == {
            "model": f"@SLICE@/rank{r['rank']}", "pipeline_parallel_size": 1,
            "load_format": "dummy", "skip_tokenizer_init": True,
        } | ({} if r["rank"] == 0 else {"engram_config": None})  # fmt: skip
        argv = r["argv"]
        assert argv[0] == f"@SLICE@/rank{r['rank']}"
        assert argv[argv.index("--pipeline-parallel-size") + 1] == "1"
        assert argv[-3:] == ["--load-format", "dummy", "--skip-tokenizer-init"]
        assert ("--engram-config" in argv) == (r["rank"] == 0)
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(doc["kv_cache_memory_bytes"])
        if plan_argv is None:
            plan_argv = argv
    # Everything else equals the plan's argv for all ranks (rank 0's, less
    # its engram config, is the reference).
    rest = [a for a in plan_argv[1:] if a not in ("--engram-config",) and "mmap_path" not in a]
    for r in doc["ranks"][1:]:
        assert r["argv"][1:] == rest


def test_a_changed_profile_setting_reaches_the_workers_argv(inputs):
    """A setting the profile changes in the plan reaches the argv every rank's worker
    starts, and nothing else of that argv moves."""
    _, doc = inputs
    plan = {"argv": doc["plan_argv"], "env": doc["plan_env"]}
    changed = with_flag(with_flag(plan, "--max-num-seqs", "7"), "--max-num-batched-tokens", "1024")
    for r in doc["ranks"]:
        runs = {}
        for name, p in (("plan", plan), ("changed", changed)):
            rank = r | {"argv": rank_slice.rank_argv(p["argv"], r["overrides"])}
            spec = {"argv": rank_fit.spec_argv(rank, Path("/in"), []), "overrides": r["overrides"]}
            runs[name], overrides = rank_fit_worker.engine_argv(spec, 0.17)
        argv = runs["changed"]
        assert argv[argv.index("--max-num-seqs") + 1] == "7"
        assert argv[argv.index("--max-num-batched-tokens") + 1] == "1024"
        moved = [i for i, (a, b) in enumerate(zip(runs["plan"], argv, strict=True)) if a != b]
        assert [argv[i - 1] for i in moved] == ["--max-num-seqs", "--max-num-batched-tokens"]
        assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.17"
        assert overrides == r["overrides"] | rank_fit_worker.h200_overrides(0.17)


def test_the_hosts_variables_are_recorded_where_they_differ_from_the_plans(inputs):
    _, doc = inputs
    recorded = rank_fit.env_overrides(doc["plan_env"])
    assert recorded["VLLM_DISABLED_KERNELS"] == rank_fit.DISABLED_KERNELS  # 3090 kernels
    assert recorded["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine in the worker
    assert all(doc["plan_env"].get(k) != v for k, v in recorded.items())


def test_sparse_table_is_the_real_size_with_prepares_manifest(inputs, tmp_path):
    _, doc = inputs
    table = dict(doc["table"], path=str(tmp_path / "ple.bin"))
    assert table["bytes"] == 102_400_491_520  # 95.37 GiB, SPEC's figure
    written = rank_fit.write_sparse_table(table)
    assert written["bytes"] == table["bytes"]
    assert written["allocated_bytes"] < 1 << 20  # holes only
    manifest = json.loads((tmp_path / "ple.bin.json").read_text())
    assert (manifest["layout"], manifest["dtype"], manifest["dim"]) == ("packed", "BF16", 160)
    assert manifest["rows"] * manifest["dim"] * 2 == table["bytes"]


def test_ballast_leaves_the_3090s_free_memory_plus_the_slices_extra(inputs):
    _, doc = inputs
    for r in doc["ranks"]:
        b = rank_fit.budget(doc, r)
        extra = sum(r["slice_extra_bytes"].values())
        pp = r["planned"]["pp_buffer_bytes"]
        assert b["target_free"] == doc["card_free_bytes"] + extra - pp
        assert b["gate_budget"] == r["planned"]["vram_usable_bytes"] + extra - pp
    assert doc["card_free_bytes"] == 25_390_219_264  # the replayed facts' tightest card


def worker_record(oom_at: str | None = None) -> dict:
    cases, ok = [], True
    for i, case in enumerate(rank_fit.cases(262_144)):
        failed = case["name"] == oom_at
        cases.append(
            {
                "name": case["name"],
                "ok": not failed,
                "driver_peak": 23_000_000_000 + i,
                "max_reserved": 21_000_000_000 + i,
                "qsa_host_bytes": 10_445_783_040,
                **({"error": "OutOfMemoryError: CUDA out of memory"} if failed else {}),
            }
        )
        if failed:
            ok = False
            break
    start = {"driver_peak": 22_000_000_000, "max_reserved": 20_000_000_000, "qsa_host_bytes": 0}
    return {"start": start, "cases": cases, "ok": ok}


def test_verdict_moves_the_peak_back_to_the_rank_and_fails_on_an_oom(inputs):
    _, doc = inputs
    rank = doc["ranks"][1]
    b = rank_fit.budget(doc, rank)
    good = rank_fit.judge(doc, rank, worker_record(), b)
    assert good["ok"] is True
    assert good["peak_bytes"] == 23_000_000_002 - b["slice_extra"] + b["pp_buffers"]
    assert good["planned_bytes"] == rank["planned"]["committed_bytes"]
    assert good["margin_bytes"] == doc["card_free_bytes"] - good["peak_bytes"]
    oom = rank_fit.judge(doc, rank, worker_record(oom_at="4x60k"), b)
    assert oom["ok"] is False and oom["cases_ok"] == ["48k"]
    no_start = rank_fit.judge(doc, rank, {"start": {"error": "ValueError: Free memory"}}, b)
    assert no_start["ok"] is False
    # Every prefill finished, but only because the ballast left headroom: the
    # peak, as the rank, is more than a 3090 has free.
    roomy = worker_record()
    roomy["start"]["driver_peak"] = doc["card_free_bytes"] + b["slice_extra"] + 1
    over = rank_fit.judge(doc, rank, roomy, b)
    assert over["cases_ok"] == ["48k", "4x60k", "262k"] and over["ok"] is False
    assert over["margin_bytes"] < 0


def test_merge_writes_the_issues_fields_and_fails_when_a_rank_failed(inputs, tmp_path, capsys):
    _, doc = inputs
    for r in doc["ranks"]:
        b = rank_fit.budget(doc, r)
        worker = worker_record(oom_at="262k" if r["rank"] == 2 else None)
        record = rank_fit.judge(doc, r, worker, b) | {"host": {"note": "n"}}
        (tmp_path / f"rank_fit-t-rank{r['rank']}.json").write_text(json.dumps(record))
    args = type("A", (), {"run_id": "t", "results": tmp_path})
    assert rank_fit.merge(args) == 1
    merged = json.loads((tmp_path / "rank_fit-t.json").read_text())
    assert [(r["rank"], r["ok"]) for r in merged["ranks"]] == [(0, True), (1, True), (2, False)]
    for r in merged["ranks"]:
        assert {"rank", "planned_bytes", "peak_bytes", "ok"} <= set(r)
    assert "| 2 |" in capsys.readouterr().out


VLLM_SIDE = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from rank_fit_worker import engine_args
doc = json.load(open(os.path.join(sys.argv[2], "rank_fit.json")))
out = []
for r in doc["ranks"][:2]:
    argv = [a.replace("@SLICE@", sys.argv[2]) for a in r["argv"]]
    args = engine_args(argv)
    cc = args.compilation_config  # as parsed: the CPU platform turns graphs off
    graphs = cc["cudagraph_mode"] if isinstance(cc, dict) else cc.cudagraph_mode
    cfg = args.create_engine_config()
    text = cfg.model_config.hf_text_config
    out.append({
        "rank": r["rank"],
        "pp": cfg.parallel_config.pipeline_parallel_size,
        "load_format": str(cfg.load_config.load_format),
        "kv_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "max_model_len": cfg.model_config.max_model_len,
        "layers": text.num_hidden_layers,
        "ple": list(text.ple_layer_ids),
        "mmap": cfg.engram_config.mmap_path if cfg.engram_config else None,
        "quant": cfg.model_config.quantization,
        "graphs": str(graphs),
    })
print("RESULT " + json.dumps(out))
"""


def test_vllm_builds_each_slices_config_from_its_argv(inputs):
    python = os.environ.get("FLASHNEXT_VLLM_PY")
    if not python:
        pytest.skip("FLASHNEXT_VLLM_PY unset: checks/run sets it (the pinned vLLM env)")
    out, doc = inputs
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [python, "-c", VLLM_SIDE, str(HERE), str(out)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1].removeprefix("RESULT "))
    for g in got:
        assert g["pp"] == 1 and "dummy" in g["load_format"].lower()
        assert g["kv_bytes"] == doc["kv_cache_memory_bytes"]
        assert g["max_model_len"] == 262_144 and g["layers"] == 16
        assert g["quant"] == "compressed-tensors"
        assert "FULL_DECODE_ONLY" in g["graphs"]
    assert (got[0]["ple"], got[0]["mmap"]) == ([2], rank_slice.DEVICE_TABLE)
    assert (got[1]["ple"], got[1]["mmap"]) == ([], None)


def recorded_argv_as_planned(argv: list[str]) -> list[str]:
    """A run's argv less the worker's own changes: the utilization restated as
    this GPU's share (a start-up gate only, the KV bytes are explicit) and the
    GDN prefill backend a 3090 takes."""
    argv = list(argv)
    i = argv.index("--gpu-memory-utilization")
    del argv[i : i + 2]
    j = argv.index("--additional-config")
    assert json.loads(argv[j + 1]) == {"gdn_prefill_backend": "triton"}
    del argv[j : j + 2]
    return argv


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_the_run_of_record_measured_todays_plan_and_the_rank_fits(inputs, rank):
    """The GPU evidence for issue 12 stands for the plan only while the plan
    is the one it measured: a change to the weights per rank, the KV bytes or
    the argv fails here until `checks/gpu/rank_fit/run-rank-fit` is run again."""
    _, doc = inputs
    planned = doc["ranks"][rank]
    path = HERE.parent / "results" / f"rank_fit-{rank_fit.RUN_OF_RECORD}-rank{rank}.json"
    record = json.loads(path.read_text())
    assert record["planned_bytes"] == planned["planned"]["committed_bytes"]
    assert record["kv_cache_memory_bytes"] == doc["kv_cache_memory_bytes"]
    assert record["card_free_bytes"] == doc["card_free_bytes"]
    assert record["budget"] == rank_fit.budget(doc, planned)  # the ballast as planned, no headroom
    expected = [a.replace("@SLICE@", rank_fit.INPUTS_ON_HOST) for a in planned["argv"]]
    ran = recorded_argv_as_planned(record["worker"]["argv"])
    i = expected.index("--gpu-memory-utilization")
    assert ran == expected[:i] + expected[i + 2 :]
    assert record["ok"] is True
    assert record["cases_ok"] == [c["name"] for c in rank_fit.cases(0)]
    assert record["peak_bytes"] <= record["card_free_bytes"]
    assert record["qsa_host_bytes"] == record["qsa_host_bytes_planned"]
