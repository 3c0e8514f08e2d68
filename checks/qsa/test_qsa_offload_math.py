"""The chunk-streamed QSA algorithm against a float64 reference, on CPU.

- ``stream_prefill_torch`` (the kernels' math, tile for tile, in torch, bf16)
  for chunk sizes from 1 row to larger than the context.
- The Triton kernels themselves under TRITON_INTERPRET=1 (subprocess), in
  fp16/fp32: the interpreter reads bf16 as raw integers, so bf16 runs on
  the GPU only (checks/gpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qsa_module import PATCH, TARGET, extract_new_file
from reference import bf16_close, make_case

HERE = Path(__file__).resolve().parent

CASES = {
    # name: (seq_lens, query_lens, width, empty_rows)
    "prefill-two-requests": ([40, 23], [7, 5], 24, 2),
    "decode-batch": ([57, 9, 120], [1, 1, 1], 32, 0),
    "mixed-decode-and-prefill": ([75, 33], [1, 12], 40, 1),
    "all-empty": ([20], [4], 16, 4),
}


def _run_twin(offload, case, chunk):
    return offload.stream_prefill_torch(
        case.q,
        case.kv_cache,
        case.indices,
        case.block_table,
        case.token_to_req,
        case.seq_lens,
        case.gate,
        case.requests,
        chunk_tokens=chunk,
        block_n=16,
    )


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("chunk", [1, 7, 16, 4096])
def test_streamed_prefill_matches_float64_reference(offload, name, chunk):
    seq_lens, query_lens, width, empty = CASES[name]
    case = make_case(
        seed=len(name) * 31 + chunk,
        seq_lens=seq_lens,
        query_lens=query_lens,
        width=width,
        empty_rows=empty,
    )
    ref = case.reference()
    out, held = _run_twin(offload, case, chunk)
    ok, worst = bf16_close(out, ref)
    assert ok, f"{name} chunk={chunk}: error {worst:.2f}x the bf16 bound"
    assert held == chunk  # one work buffer of the chunk size, however many chunks


def test_empty_rows_are_exact_zeros(offload):
    case = make_case(seed=5, seq_lens=[30], query_lens=[6], width=16, empty_rows=6)
    out, _ = _run_twin(offload, case, 8)
    assert torch.count_nonzero(out) == 0


def test_reference_is_sensitive_to_the_selection(offload):
    # Guard against a vacuous reference: dropping one selected row changes it.
    case = make_case(seed=9, seq_lens=[64], query_lens=[3], width=32)
    ref = case.reference()
    row = int(torch.argmax((case.indices[:, :-1] >= 0).sum(dim=1)))
    first = int(torch.nonzero(case.indices[row, :-1] >= 0)[0])
    case.indices[row, first] = -1
    out, _ = _run_twin(offload, case, 16)
    assert not bf16_close(out, ref)[0]


def test_patch_hunk_is_what_gnu_patch_creates(tmp_path):
    subprocess.run(["patch", "-p1", "-s", "-d", str(tmp_path), "-i", str(PATCH)], check=True)
    created = (tmp_path / TARGET).read_text()
    assert created == extract_new_file(PATCH.read_text())
    assert "import vllm" not in created and "from vllm" not in created


def test_module_imports_only_torch_and_triton(offload):
    import ast

    tree = ast.parse(extract_new_file(PATCH.read_text()))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    allowed = {
        "__future__",
        "collections",
        "functools",
        "mmap",
        "dataclasses",
        "types",
        "torch",
        "triton",
    }
    assert roots <= allowed, roots


def test_interpreted_triton_kernels_match_reference():
    """Runs checks/qsa/interpret_kernels.py under TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, str(HERE / "interpret_kernels.py")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if not v["ok"]}
    assert not failed, failed
    assert len(results) >= 10


