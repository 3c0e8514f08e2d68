#!/usr/bin/env python3
"""QSA host-RAM K/V on a real GPU: correctness, decode gather, streamed prefill.

    python checks/gpu/kernels/qsa_offload_device.py OUT_DIR [--quick] [--only=SECTION,...]

Needs CUDA, torch and triton; no vLLM. The kernels are read out of
patches/vllm-0.33.0/0021-qsa-offload-kernels.patch (checks/qsa/qsa_module.py),
so what runs here is what the patch ships. Writes OUT_DIR/qsa_offload.json
(every figure) and OUT_DIR/qsa_offload.md (the table for checks/gpu/RESULTS.md).
Each section records its own error instead of aborting the run.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "checks" / "qsa"))

from qsa_module import load_offload_module  # noqa: E402
from reference import bf16_close, make_case  # noqa: E402

m = load_offload_module()
DEV = torch.device("cuda", 0)
# Qwen3.8-Flash-Next QSA shape: 24 query heads, 2 KV heads, head_dim 256,
# 2048 selected tokens + up to 3 tail tokens (2051 columns + count).
HQ, HKV, D, WIDTH = 24, 2, 256, 2051
TOKEN_BYTES = HKV * 2 * D * 2
BLOCK = 12144  # the offload block size (qsa_sizing: 3x3090 profile)
GIB = 2**30


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of fn() by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = (
            torch.cuda.Event(enable_timing=True),
            torch.cuda.Event(enable_timing=True),
        )
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_arena(tokens: int, seed: int):
    """Arena holding ``tokens`` of random K/V in shuffled blocks + its block table."""
    blocks = -(-tokens // BLOCK) + 1  # + null block 0
    arena = m.HostArena((blocks, BLOCK, HKV, 2 * D), torch.bfloat16, DEV)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    flat = arena.device_view.view(blocks, -1)
    for b in range(blocks):  # fill through UVA, one block at a time
        flat[b].copy_(torch.randn(flat.shape[1], generator=gen, device=DEV).to(torch.bfloat16))
    perm = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    table = perm[None, : blocks - 1].to(device=DEV, dtype=torch.int32)
    return arena, table


def selection(rows: int, context: int, seed: int, width: int = WIDTH) -> torch.Tensor:
    """``rows`` rows of ``width`` distinct random tokens in [0, context) + count."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    idx = torch.empty(rows, width + 1, dtype=torch.int32, device=DEV)
    for r in range(rows):
        take = min(width, context)
        idx[r, :take] = torch.randperm(context, generator=gen, device=DEV)[:take].to(torch.int32)
        idx[r, take:width] = -1
        idx[r, width] = take
    return idx


def env_section() -> dict:
    props = torch.cuda.get_device_properties(DEV)
    _free, total = torch.cuda.mem_get_info(DEV)
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError as exc:
        thp = f"unavailable ({exc})"
    return {
        "device": props.name,
        "capability": f"{props.major}.{props.minor}",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "vram_total_gib": round(total / GIB, 2),
        "transparent_hugepage": thp,
    }


