"""Issue 27: the full-size model under PP=3 on one H200, where a step's time goes.

    pp3_perf.py prepare --work DIR [--mtp K ...] [--host-facts FILE]   (launcher env)
    pp3_perf.py run RUN_ID --work DIR --kit DIR --out DIR [--only E ...] [--dry-run]
    pp3_perf.py contract RUN_ID --inputs FILE --raw DIR [--out-dir DIR] [--bandwidth FILE]

`prepare` (runs where the launcher runs: here for the tests, the GPU host
for the run, `run` calls it): the full skeleton (`flashnext skeleton
--fixed-metadata`: real safetensors headers, sparse data; vLLM loads it with
`--load-format dummy`), the 3x3090 plan (`flashnext plan --json` on the
replayed 3090 facts, checks/fixtures/facts/3x3090-nvme.json, as rank_fit
does: the host's H200 replayed x3 would plan three 141 GiB cards, not the
3x3090 argv; the host's facts replayed x3 are kept beside it, for the
record), one plan per MTP K (`--mtp K --max-model-len 131072`, the profile's
advice), each rank's weight bytes as decode reads them (the planner's own
placement, per rank), and the PLE table as a sparse file of the real size
with the manifest `table prepare` writes. Writes DIR/inputs.json.

`run`: for each engine, one process (perf_engine.py) under the kit's
patched tree, the three ranks on GPU 0 (onegpu_perf/sitecustomize.py: the
pp3 shim, the 3090's kernels, a memory sampler), with the plan's argv
except the overrides `engine_argv` names, and a ballast (rank_fit's) that
leaves free three 3090s' free memory. Writes OUT/pp3_perf_raw-RUN-ENGINE.json.

`contract`: pp3_perf-RUN.json from the raw files (perf_contract.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "pp3"))
sys.path.insert(0, str(HERE.parent / "rank_fit"))
sys.path.insert(0, str(HERE.parent / "common"))

from card import card as card_now  # noqa: E402
from card import refusal  # noqa: E402
from emulation import ONE_GPU_ENV, replicate_gpu  # noqa: E402
from own_session import run_in_own_session  # noqa: E402
from perf_cases import ENGINES, Engine, engines_named  # noqa: E402, F401 (one home: perf_cases)
from plan_settings import flag_value, mtp_compilation, plan_env  # noqa: E402
from rank_fit import HOST_ENV, TOKEN_RANGE, start_ballast, stop_ballast  # noqa: E402

FACTS_3090 = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
SHIM_DIR = HERE / "onegpu_perf"
# The profile's MTP advice (profiles/3x3090.toml [mtp]): --max-model-len 131072.
MTP_MAX_MODEL_LEN = 131_072
# Decode cases: a prompt past the indexer's budget (config indexer_budget
# 2048), so every QSA layer selects its full 2,048 rows, as at long context.
DECODE_PROMPT = 3_000
DECODE_TOKENS = 64
PROFILE_TOKENS = 16
# The profiler starts after this many decode steps in a row (step_probe): at
# c=1 the first decode step; at c>1 two pipeline depths (3 ranks), past the
# steps where one request's prefill chunks still take turns with decodes.
PROFILE_SETTLE = {1: 1}
PROFILE_SETTLE_DEFAULT = 6
# Blocks to spare when a K the 3x3090 plan refuses gets a larger KV pool.
KV_POOL_MARGIN_BLOCKS = 2
NEW_TOKENS_AT_LIMIT = 2  # rank_fit's 262k case: max_model_len - 2 prompt tokens


# --- prepare (the launcher's python) ---------------------------------------


def _flashnext(*args: str) -> str:
    command = shlex.split(os.environ.get("FLASHNEXT_CMD", f"{sys.executable} -m flashnext"))
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'launcher' / 'src'}:"
           + os.environ.get("PYTHONPATH", "")}  # fmt: skip
    proc = subprocess.run([*command, *args], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"flashnext {args[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def rank_bytes(model_dir: Path, ranges: list[list[int]]) -> list[dict[str, int]]:
    """Each rank's weight bytes as decode reads them: the planner's placement
    (weights_per_rank), split per rank into dense / routed / embedding."""
    sys.path.insert(0, str(REPO / "launcher" / "src"))
    from flashnext.facts.model import read_model_facts
    from flashnext.facts.model_derived import ple_shard_names
    from flashnext.plan.placement import place_tensor

    model = read_model_facts(model_dir)
    text = model.text_config
    ple = frozenset(ple_shard_names(text))
    rank_of = {i: r for r, (lo, hi) in enumerate(ranges) for i in range(lo, hi)}
    last = len(ranges) - 1
    out = [{"dense_bytes": 0, "routed_expert_bytes": 0, "embedding_bytes": 0} for _ in ranges]
    for name, nbytes in model.tensor_bytes_by_class().items():
        spot = place_tensor(name, ple)
        if spot.where == "layer":
            rank = rank_of[spot.layer]
        elif spot.where in ("first", "last"):
            rank = 0 if spot.where == "first" else last
        else:
            continue
        key = (
            "routed_expert_bytes" if spot.routed_expert
            else "embedding_bytes" if spot.embedding else "dense_bytes"
        )  # fmt: skip
        out[rank][key] += nbytes
    types = text["layer_types"]
    for r, (lo, hi) in enumerate(ranges):
        out[r]["gdn_layers"] = sum(t == "linear_attention" for t in types[lo:hi])
        out[r]["qsa_layers"] = sum(t == "full_attention" for t in types[lo:hi])
        out[r]["moe_layers"] = hi - lo  # every decoder layer is MoE (config: no dense MLP)
        out[r]["embedding_row_bytes"] = out[r]["embedding_bytes"] // text["vocab_size"]
    return out


def write_sparse_table(path: Path, nbytes: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """The table at its real size, holes only, and its manifest (rank_fit's way)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.stat().st_size != nbytes:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    Path(f"{path}.json").write_text(json.dumps(manifest, indent=2) + "\n")
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "allocated_bytes": st.st_blocks * 512}


