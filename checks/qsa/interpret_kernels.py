#!/usr/bin/env python3
"""Run the shipped Triton kernels under TRITON_INTERPRET=1 against the reference.

Prints one JSON line {check: {ok, detail}}; exit 0 even when a check fails
(the pytest wrapper asserts). fp16 and fp32 only: the interpreter reads bf16
as raw integers. (The interpreter copies arguments itself, so allocation
checks live in test_qsa_offload_math.py with the kernels stubbed.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    sys.exit("run with TRITON_INTERPRET=1 (the kernels execute on CPU tensors)")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from qsa_module import load_offload_module  # noqa: E402
from reference import bf16_close, make_case  # noqa: E402

m = load_offload_module()
HEAD_DIM = 32


def check(results, name, out, ref):
    ok, worst = bf16_close(out, ref)
    finite = bool(torch.isfinite(out).all())
    results[name] = {
        "ok": ok and finite,
        "detail": f"worst={worst:.3f} finite={finite}",
    }


def main() -> None:
    results: dict[str, dict] = {}
    for dtype in (torch.float16, torch.float32):
        tag = str(dtype).split(".")[-1]
        case = make_case(
            seed=3,
            seq_lens=[40, 23, 70],
            query_lens=[7, 5, 1],
            width=24,
            empty_rows=2,
            dtype=dtype,
            head_dim=HEAD_DIM,
        )
        ref = case.reference()
        ws = m.OffloadWorkspace.allocate(
            max_rows=64,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=HEAD_DIM,
            chunk_tokens=8,
            selection_width=24,
            dtype=dtype,
            device="cpu",
        )
        k, v = case.kv_cache[..., :HEAD_DIM], case.kv_cache[..., HEAD_DIM:]
        for splits in (1, 3) if dtype == torch.float16 else (2,):
            out = torch.full_like(case.q, float("nan"))
            m.qsa_offload_decode(
                case.q,
                k,
                v,
                case.indices,
                case.block_table,
                case.token_to_req,
                case.gate,
                out,
                ws,
                splits=splits,
                block_n=16,
            )
            check(results, f"decode-uva-{tag}-splits{splits}", out, ref)
        dense = torch.full((case.q.shape[0], 24, 2, 2 * HEAD_DIM), float("nan"), dtype=dtype)
        m.qsa_offload_gather(
            case.kv_cache, case.indices, case.block_table, case.token_to_req, dense
        )
        out = torch.full_like(case.q, float("nan"))
        m.qsa_offload_attend_dense(
            case.q,
            dense,
            case.indices,
            case.token_to_req,
            case.gate,
            out,
            ws,
            splits=2,
            block_n=16,
        )
        check(results, f"decode-gathered-{tag}", out, ref)
        context_bytes = (
            int(case.seq_lens.sum()) * case.kv_cache[0, 0].numel() * (case.kv_cache.element_size())
        )
        for chunk in (1, 5, 128) if dtype == torch.float16 else (5,):
            ws_c = m.OffloadWorkspace.allocate(
                max_rows=64,
                num_q_heads=4,
                num_kv_heads=2,
                head_dim=HEAD_DIM,
                chunk_tokens=chunk,
                selection_width=24,
                dtype=dtype,
                device="cpu",
            )
            out = torch.full_like(case.q, float("nan"))
            counter = torch.zeros(1, dtype=torch.int64)
            m.qsa_offload_prefill(
                case.q,
                case.kv_cache,
                case.indices,
                case.block_table,
                case.token_to_req,
                case.seq_lens,
                case.gate,
                out,
                ws_c,
                **case.prefill_kwargs(),
                byte_counter=counter,
                block_n=16,
            )
            check(results, f"prefill-{tag}-chunk{chunk}", out, ref)
            results[f"prefill-bytes-{tag}-chunk{chunk}"] = {
                "ok": int(counter) == context_bytes,
                "detail": f"read {int(counter)} of context {context_bytes}",
            }
            # The same pass with the chunks copied from host block rows (DMA).
            kwargs = case.prefill_kwargs()
            rows = m.read_host_block_rows(
                case.block_table, case.seq_lens, kwargs["requests"],
                max_context=kwargs["max_context"], page_size=case.kv_cache.shape[1],
            )  # fmt: skip
            out = torch.full_like(case.q, float("nan"))
            counter = torch.zeros(1, dtype=torch.int64)
            m.qsa_offload_prefill(
                case.q, case.kv_cache, case.indices, case.block_table, case.token_to_req,
                case.seq_lens, case.gate, out, ws_c, **kwargs, byte_counter=counter,
                block_n=16, host_kv=case.kv_cache, host_rows=rows,
            )  # fmt: skip
            check(results, f"prefill-dma-{tag}-chunk{chunk}", out, ref)
            results[f"prefill-dma-bytes-{tag}-chunk{chunk}"] = {
                "ok": int(counter) == context_bytes,
                "detail": f"read {int(counter)} of context {context_bytes}",
            }
        # The pre-capture warmup runs every decode variant on an empty selection.
        head_dim = case.kv_cache.shape[3] // 2
        warmed = m.warmup_offload_decode(
            case.kv_cache[..., :head_dim], case.kv_cache[..., head_dim:], case.block_table, ws,
            num_q_heads=case.q.shape[1], selection_width=24,
        )  # fmt: skip
        results[f"decode-warmup-{tag}"] = {
            "ok": warmed == m.decode_split_variants(64, 16, selection_width=24) == (1, 2),
            "detail": f"split widths warmed {warmed}",
        }
        # A copy grid smaller than the chunk's tiles: each program walks several.
        for programs in (1, 3):
            work = torch.full((32, *case.kv_cache.shape[2:]), float("nan"), dtype=dtype)
            counter = torch.zeros(1, dtype=torch.int64)
            request, start, end = 2, 30, 62  # request 2 has 70 tokens: 8 tiles of 4
            m.qsa_offload_copy_chunk(
                case.kv_cache, case.block_table, case.seq_lens, request, start, end, work,
                byte_counter=counter, rows_per_program=4, programs=programs,
            )  # fmt: skip
            page = case.kv_cache.shape[1]
            tokens = torch.arange(start, end)
            blocks = case.block_table[request, tokens // page].long()
            expect = case.kv_cache[blocks, tokens % page]
            results[f"copy-chunk-{tag}-{programs}-programs"] = {
                "ok": bool(torch.equal(work, expect))
                and int(counter) == expect.numel() * expect.element_size(),
                "detail": f"read {int(counter)} bytes",
            }
    # The DMA chunk copy writes what the copy kernel writes, byte for byte:
    # rows past a request's length and rows of a block outside the arena are
    # zeros, and both count the same bytes.
    case = make_case(seed=4, seq_lens=[40, 23, 70], query_lens=[1, 1, 1], width=8,
                     dtype=torch.float32, head_dim=HEAD_DIM)  # fmt: skip
    table = case.block_table.clone()
    table[2, 1] = case.kv_cache.shape[0]  # a block id past the arena
    rows = m.read_host_block_rows(table, case.seq_lens, [0, 1, 2], max_context=70,
                                  page_size=case.kv_cache.shape[1])  # fmt: skip
    shape = (16, *case.kv_cache.shape[2:])
    mismatches = []
    for request in (0, 1, 2):
        for start in range(0, 72, 16):
            by_kernel, by_dma = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
            kernel_bytes, dma_bytes = (torch.zeros(1, dtype=torch.int64) for _ in range(2))
            m.qsa_offload_copy_chunk(case.kv_cache, table, case.seq_lens, request, start,
                                     start + 16, by_kernel, byte_counter=kernel_bytes)  # fmt: skip
            m.qsa_offload_copy_chunk_host(case.kv_cache, rows, request, start, start + 16,
                                          by_dma, byte_counter=dma_bytes)  # fmt: skip
            if not torch.equal(by_kernel, by_dma) or int(kernel_bytes) != int(dma_bytes):
                mismatches.append((request, start))
    results["copy-chunk-dma-equals-kernel"] = {
        "ok": not mismatches,
        "detail": f"chunks that differ (request, start): {mismatches}",
    }
    # K/V writes: slots -1 are skipped, others land at block * B + offset.
    arena = torch.zeros(4, 16, 2, 2 * HEAD_DIM, dtype=torch.float32)
    key = torch.randn(5, 2, HEAD_DIM)
    value = torch.randn(5, 2, HEAD_DIM)
    slots = torch.tensor([17, -1, 0, 63, 40], dtype=torch.int64)
    m.qsa_offload_store_kv(key, value, arena, slots)
    expect = torch.zeros_like(arena)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect[slot // 16, slot % 16] = torch.cat([key[i], value[i]], dim=-1)
    results["store-kv"] = {"ok": bool(torch.equal(arena, expect)), "detail": "slots"}
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