class _Launch:
    """Stands in for a Triton kernel: records launches, runs nothing."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, tuple(grid), kwargs.get("MODE"), kwargs.get("INIT")))

        return launch


@pytest.mark.parametrize("by_dma", [False, True], ids=["sm-copy", "dma-copy"])
@pytest.mark.parametrize("chunk,contexts", [(8, [40, 23]), (1, [9]), (64, [40, 23])])
def test_prefill_host_loop_allocates_nothing_and_copies_each_chunk_once(
    offload, monkeypatch, chunk, contexts, by_dma
):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Factories(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.created = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if name.split(".")[0] in (
                "empty",
                "zeros",
                "ones",
                "full",
                "new_empty",
                "new_zeros",
                "cat",
                "clone",
                "_to_copy",
                "stack",
            ):
                self.created.append(name)
            return func(*args, **(kwargs or {}))

    log = []
    for name in (
        "_attend_kernel",
        "_copy_chunk_kernel",
        "_finalize_kernel",
        "_sanitize_selection_kernel",
    ):
        monkeypatch.setattr(offload, name, _Launch(name, log))
    case = make_case(seed=2, seq_lens=contexts, query_lens=[3] * len(contexts), width=16)
    ws = offload.OffloadWorkspace.allocate(
        max_rows=16,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=32,
        chunk_tokens=chunk,
        dtype=torch.bfloat16,
        selection_width=16,
        device="cpu",
    )
    out = torch.empty_like(case.q)
    kwargs = case.prefill_kwargs()
    host = {}
    if by_dma:  # read once per step, before the layers' passes
        host["host_kv"] = case.kv_cache
        host["host_rows"] = offload.read_host_block_rows(
            case.block_table,
            case.seq_lens,
            kwargs["requests"],
            max_context=kwargs["max_context"],
            page_size=case.kv_cache.shape[1],
        )
        dma = _Launch("qsa_offload_copy_chunk_host", log)
        monkeypatch.setattr(offload, "qsa_offload_copy_chunk_host", dma.__getitem__(()))
    with Factories() as rec:
        offload.qsa_offload_prefill(
            case.q,
            case.kv_cache,
            case.indices,
            case.block_table,
            case.token_to_req,
            case.seq_lens,
            case.gate,
            out,
            ws,
            **kwargs,
            **host,
        )
    assert rec.created == []
    by_kernel = [entry for entry in log if entry[0] == "_copy_chunk_kernel"]
    by_host = [entry for entry in log if entry[0] == "qsa_offload_copy_chunk_host"]
    if by_dma:
        # Host lengths: each request walks its own context only.
        assert not by_kernel
        copies = by_host
        assert len(copies) == sum(-(-n // chunk) for n in contexts)
    else:
        # Every request walks the batch's longest context (a host int); the
        # copy kernel stops at each request's own length on the device.
        assert not by_host
        copies = by_kernel
        assert len(copies) == len(contexts) * -(-max(contexts) // chunk)
    # One selection sort and one state init for all rows, one pass per chunk.
    assert sum(1 for e in log if e[0] == "_sanitize_selection_kernel") == 1
    attends = [entry for entry in log if entry[0] == "_attend_kernel"]
    assert [e[3] for e in attends].count(True) == 1
    assert len(attends) == 1 + len(copies)
    assert sum(1 for e in log if e[0] == "_finalize_kernel") == 1


def test_launcher_workspace_bytes_match_the_module(offload):
    """flashnext.plan.qsa_sizing reserves exactly what OffloadWorkspace allocates."""
    sys.path.insert(0, str(HERE.parents[1] / "launcher" / "src"))
    from flashnext.plan import qsa_sizing

    tiny = qsa_sizing.QsaShape(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        indexer_budget=13,
        indexer_compress_ratio=4,
    )
    for batched, seqs, chunk in ((64, 4, 8), (16, 32, 5)):
        expect = qsa_sizing.offload_workspace_bytes(
            tiny, max_num_batched_tokens=batched, max_num_seqs=seqs, chunk_tokens=chunk
        )
        rows = max(batched, seqs)
        width = qsa_sizing.selection_width(tiny)
        kw = {
            "max_rows": rows,
            "num_q_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 32,
            "chunk_tokens": chunk,
            "selection_width": width,
        }
        assert offload.OffloadWorkspace.nbytes_for(**kw) == expect
        ws = offload.OffloadWorkspace.allocate(dtype=torch.bfloat16, device="cpu", **kw)
        assert ws.nbytes() == expect


def test_host_block_rows_are_the_requests_lengths_and_reached_blocks(offload):
    """One read: each request's length and the block columns max_context reaches."""
    case = make_case(seed=6, seq_lens=[40, 23, 70], query_lens=[1, 1, 1], width=8)
    page = case.kv_cache.shape[1]
    rows = offload.read_host_block_rows(
        case.block_table, case.seq_lens, [2, 0], max_context=40, page_size=page
    )
    assert rows.lengths == {2: 70, 0: 40}
    assert rows.blocks == {r: case.block_table[r, :3].tolist() for r in (2, 0)}
    empty = offload.read_host_block_rows(
        case.block_table, case.seq_lens, [], max_context=40, page_size=page
    )
    assert empty.lengths == {} and empty.blocks == {}


@pytest.mark.parametrize("start,end", [(0, 16), (10, 37), (60, 80), (70, 90)])
def test_dma_chunk_copy_reads_block_runs_and_zeros_past_the_length(offload, start, end):
    """Rows come from the host arena through the block ids; past the length: zeros."""
    case = make_case(seed=7, seq_lens=[70], query_lens=[1], width=8, dtype=torch.float32)
    page = case.kv_cache.shape[1]
    rows = offload.read_host_block_rows(
        case.block_table, case.seq_lens, [0], max_context=90, page_size=page
    )
    work = torch.full((32, *case.kv_cache.shape[2:]), float("nan"))
    counter = torch.zeros(1, dtype=torch.int64)
    offload.qsa_offload_copy_chunk_host(
        case.kv_cache, rows, 0, start, end, work, byte_counter=counter
    )
    tokens = torch.arange(start, min(end, 70))
    expect = case.kv_cache[case.block_table[0, tokens // page].long(), tokens % page]
    got = work[: end - start]
    assert torch.equal(got[: tokens.numel()], expect)
    assert torch.count_nonzero(got[tokens.numel() :]) == 0
    assert torch.isnan(work[end - start :]).all()  # nothing past the chunk is written
    assert int(counter) == expect.numel() * expect.element_size()
