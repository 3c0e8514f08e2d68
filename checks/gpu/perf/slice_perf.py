"""Issue 40 item 1's second basis: each 3090 rank's slice alone on one card.

    slice_perf.py run RUN_ID --inputs DIR --kit DIR --out DIR [--ranks R ...] [--dry-run]
    slice_perf.py handoff --out FILE [--rows 1 4] [--iters N] [--backend nccl|gloo]
    slice_perf.py combine RUN_ID --raw DIR --pp3-inputs FILE [--bandwidth FILE] [--out-dir DIR]

The PP=3 harness (pp3_perf.py) runs three ranks on one GPU, which time-shares
their kernels. Here no other rank is on the card: `run` starts each rank's
slice (rank_fit's: `rank_slice.py` cuts the 3x3090 plan into one PP=1 model
per rank, the plan's argv with the rank's overrides; carried as
.gpu/rank_fit) as an engine of its own, under one ballast that leaves one
3090's free memory plus the slice's extra modules (rank_fit.budget), and
perf_engine.py times its decode steps at c=1 and c=4 (step_probe: the
steps' period, CUDA-event span, host time; the profiler's kernel time).
`handoff` times the PP hand-offs apart (torch only): each rank's send of the
hidden state ([rows, hidden x hc_count] bf16) to the next, and the last
rank's broadcast of the sampled ids, over NCCL between processes. `combine`
adds them up: per batch, each rank's step alone plus the hand-offs is a
token's way through three cards with nothing else on them, projected to
3x3090 by the PP=3 contract's rules (projection.py). Where this basis and
the PP=3 emulation's agree, the projection stands on both; where they
differ, the difference is the time-sharing correction, measured.

A slice is not the rank to the byte: PP=1 builds both ends, so ranks 0 and 1
compute the LM head and sample, and ranks 1 and 2 embed. The step time taken
is the forward's CUDA-event span (`execute_gpu_span_ms`: the embedding row is
in it, the LM head and sampler are not; the last rank's sampler, which its
PP step does run, is added from its `sample_tokens` GPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "rank_fit"))
sys.path.insert(0, str(HERE.parent / "common"))

from own_session import run_in_own_session  # noqa: E402
from rank_fit import HOST_ENV, TOKEN_RANGE, budget, spec_argv, write_sparse_table  # noqa: E402

SHIM_DIR = HERE / "onegpu_perf"
DECODE_PROMPT, DECODE_TOKENS, PROFILE_TOKENS = 3_000, 64, 16  # pp3_perf's decode cases
# One rank alone: one request's decode steps follow each other at once; at c=4
# the four prompts' prefill chunks come first (pp3_perf's settle, one rank deep).
PROFILE_SETTLE = {1: 1, 4: 2}
HIDDEN_BF16 = 2
ENV_ADDED = {
    **HOST_ENV,  # rank_fit's: no network, sm90-only kernels off, the engine in-process
    "FLASHNEXT_PERF_3090_KERNELS": "1",  # the perf shim: a 3090's kernel choice
    "FLASHNEXT_PERF_MEMORY": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc(step_probe.*)
    "TEARDOWN_CUPTI": "0",  # pp3_perf.engine_env's reason
}


def cases() -> list[dict[str, Any]]:
    return [{"kind": "decode", "concurrency": c, "prompt_tokens": DECODE_PROMPT,
             "new_tokens": DECODE_TOKENS, "profile_tokens": PROFILE_TOKENS,
             "profile_settle_steps": PROFILE_SETTLE[c]} for c in (1, 4)]  # fmt: skip


def spec_for(doc: dict[str, Any], rank: int, inputs: Path) -> dict[str, Any]:
    """perf_engine.py's spec for one rank's slice: rank_fit's argv and budget."""
    entry = doc["ranks"][rank]
    b = budget(doc, entry)
    return {
        "engine": f"slice{rank}",
        "mode": "slice alone (PP=1, one rank's layers, no other rank on the card)",
        "mtp_k": 0,
        "argv": spec_argv(entry, inputs, []),
        "env": {**doc["plan_env"], **ENV_ADDED},
        "overrides": entry["overrides"] | {"env_added": ENV_ADDED},
        "usable_bytes": b["gate_budget"],
        "ballast_free_bytes": b["target_free"],
        "cases": cases(),
        "token_range": list(TOKEN_RANGE),
        "plan_hash": doc["plan_hash"],
        "rank": rank,
    }