def correctness_section() -> dict:
    """bf16 kernels vs float64 reference; outputs poisoned (NaN) before each run."""
    out: dict = {}
    ws = m.OffloadWorkspace.allocate(
        max_rows=2048,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        chunk_tokens=1000,
        dtype=torch.bfloat16,
        device=DEV,
    )
    cases = {
        "decode-4-requests": {
            "seq_lens": [3000, 9000, 700, 5000],
            "query_lens": [1, 1, 1, 1],
        },
        "prefill-with-decodes": {
            "seq_lens": [6000, 2500, 4100],
            "query_lens": [40, 1, 1],
        },
        "prefill-empty-rows": {"seq_lens": [1500], "query_lens": [24], "empty_rows": 5},
    }
    for name, kw in cases.items():
        case = make_case(
            seed=7,
            width=WIDTH,
            block_size=16,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            **kw,
        )
        ref = case.reference()
        # The cache lives in a host arena; the metadata on the GPU.
        arena = m.HostArena(tuple(case.kv_cache.shape), torch.bfloat16, DEV)
        arena.host.copy_(case.kv_cache)
        g = {
            k: getattr(case, k).to(DEV)
            for k in ("q", "gate", "indices", "block_table", "token_to_req", "seq_lens")
        }
        kv = arena.device_view
        runs = {}
        for splits in (1, 8, 32):
            o = torch.full_like(g["q"], float("nan"))
            m.qsa_offload_decode(
                g["q"],
                kv[..., :D],
                kv[..., D:],
                g["indices"],
                g["block_table"],
                g["token_to_req"],
                g["gate"],
                o,
                ws,
                splits=splits,
            )
            runs[f"uva-decode-splits{splits}"] = o
        vram = case.kv_cache.to(DEV)
        o = torch.full_like(g["q"], float("nan"))
        m.qsa_offload_decode(
            g["q"],
            vram[..., :D],
            vram[..., D:],
            g["indices"],
            g["block_table"],
            g["token_to_req"],
            g["gate"],
            o,
            ws,
        )
        runs["vram-decode"] = o
        dense = torch.full(
            (g["q"].shape[0], WIDTH, HKV, 2 * D),
            float("nan"),
            dtype=torch.bfloat16,
            device=DEV,
        )
        m.qsa_offload_gather(kv, g["indices"], g["block_table"], g["token_to_req"], dense)
        o = torch.full_like(g["q"], float("nan"))
        m.qsa_offload_attend_dense(g["q"], dense, g["indices"], g["token_to_req"], g["gate"], o, ws)
        runs["uva-gather-then-attend"] = o
        context_bytes = int(case.seq_lens.sum()) * TOKEN_BYTES
        for chunk in (1, 333, 1000):
            if chunk == 1 and max(kw["seq_lens"]) > 3000:
                continue  # 1-token chunks are proven on CPU; too many launches here
            wsc = m.OffloadWorkspace.allocate(
                max_rows=2048,
                num_q_heads=HQ,
                num_kv_heads=HKV,
                head_dim=D,
                chunk_tokens=chunk,
                dtype=torch.bfloat16,
                device=DEV,
            )
            o = torch.full_like(g["q"], float("nan"))
            counter = torch.zeros(1, dtype=torch.int64, device=DEV)
            m.qsa_offload_prefill(
                g["q"],
                kv,
                g["indices"],
                g["block_table"],
                g["token_to_req"],
                g["seq_lens"],
                g["gate"],
                o,
                wsc,
                **case.prefill_kwargs(),
                byte_counter=counter,
            )
            runs[f"streamed-prefill-chunk{chunk}"] = o
            out[f"{name}/streamed-prefill-chunk{chunk}/bytes_ratio"] = (
                int(counter.item()) / context_bytes
            )
        for run, o in runs.items():
            ok, worst = bf16_close(o, ref)
            out[f"{name}/{run}"] = {
                "ok": ok and bool(torch.isfinite(o).all()),
                "worst_over_bound": round(worst, 4),
            }
        # K/V writes through UVA land in host memory.
        new = torch.randn(8, HKV, 2 * D, device=DEV).to(torch.bfloat16)
        slots = torch.tensor([5, -1, 16, 17, 40, 3, -1, 33], dtype=torch.int64, device=DEV)
        m.qsa_offload_store_kv(new[..., :D], new[..., D:], kv, slots)
        torch.cuda.synchronize()
        host = arena.host
        good = all(
            torch.equal(host[s // 16, s % 16], new[i].cpu())
            for i, s in enumerate(slots.tolist())
            if s >= 0
        )
        out[f"{name}/store-kv-through-uva"] = {"ok": good}
        arena.release()
    return out


# Decode is served as a CUDA graph (FULL_DECODE_ONLY), so each call is timed
# as a graph replay. Served decode meets a cold L2 (every other layer's work
# runs between two reads of one layer's K/V), so the L2 is overwritten
# before each timed call, whatever it would keep of earlier reads; that work
# also keeps the GPU busy while the call is launched, so no launch gap is
# timed.
DECODE_SELECTIONS = 8


class ColdTimer:
    """Seconds of single launches, each after the GPU's L2 was overwritten."""

    def __init__(self) -> None:
        l2 = torch.cuda.get_device_properties(DEV).L2_cache_size
        self.flush = torch.empty(max(4 * l2, 256 * 2**20), dtype=torch.uint8, device=DEV)

    def samples(self, launches, count: int) -> list[float]:
        """``count`` timed launches, cycling through ``launches``."""
        for launch in launches:
            launch()
        torch.cuda.synchronize(DEV)
        pairs = []
        for i in range(count):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            self.flush.zero_()
            start.record()
            launches[i % len(launches)]()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(DEV)
        return [start.elapsed_time(end) / 1e3 for start, end in pairs]

    def median(self, launches, count: int) -> float:
        return statistics.median(self.samples(launches, count))


class Captured:
    """A call captured as a CUDA graph; calling it replays the graph.

    The graph holds only the addresses of the call's tensors, so the call
    (and the tensors it binds) is kept alive with it: a freed selection
    would be reused by later allocations and the replay would read garbage.
    """

    def __init__(self, call) -> None:
        self.call = call
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            call()

    def __call__(self) -> None:
        self.graph.replay()


def graphs_of(calls) -> list[Captured]:
    """One CUDA graph per call, each warmed up outside capture."""
    side = torch.cuda.Stream(DEV)
    side.wait_stream(torch.cuda.current_stream(DEV))
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream(DEV).wait_stream(side)
    torch.cuda.synchronize(DEV)
    return [Captured(call) for call in calls]


def fastest(timer: ColdTimer, configs: dict, make_calls, count: int):
    """(config name, graph replays, {config: seconds}) of the fastest of ``configs``."""
    best, seconds = None, {}
    for name, kwargs in configs.items():
        replays = graphs_of(make_calls(**kwargs))
        seconds[name] = timer.median(replays, count)
        if best is None or seconds[name] < seconds[best[0]]:
            best = (name, replays)
    return best[0], best[1], seconds


def decode_section(quick: bool) -> dict:
    """Per-layer decode: UVA attention, UVA gather, staged CPU gather, vs H2D copy.

    Configs are chosen per context; then the chosen graphs of every context
    and the H2D reference run in interleaved rounds, so a drift of the host
    link during the run hits every context alike.
    """
    out: dict = {}
    contexts = [65536, 262144, 1048576]
    ws = m.OffloadWorkspace.allocate(
        max_rows=512,
        num_q_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        chunk_tokens=16,
        dtype=torch.bfloat16,
        device=DEV,
    )
    count, rounds = (8, 5) if quick else (16, 15)
    timer = ColdTimer()
    arenas = {context: make_arena(context, seed=context) for context in contexts}
    attention_configs = {
        f"splits{s}/block_n{b}": {"splits": s, "block_n": b}
        for s in (8, 16, 32, 65)
        for b in (16, 32)
    }
    gather_configs = {
        f"rows_per_program{r}/warps{w}": {"rows_per_program": r, "num_warps": w}
        for r in (2, 4, 8, 16)
        for w in (2, 4, 8)
    }
    for rows in (1, 4):
        q = torch.randn(rows, HQ, D, device=DEV).to(torch.bfloat16)
        gate = torch.randn(rows, HQ, D, device=DEV).to(torch.bfloat16)
        o = torch.empty_like(q)
        req = torch.zeros(rows, dtype=torch.int32, device=DEV)
        nbytes = rows * WIDTH * TOKEN_BYTES
        # What the layer (0022) runs: QSA_OFFLOAD_DECODE_SPLITS = 16, default columns.
        shipped = {"splits": m.decode_splits(rows, ws.row_sum.numel() // HQ, 16), "block_n": 16}
        out[f"rows{rows}/uva_attention_config"] = shipped
        # H2D reference: pinned sources registered the way the arena is.
        sources = m.HostArena((DECODE_SELECTIONS, rows * WIDTH, HKV, 2 * D), torch.bfloat16, DEV)
        h2d_dst = torch.empty(rows * WIDTH, HKV, 2 * D, dtype=torch.bfloat16, device=DEV)
        h2d_copies = [
            partial(h2d_dst.copy_, sources.host[i], non_blocking=True)
            for i in range(DECODE_SELECTIONS)
        ]
        dense = torch.empty(rows, WIDTH, HKV, 2 * D, dtype=torch.bfloat16, device=DEV)
        staging = torch.empty(rows * WIDTH, HKV, 2 * D, dtype=torch.bfloat16).pin_memory()
        chosen = {}
        for context in contexts:
            arena, table = arenas[context]
            kv = arena.device_view
            picks = [
                selection(rows, context, seed=rows * 7 + context + 1009 * i)
                for i in range(DECODE_SELECTIONS)
            ]
            key = f"rows{rows}/ctx{context}"

            def decode_calls(cache=kv, picks=picks, table=table, inputs=(q, req, gate, o), **kw):
                q, req, gate, o = inputs
                return [
                    partial(
                        m.qsa_offload_decode,
                        *(q, cache[..., :D], cache[..., D:], idx, table, req, gate, o, ws),
                        **kw,
                    )
                    for idx in picks
                ]

            def gather_calls(kv=kv, picks=picks, table=table, req=req, dense=dense, **kw):
                return [
                    partial(m.qsa_offload_gather, kv, idx, table, req, dense, **kw) for idx in picks
                ]

            attention_name, _, sweep = fastest(timer, attention_configs, decode_calls, count)
            out[f"{key}/uva_attention_best_config"] = attention_configs[attention_name]
            out[f"{key}/uva_attention_sweep_us"] = {k: round(t * 1e6, 2) for k, t in sweep.items()}
            gather_name, gather, sweep = fastest(timer, gather_configs, gather_calls, count)
            out[f"{key}/uva_gather_config"] = gather_configs[gather_name]
            out[f"{key}/uva_gather_sweep_us"] = {k: round(t * 1e6, 2) for k, t in sweep.items()}
            # The attention figure is the layer's own config, not the sweep's best.
            attention = graphs_of(decode_calls(**shipped))
            chosen[context] = {"uva_gather": gather, "uva_attention": attention}
            out[f"{key}/attend_dense_s"] = timer.median(
                graphs_of(
                    [
                        partial(m.qsa_offload_attend_dense, q, dense, idx, req, gate, o, ws)
                        for idx in picks
                    ]
                ),
                count,
            )
            # Staged: the host needs the selection (a device sync), gathers rows
            # from the arena into pinned staging, then one H2D copy.
            flat = arena.host.view(-1, HKV, 2 * D)
            staged_dst = dense.view(-1, HKV, 2 * D)

            def staged(flat=flat, idx=picks[0], table=table, dst=staged_dst, staging=staging):
                sel = idx[:, :WIDTH].cpu().long()
                tok = sel.clamp_min(0)
                phys = table[0].cpu().long()[tok // BLOCK] * BLOCK + tok % BLOCK
                torch.index_select(flat, 0, phys.flatten(), out=staging)
                dst.copy_(staging, non_blocking=True)

            out[f"{key}/staged_cpu_gather_s"] = wall(staged, 20 if quick else 50)
            vram = torch.empty(arena.host.shape, dtype=torch.bfloat16, device=DEV)
            vram.copy_(kv)
            out[f"{key}/vram_attention_s"] = timer.median(
                graphs_of(decode_calls(cache=vram, **shipped)), count
            )
            del vram
            torch.cuda.empty_cache()
        series = {
            context: {"h2d": [], "uva_gather": [], "uva_attention": []} for context in contexts
        }
        for _ in range(rounds):
            for context in contexts:
                s = series[context]
                s["h2d"] += timer.samples(h2d_copies, count)
                for name, replays in chosen[context].items():
                    s[name] += timer.samples(replays, count)
        h2d = statistics.median(t for s in series.values() for t in s["h2d"])
        out[f"rows{rows}/h2d_copy_same_bytes_s"] = h2d
        out[f"rows{rows}/h2d_copy_same_bytes_GBps"] = nbytes / h2d / 1e9
        for context, s in series.items():
            key = f"rows{rows}/ctx{context}"
            gather = statistics.median(s["uva_gather"])
            attention = statistics.median(s["uva_attention"])
            out[f"{key}/uva_gather_s"] = gather
            out[f"{key}/uva_gather_GBps"] = nbytes / gather / 1e9
            out[f"{key}/uva_gather_vs_h2d"] = h2d / gather
            out[f"{key}/uva_attention_s"] = attention
            out[f"{key}/gather_then_attend_s"] = gather + out.pop(f"{key}/attend_dense_s")
            out[f"{key}/spread_us"] = {
                name: [round(q * 1e6, 2) for q in statistics.quantiles(times, n=10)[::4]]
                for name, times in s.items()
            }
        # Each timed graph still reads what its call reads eagerly.
        same = True
        for context in contexts:
            for name, result in (("uva_gather", dense), ("uva_attention", o)):
                for captured in chosen[context][name]:
                    captured.call()
                    eager = result.clone()
                    result.fill_(float("nan"))
                    captured()
                    same &= bool(torch.equal(result, eager))
        out[f"rows{rows}/graph_replays_equal_eager_calls"] = same
        for name in ("gather", "attention"):
            times = [out[f"rows{rows}/ctx{c}/uva_{name}_s"] for c in contexts]
            out[f"rows{rows}/{name}_flatness_max_over_min"] = max(times) / min(times)
        del chosen
        sources.release()
    for arena, _table in arenas.values():
        arena.release()
    return out


def prefill_section(quick: bool) -> dict:
    """Streamed prefill over a 256k context: bytes, throughput vs H2D, peak VRAM.

    The shipped path copies chunks by the copy engine from host block rows
    (``host_kv``/``host_rows``); the SM-copy path (UVA loads, the only one
    inside a graph capture) is measured beside it.
    """
    out: dict = {}
    context = 262144
    rows = 512  # --max-num-batched-tokens 512: the prefill chunk of the seed's setup
    arena, table = make_arena(context, seed=11)
    kv = arena.device_view
    seq_lens = torch.tensor([context], dtype=torch.int32, device=DEV)
    q = torch.randn(rows, HQ, D, device=DEV).to(torch.bfloat16)
    gate = torch.randn(rows, HQ, D, device=DEV).to(torch.bfloat16)
    req = torch.zeros(rows, dtype=torch.int32, device=DEV)
    idx = selection(rows, context, seed=5)
    o = torch.empty_like(q)
    context_bytes = context * TOKEN_BYTES
    iters = 3 if quick else 9
    host_rows = m.read_host_block_rows(table, seq_lens, [0], max_context=context, page_size=BLOCK)
    by_dma = {"host_kv": arena.host, "host_rows": host_rows}

    def workspace(chunk):
        return m.OffloadWorkspace.allocate(
            max_rows=rows,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            chunk_tokens=chunk,
            dtype=torch.bfloat16,
            device=DEV,
        )

    def prefill(ws, lens=seq_lens, sel=idx, ctx=context, **kw):
        m.qsa_offload_prefill(
            *(q, kv, sel, table, req, lens, gate, o, ws),
            row_begin=0,
            row_end=rows,
            requests=[0],
            max_context=ctx,
            **kw,
        )

    for chunk in (16384, 32768, 65536):
        ws = workspace(chunk)
        key = f"chunk{chunk}"
        chunk_bytes = chunk * TOKEN_BYTES
        # Streaming H2D reference: the same bytes in chunk-sized pinned copies.
        src = torch.empty(chunk_bytes, dtype=torch.uint8).pin_memory()
        dst = torch.empty(chunk_bytes, dtype=torch.uint8, device=DEV)
        n = context // chunk

        def stream(src=src, dst=dst, n=n):
            for _ in range(n):
                dst.copy_(src, non_blocking=True)

        copies = {}
        for path in ("sm", "dma"):
            counter = torch.zeros(1, dtype=torch.int64, device=DEV)

            def copy_all(ws=ws, chunk=chunk, counter=counter, path=path):
                for start in range(0, context, chunk):
                    end = min(start + chunk, context)
                    if path == "dma":
                        m.qsa_offload_copy_chunk_host(
                            arena.host, host_rows, 0, start, end, ws.chunk[0], byte_counter=counter
                        )
                    else:
                        m.qsa_offload_copy_chunk(
                            kv, table, seq_lens, 0, start, end, ws.chunk[0], byte_counter=counter
                        )

            copies[path] = timed(copy_all, iters)
            counter.zero_()
            copy_all()
            out[f"{key}/{path}_bytes_read_per_pass_over_context_bytes"] = (
                int(counter.item()) / context_bytes
            )
        # The reference and both passes alternate, so a drift of the host
        # link during the run moves all three.
        prefill(ws, **by_dma)
        dma_out = o.clone()
        prefill(ws)
        out[f"{key}/dma_output_equals_sm_output"] = bool(torch.equal(o, dma_out))
        times = {"h2d": [], "dma": [], "sm": []}
        for _ in range(iters):
            times["h2d"].append(timed(stream, 1, warmup=1))
            times["dma"].append(timed(partial(prefill, ws, **by_dma), 1, warmup=0))
            times["sm"].append(timed(partial(prefill, ws), 1, warmup=0))
        h2d = statistics.median(times["h2d"])
        out[f"{key}/h2d_stream_GBps"] = context_bytes / h2d / 1e9
        for path in ("sm", "dma"):
            out[f"{key}/{path}_copy_GBps"] = context_bytes / copies[path] / 1e9
            out[f"{key}/{path}_copy_vs_h2d"] = h2d / copies[path]
            t_pass = statistics.median(times[path])
            out[f"{key}/{path}_pass_s"] = t_pass
            out[f"{key}/{path}_pass_vs_h2d"] = h2d / t_pass
        out[f"{key}/rounds_ms"] = {
            name: [round(t * 1e3, 3) for t in series] for name, series in times.items()
        }
        out[f"{key}/workspace_bytes"] = m.OffloadWorkspace.nbytes_for(
            max_rows=rows,
            num_q_heads=HQ,
            num_kv_heads=HKV,
            head_dim=D,
            chunk_tokens=chunk,
        )
        del src, dst, ws
        torch.cuda.empty_cache()
    # The SM-copy grid (the path inside graph capture), 32k chunks. 4096
    # programs is one per tile (the grid before the bounded copy): it fills
    # every SM, so the attention waits for the copy.
    ws = workspace(32768)
    sweep = {}
    for programs in (8, 16, 32, 4096):
        for copy_rows in (8, 16):
            run = partial(prefill, ws, copy_rows_per_program=copy_rows, copy_programs=programs)
            sweep[f"programs{programs}/copy_rows{copy_rows}"] = timed(run, iters, warmup=1)
    best = min(sweep, key=sweep.get)
    h2d_32k = out["chunk32768/h2d_stream_GBps"]
    out["sweep/chunk32768/pass_s"] = sweep
    out["sweep/chunk32768/best"] = best
    out["sweep/chunk32768/best_vs_h2d"] = context_bytes / sweep[best] / 1e9 / h2d_32k
    out["sweep/chunk32768/one_program_per_tile_vs_h2d"] = (
        context_bytes / sweep["programs4096/copy_rows8"] / 1e9 / h2d_32k
    )
    # Peak scratch across chunk COUNTS: one workspace, contexts of 1..8 chunks.
    # The host rows are read before the pass, as the layer reads them once
    # per step before any layer's pass.
    for n_chunks in (1, 2, 4, 8):
        ctx = n_chunks * 32768
        sel = selection(rows, ctx, seed=n_chunks)
        lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
        host = m.read_host_block_rows(table, lens, [0], max_context=ctx, page_size=BLOCK)
        for path, kw in (("sm", {}), ("dma", {"host_kv": arena.host, "host_rows": host})):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated(DEV)
            torch.cuda.reset_peak_memory_stats(DEV)
            prefill(ws, lens=lens, sel=sel, ctx=ctx, **kw)
            torch.cuda.synchronize()
            out[f"peak/{path}/chunks{n_chunks}/extra_bytes_during_pass"] = (
                torch.cuda.max_memory_allocated(DEV) - base
            )
    out["peak/workspace_bytes"] = ws.nbytes()
    arena.release()
    return out


def arena_section() -> dict:
    """Exact-size registration: requested vs rounded sizes, and pointer identity."""
    out = {}
    for gib in (0.5, 1.03):
        tokens = int(gib * GIB) // TOKEN_BYTES
        a = m.HostArena((1, tokens, HKV, 2 * D), torch.bfloat16, DEV)
        out[f"arena_{gib}GiB/nbytes"] = a.nbytes
        out[f"arena_{gib}GiB/same_pointer"] = a.device_view.data_ptr() == a.host.data_ptr()
        out[f"arena_{gib}GiB/is_pinned"] = bool(a.host.is_pinned())
        a.release()
    return out


def render(results: dict) -> str:
    d = results.get("decode", {})
    p = results.get("prefill", {})
    c = results.get("correctness", {})
    env = results["env"]
    lines = [
        f"Device: {env.get('device')} (torch {env.get('torch')}, " + f"triton {env.get('triton')})",
        "",
        "| check | figure | goal | verdict |",
        "|---|---|---|---|",
    ]

    def row(name, value, goal, ok):
        lines.append(f"| {name} | {value} | {goal} | {'PASS' if ok else 'FAIL'} |")

    bad = [k for k, v in c.items() if isinstance(v, dict) and not v.get("ok", True)]
    worst = max(
        (v.get("worst_over_bound", 0) for v in c.values() if isinstance(v, dict)),
        default=float("nan"),
    )
    n = sum(1 for v in c.values() if isinstance(v, dict))
    row(
        "bf16 kernels vs float64 reference (NaN-poisoned outputs)",
        f"{n - len(bad)}/{n} runs within bound, worst {worst:.2f}x bound",
        "all",
        not bad,
    )
    for rows in (1, 4):
        for ctx in (65536, 262144, 1048576):
            k = f"rows{rows}/ctx{ctx}"
            if f"{k}/uva_gather_s" not in d:
                continue
            row(
                f"decode gather (CUDA graph), {rows} row(s), {ctx} tokens",
                f"{d[f'{k}/uva_gather_s'] * 1e3:.3f} ms, {d[f'{k}/uva_gather_GBps']:.1f} GB/s, "
                f"{d[f'{k}/uva_gather_vs_h2d']:.2f}x H2D",
                ">= 0.8x H2D",
                d[f"{k}/uva_gather_vs_h2d"] >= 0.8,
            )
            sweep = d.get(f"{k}/uva_attention_sweep_us")
            best = f" (best of the split sweep {min(sweep.values()) / 1e3:.3f})" if sweep else ""
            row(
                f"decode attention (CUDA graph), {rows} row(s), {ctx} tokens: "
                "UVA, the layer's splits / gather+attend / staged CPU / VRAM",
                f"{d[f'{k}/uva_attention_s'] * 1e3:.3f}{best} / "
                f"{d[f'{k}/gather_then_attend_s'] * 1e3:.3f} / "
                f"{d[f'{k}/staged_cpu_gather_s'] * 1e3:.3f} / "
                f"{d[f'{k}/vram_attention_s'] * 1e3:.3f} ms",
                "info",
                True,
            )
        if f"rows{rows}/graph_replays_equal_eager_calls" in d:
            same = d[f"rows{rows}/graph_replays_equal_eager_calls"]
            row(f"decode, {rows} row(s): timed graph replays equal eager calls", str(same),
                "equal", same)  # fmt: skip
        if f"rows{rows}/gather_flatness_max_over_min" in d:
            f = d[f"rows{rows}/gather_flatness_max_over_min"]
            row(
                f"decode gather flatness 64k..1M, {rows} row(s)",
                f"max/min {f:.3f}",
                "<= 1.10",
                f <= 1.10,
            )
            f = d[f"rows{rows}/attention_flatness_max_over_min"]
            row(
                f"decode attention flatness 64k..1M, {rows} row(s)",
                f"max/min {f:.3f}",
                "<= 1.10",
                f <= 1.10,
            )
    paths = {"dma": "copy engine (shipped)", "sm": "SM loads (in graph capture)"}
    for chunk in (16384, 32768, 65536):
        k = f"chunk{chunk}"
        if f"{k}/dma_pass_s" not in p:  # a run from before the copy-engine path
            continue
        for path, label in paths.items():
            ratio = p[f"{k}/{path}_bytes_read_per_pass_over_context_bytes"]
            row(
                f"prefill 256k ctx, chunk {chunk}, {label}: bytes read / context K/V bytes",
                f"{ratio:.4f}",
                "<= 1.1",
                ratio <= 1.1,
            )
        for path, label in paths.items():
            row(
                f"prefill chunk {chunk}, {label}: chunk copies alone vs streaming H2D",
                f"{p[f'{k}/{path}_copy_GBps']:.1f} vs {p[f'{k}/h2d_stream_GBps']:.1f} GB/s "
                f"({p[f'{k}/{path}_copy_vs_h2d']:.2f}x)",
                "info",
                True,
            )
        for path, label in paths.items():
            ratio = p[f"{k}/{path}_pass_vs_h2d"]
            row(
                f"prefill chunk {chunk}, 512 rows, {label}: whole pass vs streaming H2D",
                f"{p[f'{k}/{path}_pass_s'] * 1e3:.1f} ms ({ratio:.2f}x)",
                ">= 0.85x" if path == "dma" else "info",
                ratio >= 0.85 or path != "dma",
            )
        row(
            f"prefill chunk {chunk}: copy-engine pass output equals SM-copy pass output",
            str(p[f"{k}/dma_output_equals_sm_output"]),
            "equal",
            p[f"{k}/dma_output_equals_sm_output"],
        )
    if "sweep/chunk32768/best" in p:
        row(
            f"prefill chunk 32768, SM loads, best copy grid ({p['sweep/chunk32768/best']}) / "
            "one program per tile (the grid before): whole pass vs streaming H2D",
            f"{p['sweep/chunk32768/best_vs_h2d']:.2f}x / "
            f"{p['sweep/chunk32768/one_program_per_tile_vs_h2d']:.2f}x",
            "info",
            True,
        )
    for path, label in paths.items():
        peaks = {k: v for k, v in p.items() if k.startswith(f"peak/{path}/chunks")}
        if peaks:
            row(
                f"peak extra VRAM during prefill, {label}, 1/2/4/8 chunks (workspace "
                f"preallocated, {p['peak/workspace_bytes'] / 2**20:.1f} MiB)",
                " / ".join(str(v) for v in peaks.values()) + " bytes",
                "equal",
                len(set(peaks.values())) == 1,
            )
    for sec in ("correctness", "decode", "prefill", "arena"):
        if "error" in results.get(sec, {}):
            lines.append(f"\n{sec} section error: `{results[sec]['error'].splitlines()[-1]}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or not torch.cuda.is_available():
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in argv
    only = next((a.split("=", 1)[1].split(",") for a in argv if a.startswith("--only=")), None)
    results: dict = {"env": env_section()}
    sections = [
        ("arena", arena_section),
        ("correctness", correctness_section),
        ("decode", lambda: decode_section(quick)),
        ("prefill", lambda: prefill_section(quick)),
    ]
    for name, fn in sections:
        if only and name not in only:
            continue
        t0 = time.time()
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - keep the other sections' figures
            results[name] = {"error": traceback.format_exc()}
        results[name]["section_seconds"] = round(time.time() - t0, 1)
        print(f"[{name}] {results[name]['section_seconds']} s", flush=True)
        (out_dir / "qsa_offload.json").write_text(
            json.dumps(results, indent=1, sort_keys=True, default=str)
        )
    table = render(results)
    (out_dir / "qsa_offload.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