def prepare(work: Path, mtp: list[int], host_facts: Path | None) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "launcher" / "src"))
    from flashnext.table.layout import read_layout

    work.mkdir(parents=True, exist_ok=True)
    model, table = work / "model", work / "ple-table.bin"
    if not (model / ".complete").exists():
        if model.exists():
            subprocess.run(["rm", "-rf", str(model)], check=True)
        _flashnext("skeleton", str(model), "--fixed-metadata", "--json")
        (model / ".complete").write_text("")
    if mtp:  # the drafter's experts as INT4 (the profile's advice); no-op when done
        _flashnext("checkpoint", "mtp-int4", "--model", str(model))
    common = ["--facts", str(FACTS_3090), "--model", str(model), "--table", str(table), "--json"]
    plans = {"0": json.loads(_flashnext("plan", *common))}
    for k in mtp:
        plans[str(k)] = json.loads(
            _flashnext("plan", *common, "--mtp", str(k), "--max-model-len", str(MTP_MAX_MODEL_LEN))
        )
    layout = read_layout(model)
    facts = json.loads(FACTS_3090.read_text())
    doc: dict[str, Any] = {
        "note": "issue 27 inputs: full skeleton (dummy weights), the 3x3090 plans, per-rank bytes",
        "facts": str(FACTS_3090.relative_to(REPO)),
        "card_free_bytes": min(int(d["memory_free_bytes"]) for d in facts["gpu"]["devices"]),
        "plans": plans,
        "config": json.loads((model / "config.json").read_text()),
        "rank_bytes": rank_bytes(model, plans["0"]["pp_ranges"]),
        "table": write_sparse_table(table, layout.file_bytes("packed"), layout.manifest("packed")),
    }
    if host_facts is not None:  # the host as it is, replayed x3 (pp3/emulation.py), recorded
        doc["host_facts_x3"] = replicate_gpu(json.loads(host_facts.read_text()), 3)
    (work / "inputs.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# --- the engines' argv and env (pure) ----------------------------------------


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return argv[: i + 1] + [value] + argv[i + 2 :]
    return [*argv, flag, value]


def engine_argv(plan: dict[str, Any], engine: Engine) -> tuple[list[str], dict[str, Any]]:
    """`vllm serve` arguments (less `vllm serve`) for the engine, and the overrides by name.

    The plan's argv, changed only here: dummy weights (the skeleton has no
    data), no tokenizer (token-id prompts; none in the skeleton), the GDN
    prefill a 3090 runs (rank_fit's `gdn_prefill_backend: triton`), and in
    VRAM mode `--max-model-len -1` (vLLM fits the context to the plan's
    own KV bytes: "where it fits"). `--gpu-memory-utilization` is restated
    on the host by perf_engine.py (bytes -> the H200's share) and recorded."""
    argv = list(plan["argv"])
    if Path(argv[0]).name != "vllm" or argv[1] != "serve":
        raise ValueError(f"the plan's argv is not `vllm serve`: {argv[:3]}")
    argv = argv[2:]
    overrides: dict[str, Any] = {
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "additional_config": {"gdn_prefill_backend": "triton"},
    }
    argv += ["--load-format", "dummy", "--skip-tokenizer-init"]
    argv += ["--additional-config", json.dumps(overrides["additional_config"])]
    if engine.mode == "vram":
        argv = _set(argv, "--max-model-len", "-1")
        overrides["max_model_len"] = -1
    return argv, overrides


def engine_env(plan: dict[str, Any], engine: Engine) -> tuple[dict[str, str], dict[str, Any]]:
    """The plan's environment plus the harness's, and what differs from the plan."""
    env, dropped = plan_env(plan, offload=engine.mode != "vram")
    added = {
        **ONE_GPU_ENV,  # the pp3 shim: three ranks on GPU 0
        **HOST_ENV,  # rank_fit's: no network, sm90-only kernels off, engine in-process
        "FLASHNEXT_PERF_3090_KERNELS": "1",
        "FLASHNEXT_PERF_MEMORY": "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(step_probe.*)
        # One profiler window per case: CUPTI set up again after a teardown
        # under CUDA graphs is what torch's own profiler code says crashes
        # (profiler.py, its TEARDOWN_CUPTI=0 workaround, applied there only
        # below CUDA 12.6); p1's worker died of heap corruption in its second.
        "TEARDOWN_CUPTI": "0",
    }
    return env | added, {"env_added": added, "env_dropped": dropped}


def cases_for(engine: Engine, max_model_len: int) -> list[dict[str, Any]]:
    out = []
    for kind, value in engine.cases:
        if kind == "decode":
            settle = PROFILE_SETTLE.get(value, PROFILE_SETTLE_DEFAULT)
            out.append({"kind": "decode", "concurrency": value, "prompt_tokens": DECODE_PROMPT,
                        "new_tokens": DECODE_TOKENS, "profile_tokens": PROFILE_TOKENS,
                        "profile_settle_steps": settle})  # fmt: skip
        else:
            tokens = max_model_len - NEW_TOKENS_AT_LIMIT if value == "limit" else value
            out.append({"kind": "ttft", "concurrency": 1, "prompt_tokens": tokens})
    return out


def beyond_3090(inputs: dict[str, Any], k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan a refused K runs under, and what it changes. On 3x3090 every
    K above 1 is refused at any --max-model-len: each request's GDN state
    takes K + 1 blocks per layer group, and K=2 already needs more blocks
    than rank 2's pool has (the plan's `blocks_per_request` against
    `pool_blocks`), so its argv carries no MTP. A draft step's cost is still
    measurable: K=1's plan (the profile's MTP argv) with K drafts and
    --kv-cache-memory-bytes grown until one request at max_model_len fits,
    KV_POOL_MARGIN_BLOCKS to spare, and the decode graphs K drafts need (as
    the launcher's MTP plan has them, from the profile's sizes the refused
    plan's argv carries). Only where the drafter loads (`load`)."""
    mtp = inputs["plans"][str(k)].get("mtp") or {}
    base = inputs["plans"].get("1")
    if not ((mtp.get("load") or {}).get("fits") and mtp.get("pool_blocks") and base
            and (base.get("mtp") or {}).get("fits")):  # fmt: skip
        raise SystemExit(f"pp3_perf: the MTP K={k} plan does not fit: {mtp.get('reason')}")
    need = mtp["blocks_per_request"] + KV_POOL_MARGIN_BLOCKS
    kv = math.ceil(mtp["kv_cache_memory_bytes"] * need / mtp["pool_blocks"])
    drafts = json.dumps({"method": "mtp", "num_speculative_tokens": k}, separators=(",", ":"))
    compilation = mtp_compilation(inputs["plans"][str(k)], k)
    argv = _set(list(base["argv"]), "--speculative-config", drafts)
    argv = _set(argv, "--kv-cache-memory-bytes", str(kv))
    argv = _set(argv, "--compilation-config", json.dumps(compilation, sort_keys=True,
                                                         separators=(",", ":")))  # fmt: skip
    restated = {
        "why": mtp["reason"],
        "plan": f"K=1's ({base['plan_hash']}), {k} drafts",
        "kv_cache_memory_bytes": {"plan": mtp["kv_cache_memory_bytes"], "run": kv},
        "cudagraph_capture_sizes": compilation["cudagraph_capture_sizes"],
        "blocks": {"per_request": mtp["blocks_per_request"], "pool": mtp["pool_blocks"]},
    }
    return base | {"argv": argv}, restated


def spec_for(engine: Engine, inputs: dict[str, Any]) -> dict[str, Any]:
    plan = inputs["plans"].get(str(engine.mtp_k))
    if plan is None:
        k = engine.mtp_k
        raise SystemExit(f"pp3_perf: no plan for MTP K={k}: prepare --mtp {k}")
    restated = None
    if engine.mtp_k and not plan.get("mtp", {}).get("fits", False):
        plan, restated = beyond_3090(inputs, engine.mtp_k)
    argv, overrides = engine_argv(plan, engine)
    if engine.profile_capture_sizes:
        profile = flag_value(inputs["plans"]["0"]["argv"], "--compilation-config")
        argv = _set(argv, "--compilation-config", profile)
        overrides["compilation_config"] = json.loads(profile)
    env, env_changes = engine_env(plan, engine)
    usable = [r["vram_usable_bytes"] for r in plan["ranks"]]
    return {
        "engine": engine.name,
        # A refused K's runs say so wherever they are reported (perf_contract's runs).
        "mode": engine.mode if restated is None else f"{engine.mode}, KV pool beyond 3x3090",
        "beyond_3090": restated,
        "mtp_k": engine.mtp_k,
        "argv": argv,
        "env": env,
        "overrides": overrides | env_changes,
        # Restated on the host: min over ranks of the plan's usable bytes / H200 total.
        "usable_bytes": min(usable),
        "max_model_len": plan["max_model_len"]["value"],
        "cases": cases_for(engine, plan["max_model_len"]["value"]),
        "token_range": list(TOKEN_RANGE),
        "plan_hash": plan["plan_hash"],
    }


# --- run (the GPU host) -------------------------------------------------------


def ballast_free(inputs: dict[str, Any]) -> int:
    """Free bytes the one shared ballast leaves: three idle 3090s' free memory.
    A ballast per rank cannot be had on one GPU; each rank's own budget is its
    restated utilization (the start gate) and the plan's KV bytes, and its
    peaks are measured per process and judged against one 3090's free memory."""
    return 3 * inputs["card_free_bytes"]


def launch(spec: dict[str, Any], args) -> dict[str, Any]:
    raw = args.raw
    stem = raw / spec["engine"]
    spec_path, out_path, log_path = (
        Path(f"{stem}{s}") for s in (".spec.json", ".out.json", ".log")
    )
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    command = (
        f". {args.kit / 'env-patched.sh'} && export PYTHONPATH={SHIM_DIR}:{HERE}:$PYTHONPATH && "
        f"exec python3 {HERE / 'perf_engine.py'} {spec_path} {out_path}"
    )
    ballast, held = start_ballast(ballast_free(args.inputs))
    started = time.monotonic()
    try:
        code = run_in_own_session(command, {**os.environ, **spec["env"]}, log_path, args.timeout)
    finally:
        stop_ballast(ballast)
    record = json.loads(out_path.read_text()) if out_path.exists() else {"ok": False}
    record |= {"exit": code, "wall_s": round(time.monotonic() - started, 1), "ballast": held,
               "card": args.card, "spec": spec,
               "log_tail": log_path.read_text(errors="replace").splitlines()[-80:]}  # fmt: skip
    dest = args.out / f"pp3_perf_raw-{args.run_id}-{spec['engine']}.json"
    dest.write_text(json.dumps(record, indent=1) + "\n")
    print(f"pp3_perf: {spec['engine']} exit {code} ok={record.get('ok')} "
          f"after {record['wall_s']} s -> {dest}", flush=True)  # fmt: skip
    return record


def run(args) -> int:
    args.inputs = json.loads((args.work / "inputs.json").read_text())
    specs = [spec_for(e, args.inputs) for e in engines_named(args.only)]
    args.card = card_now()  # which card ran: an H200 call may get an H100
    # The one card must hold three 3090s' free memory beside the ballast (ballast_free):
    # 3 x 25,390,219,264 B = 70.9 GiB, which an idle H200 (140.4 GiB) or H100 (79.6
    # GiB) has; a card that has less is refused here, by name, not by the ballast.
    why = refusal(args.card, ballast_free(args.inputs), "pp3_perf (three 3090 ranks)")
    if why and not args.dry_run:
        print(f"pp3_perf: {why}", file=sys.stderr)
        return 2
    if args.dry_run:
        for spec in specs:
            print(json.dumps({"engine": spec["engine"], "argv": ["vllm", "serve", *spec["argv"]],
                              "overrides": spec["overrides"], "cases": spec["cases"],
                              "ballast_free_bytes": ballast_free(args.inputs)}))  # fmt: skip
        return 0
    args.raw.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for spec in specs:
        if not launch(spec, args).get("ok"):
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="checks/gpu/perf/pp3_perf.py", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare")
    pr.add_argument("--work", type=Path, required=True)
    pr.add_argument("--mtp", type=int, nargs="*", default=[])
    pr.add_argument("--host-facts", type=Path)
    r = sub.add_parser("run")
    r.add_argument("run_id")
    r.add_argument("--work", type=Path, required=True)
    r.add_argument("--kit", type=Path, default=Path("/root/kit"))
    r.add_argument("--out", type=Path, default=Path("/root/pp3_perf/out"))
    r.add_argument("--raw", type=Path, default=Path("/root/pp3_perf/raw"))
    r.add_argument("--only", nargs="*")
    r.add_argument("--timeout", type=int, default=540)
    r.add_argument("--dry-run", action="store_true", help="print the engines and argv only")
    c = sub.add_parser("contract")
    c.add_argument("run_id")
    c.add_argument("--inputs", type=Path, required=True, help="prepare's inputs.json")
    c.add_argument("--raw", type=Path, required=True, help="the pp3_perf_raw-RUN-*.json files")
    c.add_argument("--out-dir", type=Path, default=HERE.parent / "results")
    c.add_argument("--bandwidth", type=Path,
                   default=HERE.parent / "results" / "hbm_bandwidth-h200-b1.json")  # fmt: skip
    c.add_argument(
        "--model",
        type=Path,
        help="the skeleton prepare made (WORK/model): bytes_per_token's terms from its "
        "headers, for inputs whose plan predates decode.terms (p1, p2)",
    )
    c.add_argument(
        "--calibration",
        type=Path,
        help="shared_gpu_calibration.json (default: RAW/shared_gpu_calibration.json)",
    )
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        doc = prepare(args.work, args.mtp, args.host_facts)
        table = doc["table"]
        print(
            f"pp3_perf: prepared {args.work}: plans {sorted(doc['plans'])}, "
            f"table {table['bytes']} B ({table['allocated_bytes']} on disk)"
        )
        return 0
    if args.cmd == "run":
        return run(args)
    import perf_contract

    return perf_contract.main(args)


if __name__ == "__main__":
    sys.exit(main())