def launch(spec: dict[str, Any], doc: dict[str, Any], args) -> dict[str, Any]:
    from rank_fit import start_ballast, stop_ballast

    args.work.mkdir(parents=True, exist_ok=True)
    stem = args.work / spec["engine"]
    spec_path, out_path, log_path = (Path(f"{stem}{s}") for s in (".spec.json", ".out.json",
                                                                   ".log"))  # fmt: skip
    spec_path.write_text(json.dumps(spec, indent=1))
    out_path.unlink(missing_ok=True)
    if doc["ranks"][spec["rank"]]["ple_layer_ids"]:
        write_sparse_table(doc["table"])
    command = (
        f". {args.kit / 'env-patched.sh'} && export PYTHONPATH={SHIM_DIR}:{HERE}:$PYTHONPATH && "
        f"exec python3 {HERE / 'perf_engine.py'} {spec_path} {out_path}"
    )
    ballast, held = start_ballast(spec["ballast_free_bytes"])
    started = time.monotonic()
    try:
        code = run_in_own_session(command, {**os.environ, **spec["env"]}, log_path, args.timeout)
    finally:
        stop_ballast(ballast)
    record = json.loads(out_path.read_text()) if out_path.exists() else {"ok": False}
    record |= {"exit": code, "wall_s": round(time.monotonic() - started, 1), "ballast": held,
               "spec": spec, "emulated": False,
               "log_tail": log_path.read_text(errors="replace").splitlines()[-60:]}  # fmt: skip
    dest = args.out / f"slice_perf_raw-{args.run_id}-{spec['engine']}.json"
    dest.write_text(json.dumps(record, indent=1) + "\n")
    print(f"slice_perf: {spec['engine']} exit {code} ok={record.get('ok')} -> {dest}", flush=True)
    return record


def run(args) -> int:
    doc = json.loads((args.inputs / "rank_fit.json").read_text())
    ranks = args.ranks if args.ranks is not None else [r["rank"] for r in doc["ranks"]]
    unknown = [r for r in ranks if not 0 <= r < len(doc["ranks"])]
    if unknown:
        raise SystemExit(
            f"slice_perf: no rank {unknown} in rank_fit.json (0-{len(doc['ranks']) - 1})"
        )
    specs = [spec_for(doc, r, args.inputs) for r in ranks]
    if args.dry_run:
        for s in specs:
            print(json.dumps({k: s[k] for k in ("engine", "argv", "usable_bytes",
                                                "ballast_free_bytes", "cases")}))  # fmt: skip
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    return 0 if all([launch(s, doc, args).get("ok") for s in specs]) else 1


# --- the hand-offs (torch only) ----------------------------------------------


