"""Float64 reference of QSA sparse attention and random cases in vLLM's layout.

Semantics (vLLM 0.33.0 ``models/qwen4_exp/nvidia/ops/qsa.py``): query row r
attends, per query head h, over the tokens listed in the first ``count``
columns of its packed selection row (``count`` = the trailing column; -1
entries are padding), each mapped through ``block_table[token_to_req[r]]``
to a physical (block, offset) of the cache; softmax(q.k * head_dim**-0.5)
weighted V, rounded to the model dtype, times sigmoid(gate). A row with no
valid token outputs zeros. Only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def qsa_reference(q, kv_cache, indices, block_table, token_to_req, gate) -> torch.Tensor:
    """Float64 output [rows, q_heads, dim] (attention rounded to q.dtype, gated)."""
    rows, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    width = indices.shape[1] - 1
    out = torch.zeros(rows, num_q_heads, head_dim, dtype=torch.float64)
    for row in range(rows):
        count = min(max(int(indices[row, width]), 0), width)
        tokens = indices[row, :count].long()
        tokens = tokens[tokens >= 0]
        request = int(token_to_req[row])
        if tokens.numel() == 0 or not 0 <= request < block_table.shape[0]:
            continue
        blocks = block_table[request, tokens // block_size].long()
        if bool(((blocks < 0) | (blocks >= num_blocks)).any()):
            raise ValueError(f"row {row} selects a token without a block")
        rows_kv = kv_cache[blocks, tokens % block_size].double()  # [n, kv_heads, 2 * dim]
        for head in range(num_q_heads):
            keys = rows_kv[:, head // group, :head_dim]
            values = rows_kv[:, head // group, head_dim:]
            scores = (keys @ q[row, head].double()) * head_dim**-0.5
            attn = torch.softmax(scores, dim=0) @ values
            out[row, head] = attn.to(q.dtype).double() * torch.sigmoid(gate[row, head].double())
    return out


@dataclass
class Case:
    """One batch: caches, metadata and the host ints the prefill loop uses."""

    q: torch.Tensor
    gate: torch.Tensor
    kv_cache: torch.Tensor  # [blocks, B, kv_heads, 2 * dim]
    indices: torch.Tensor  # [rows, width + 1] int32, count in the last column
    block_table: torch.Tensor  # [requests, pages] int32
    token_to_req: torch.Tensor  # [rows] int32
    seq_lens: torch.Tensor  # [requests] int32
    requests: list[tuple[int, int, int, int]]  # (request, row_begin, row_end, context)

    def reference(self) -> torch.Tensor:
        """The float64 reference output for this case."""
        return qsa_reference(
            self.q, self.kv_cache, self.indices, self.block_table, self.token_to_req, self.gate
        )

    def prefill_kwargs(self) -> dict:
        """qsa_offload_prefill's host ints for all rows of the case."""
        return {
            "row_begin": self.requests[0][1],
            "row_end": self.requests[-1][2],
            "requests": [r for r, *_ in self.requests],
            "max_context": max(c for *_, c in self.requests),
        }


def make_case(
    *,
    seed: int,
    seq_lens: list[int],
    query_lens: list[int],
    width: int,
    block_size: int = 16,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    empty_rows: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Case:
    """Random prefill/decode batch: each request's last ``query_len`` tokens query
    a random causal subset (<= width) of their context, with -1 padding inside
    and after the counted columns; ``empty_rows`` rows select nothing."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3  # + null block 0 and spares
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), max(pages) + 1), -1, dtype=torch.int32)
    for req, n in enumerate(pages):
        table[req, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    kv_cache = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype)
    rows = sum(query_lens)
    indices = torch.full((rows, width + 1), -1, dtype=torch.int32)
    token_to_req = torch.empty(rows, dtype=torch.int32)
    requests = []
    row = 0
    for req, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        requests.append((req, row, row + q_len, seq_len))
        for i in range(q_len):
            position = seq_len - q_len + i
            token_to_req[row] = req
            visible = position + 1
            take = int(torch.randint(0, min(visible, width) + 1, (1,), generator=gen))
            chosen = torch.randperm(visible, generator=gen)[:take].to(torch.int32)
            pad = int(torch.randint(0, width - take + 1, (1,), generator=gen))
            columns = torch.cat([chosen, torch.full((pad,), -1, dtype=torch.int32)])
            columns = columns[torch.randperm(columns.numel(), generator=gen)]
            indices[row, : columns.numel()] = columns
            indices[row, width] = columns.numel()
            row += 1
    for r in torch.randperm(rows, generator=gen)[:empty_rows].tolist():
        indices[r, :width] = -1
        indices[r, width] = int(torch.randint(0, width + 1, (1,), generator=gen))
    q = torch.randn(rows, num_q_heads, head_dim, generator=gen).to(dtype)
    gate = (2 * torch.randn(rows, num_q_heads, head_dim, generator=gen)).to(dtype)
    return Case(
        q,
        gate,
        kv_cache,
        indices,
        table,
        token_to_req,
        torch.tensor(seq_lens, dtype=torch.int32),
        requests,
    )


def bf16_close(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Within bf16 bounds: |out - ref| <= 2**-6 * (|ref| + rms(ref)).

    The kernels round P to bf16 before the PV product (relative 2**-9 each),
    round the attention to bf16 (2**-9) and the gated output again (2**-9);
    2**-6 leaves a factor ~2 over their sum. The rms term covers outputs
    that cancel to near zero, where a relative bound means nothing.
    Returns (ok, worst error in units of the bound).
    """
    out64 = out.double().cpu()
    scale = ref.pow(2).mean().sqrt().item() if ref.numel() else 0.0
    bound = 2.0**-6 * (ref.abs() + scale) + 1e-30
    worst = ((out64 - ref).abs() / bound).max().item() if ref.numel() else 0.0
    return worst <= 1.0, worst