def _handoff_worker(rank: int, world: int, port: int, spec: dict[str, Any], queue) -> None:
    import torch
    import torch.distributed as dist

    if spec["backend"] == "nccl":
        os.environ["NCCL_HOSTID"] = f"slice-perf-{rank}"  # the pp3 shim's way: one card
    dist.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)  # fmt: skip
    device = torch.device("cuda", 0) if spec["backend"] == "nccl" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    for rows in spec["rows"]:
        hidden = torch.zeros(rows, spec["hidden"], dtype=torch.bfloat16, device=device)
        ids = torch.zeros(rows, dtype=torch.int64, device=device)
        send_ms, bcast_ms = [], []
        for i in range(spec["warmup"] + spec["iters"]):
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            if rank == 0:  # the hand-off 0 -> 1 and back: a round trip, halved
                dist.send(hidden, 1)
                dist.recv(hidden, 1)
            elif rank == 1:
                dist.recv(hidden, 0)
                dist.send(hidden, 0)
            sync()
            t1 = time.perf_counter()
            dist.broadcast(ids, world - 1)  # the last rank's sampled ids to every rank
            sync()
            t2 = time.perf_counter()
            if i >= spec["warmup"]:
                send_ms.append((t1 - t0) * 1e3 / 2)
                bcast_ms.append((t2 - t1) * 1e3)
        out[str(rows)] = {"send_ms": statistics.median(send_ms),
                          "broadcast_ms": statistics.median(bcast_ms),
                          "bytes": hidden.numel() * hidden.element_size()}  # fmt: skip
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def handoff(rows: list[int], hidden: int, world: int, backend: str, iters: int,
            warmup: int = 5) -> dict[str, Any]:  # fmt: skip
    """Median wall time of one PP send of [rows, hidden] bf16 and of the ids'
    broadcast, between `world` processes on GPU 0 (NCCL over loopback sockets,
    the PP=3 emulation's transport; the 3090s' is NCCL through host memory) or,
    for the CPU test, gloo."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"rows": rows, "hidden": hidden, "backend": backend, "iters": iters, "warmup": warmup}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_handoff_worker, args=(r, world, port, spec, queue))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    result = None
    while result is None:
        try:
            result = queue.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty: no result yet
            if not any(p.is_alive() for p in procs):
                codes = [p.exitcode for p in procs]
                raise SystemExit(
                    f"slice_perf handoff: every process ended, none with a "
                    f"result (exit codes {codes}); their errors are above"
                ) from None
    for p in procs:
        p.join(timeout=60)
    transport = ("NCCL over loopback sockets, every process on GPU 0 (NCCL_HOSTID per rank): "
                 "an upper bound on the 3090s' NCCL through host memory" if backend == "nccl"
                 else "gloo on the CPU (the test's)")  # fmt: skip
    return {"backend": backend, "transport": transport, "world": world, "iters": iters,
            "by_rows": result}  # fmt: skip


# --- combine (here) -------------------------------------------------------------


def rank_step(raw: dict[str, Any], batch: int, last: bool) -> dict[str, Any] | None:
    """One slice's decode step alone at `batch`: the forward's CUDA-event span (the
    last rank's sampler added), the profiler's kernel time, the host's time."""
    case = next((c for c in raw.get("cases", []) if c.get("kind") == "decode"
                 and c.get("concurrency") == batch and c.get("ranks")), None)  # fmt: skip
    if case is None:
        return None
    w = case["ranks"][0]
    prof = (case.get("profile") or [{}])[0]
    sampler_us = (w.get("sample_tokens") or {}).get("gpu_us_median") or 0.0
    span = w.get("execute_gpu_span_ms")
    return {
        "span_ms": None if span is None else span + (sampler_us / 1e3 if last else 0.0),
        "compute_ms": prof.get("compute_ms_per_step"),
        "cpu_ms": w.get("host_critical_ms"),
        "decode_rows": max(w.get("decode_rows") or [0]) or None,
        "decode_tok_s": case.get("decode_tok_s"),
    }


def combine(raws: dict[int, dict[str, Any]], hand: dict[str, Any] | None, pp3_inputs,
            bandwidth: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Per batch: each rank alone, the hand-offs, a token's time through the three
    cards on the H200 and projected to 3x3090 (the contract's rule)."""
    from perf_contract import rank_bytes_of
    from projection import Links, MeasuredStep, hbm_bytes_per_step, pcie_bytes_per_step
    from projection import round_ms as projected_round_ms

    links = Links(bandwidth["results"]["read"]["bytes_per_s"],
                  bandwidth["results"]["h2d_pinned"]["bytes_per_s"])  # fmt: skip
    n = len(pp3_inputs["plans"]["0"]["ranks"])
    out: dict[str, Any] = {"batches": []}
    for batch in (1, 4):
        steps = [rank_step(raws[r], batch, r == n - 1) if r in raws else None for r in range(n)]
        by_rows = ((hand or {}).get("by_rows") or {}).get(str(batch))
        entry: dict[str, Any] = {"batch": batch, "ranks": steps, "handoff": by_rows,
                                 "h200_token_ms": None, "projected_3090_tok_s": None}  # fmt: skip
        if all(s and s["span_ms"] is not None for s in steps) and by_rows:
            hops = (n - 1) * by_rows["send_ms"] + by_rows["broadcast_ms"]
            entry["h200_token_ms"] = sum(s["span_ms"] for s in steps) + hops
            entry["h200_tok_s"] = batch * 1e3 / entry["h200_token_ms"]
            context = DECODE_PROMPT + DECODE_TOKENS // 2
            measured = []
            for r, s in enumerate(steps):
                rb = rank_bytes_of(pp3_inputs, r)
                rows = s["decode_rows"] or batch
                hbm = hbm_bytes_per_step(rb, pp3_inputs["config"], rows=rows, context=context,
                                         kv_in_vram=False)["total"]  # fmt: skip
                pcie = pcie_bytes_per_step(rb, pp3_inputs["config"], rows=rows, context=context,
                                           kv_in_vram=False)  # fmt: skip
                measured.append(MeasuredStep(s["span_ms"], s["cpu_ms"] or 0.0, pcie, hbm))
            # The hand-offs carried over as measured (an upper bound: loopback sockets).
            token = projected_round_ms(measured, links) + hops
            entry["projected_3090_tok_s"] = batch * 1e3 / token
        out["batches"].append(entry)
    out["basis"] = (
        "each rank's slice alone on one GPU (no time-sharing): its forward's CUDA-event span, "
        "the last rank's sampler added; hand-offs timed apart (handoff.transport); projected "
        "by projection.RULE per rank, the hand-offs carried over as measured"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="checks/gpu/perf/slice_perf.py", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("run_id")
    r.add_argument("--inputs", type=Path, default=Path("/root/rank_fit/inputs"),
                   help="rank_slice.py's output (rank_fit.json and the slices)")  # fmt: skip
    r.add_argument("--kit", type=Path, default=Path("/root/kit"))
    r.add_argument("--out", type=Path, default=Path("/root/slice_perf/out"))
    r.add_argument("--work", type=Path, default=Path("/root/slice_perf/work"),
                   help="each engine's spec and log")  # fmt: skip
    r.add_argument("--ranks", type=int, nargs="*")
    r.add_argument("--timeout", type=int, default=280, help="seconds per slice engine")
    r.add_argument("--dry-run", action="store_true", help="print each slice's engine only")
    h = sub.add_parser("handoff")
    h.add_argument("--out", type=Path, required=True)
    h.add_argument("--rows", type=int, nargs="*", default=[1, 4])
    h.add_argument("--hidden", type=int, default=2560 * 4, help="hidden_size x hc_count")
    h.add_argument("--world", type=int, default=3)
    h.add_argument("--iters", type=int, default=200)
    h.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    c = sub.add_parser("combine")
    c.add_argument("run_id")
    c.add_argument("--raw", type=Path, required=True, help="slice_perf_raw-RUN-slice*.json, "
                   "slice_perf_handoff-RUN.json")  # fmt: skip
    c.add_argument("--pp3-inputs", type=Path, required=True, help="pp3_perf prepare's inputs")
    c.add_argument("--bandwidth", type=Path,
                   default=HERE.parent / "results" / "hbm_bandwidth-h200-b1.json")  # fmt: skip
    c.add_argument("--out-dir", type=Path, default=HERE.parent / "results")
    args = p.parse_args(argv)
    if args.cmd == "run":
        return run(args)
    if args.cmd == "handoff":
        if args.world < 2 or min(args.rows, default=0) < 1 or args.iters < 1:
            p.error("handoff needs --world 2 or more (a sender and a receiver), --rows and "
                    "--iters of 1 or more")  # fmt: skip
        doc = handoff(args.rows, args.hidden, args.world, args.backend, args.iters)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"slice_perf handoff: {json.dumps(doc['by_rows'])}")
        return 0
    raws = {}
    for path in sorted(args.raw.glob(f"slice_perf_raw-{args.run_id}-slice*.json")):
        raws[int(path.stem.rsplit("slice", 1)[1])] = json.loads(path.read_text())
    hand_path = args.raw / f"slice_perf_handoff-{args.run_id}.json"
    hand = json.loads(hand_path.read_text()) if hand_path.exists() else None
    doc = combine(raws, hand, json.loads(args.pp3_inputs.read_text()),
                  json.loads(args.bandwidth.read_text()))  # fmt: skip
    doc |= {"run_id": args.run_id, "emulated": False, "note": "our pinned vLLM 0.33.0 on the "
            "host's torch, dummy weights, one rank's slice at a time on one GPU"}  # fmt: skip
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dest = args.out_dir / f"slice_perf-{args.run_id}.json"
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"slice_perf combine: {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
