#!/usr/bin/env python3
"""One QSA layer on CPU: vLLM's VRAM path, our offload and float64, row by row.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python checks/gpu/pp3/qsa_float64_cpu.py
        [--tokens N] [--decode N] [--budget N] [--page N] [--chunk N] [--seed N] [--json]

Issue 42 item 1: on the GPU the offload parts from vLLM's own QSA at layer
3's QSA from position 25-32 of every prompt. This builds one QSA layer's
inputs at the tiny checkpoint's shapes (4 query heads over 2 KV heads of 64,
an indexer of 4 heads of 64, groups of 4, `checks/gpu/tiny/tiny_model.py`)
for one request of N tokens in a paged cache, selects each row's keys with
vLLM's own indexer kernels, and runs, by Triton's interpreter
(`triton_cpu.py`), over the same selection buffer:

- (a) vLLM's VRAM QSA (`ops/qsa.py` `qsa_sparse_paged_attention`) with the
  config table an H100/H200 takes (`_select_sm90_config`);
- (b) our offload (`ops/qsa_offload.py`, patch 0021) as the layer (0022)
  calls it: `qsa_offload_prefill` with the arena's host rows for the prompt,
  `qsa_offload_decode` for the last `--decode` positions, each run as a
  one-row decode step (as the GPU run's new tokens were);
- (a1) the VRAM kernel with its split-K width forced to 1, and (b8) the
  offload's prefill widened to (a)'s split count (the diagnosis: before
  0021 took each tile's P against the tile's own maximum, (a1) was (b));
- the same selection with each row's keys in another order, through (a),
  (a1) and (b): which rows move;
- a control: (b) with each row's last key dropped;
- (c) float64: the indexer's scores, its top-k and the attention over the
  selected keys, written here from the model's definition, not from either
  kernel.

The one kernel that cannot run here is the indexer's top-k
(`torch.ops._C.persistent_topk` / `cooperative_topk`: CUDA C++). It is
restated in torch (`topk_restated`): a row with no more visible groups than
the budget gets every group in ascending order (persistent_topk's path for a
row not longer than k writes the indices directly), a longer row its top-k
by score, highest first (the CUDA op's order there is its own; an order
changes only which columns share a tile in (a); (b)'s prefill sorts).

Prints a per-row table (position, kind, the relative error of (a), (b) and
(a1) against (c) as compare.py measures rows: max and mean |diff| over the
row's mean |c|; whether (a) and (b) are bit-identical; whether another order
moves (a) and (b)), then the summary; `--json` prints one JSON object
instead. 40 tokens take about a minute on two cores, 128 about three.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import contextmanager

import torch
import triton_cpu

# The tiny checkpoint's QSA (checks/gpu/tiny/tiny_model.py).
Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
INDEX_HEADS, INDEX_DIM, RATIO, BUDGET = 4, 64, 4, 2048
I32, BF16 = torch.int32, torch.bfloat16


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--decode", type=int, default=2, help="last positions run as decode rows")
    p.add_argument("--budget", type=int, default=BUDGET, help="indexer budget in tokens")
    p.add_argument("--page", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--chunk", type=int, default=1024, help="offload prefill chunk tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    a = p.parse_args(argv)
    problems = []
    if a.tokens < 2:
        problems.append(f"--tokens {a.tokens}: give at least 2")
    if not 0 <= a.decode <= a.tokens:
        problems.append(f"--decode {a.decode}: give 0 to --tokens ({a.tokens})")
    if a.budget < RATIO or a.budget % RATIO:
        problems.append(f"--budget {a.budget}: give a positive multiple of {RATIO}")
    for name in ("page", "chunk"):
        if getattr(a, name) < 1:
            problems.append(f"--{name} {getattr(a, name)}: give a positive number")
    if problems:
        p.exit(2, "qsa_float64_cpu: " + "; ".join(problems) + "\n")
    return a


# ---------------------------------------------------------------- inputs


def layer_inputs(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """One request's QSA inputs in bf16, as the layer holds them: Q and K
    RMS-normed (unit RMS rows), V and the gate of unit scale, the indexer's
    Q and one compressed key per complete group of RATIO tokens."""
    g = torch.Generator().manual_seed(seed)

    def unit_rms(*shape):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(BF16)

    return {
        "q": unit_rms(tokens, Q_HEADS, HEAD_DIM),
        "k": unit_rms(tokens, KV_HEADS, HEAD_DIM),
        "v": torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g).to(BF16),
        "gate": torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g).to(BF16),
        "index_q": unit_rms(tokens, INDEX_HEADS, INDEX_DIM),
        "index_k": unit_rms(max(tokens // RATIO, 1), INDEX_DIM),
    }


def paged(rows: torch.Tensor, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, ...] in a paged pool [blocks, page, ...] whose blocks are
    shuffled and padded with two unused ones; unused slots are NaN, so a
    read of anything not written shows. Returns (pool, block_table[1, w])."""
    pages = -(-rows.shape[0] // page)
    order = torch.randperm(pages + 2, generator=torch.Generator().manual_seed(seed + 1))
    pool = torch.full((pages + 2, page, *rows.shape[1:]), float("nan"), dtype=rows.dtype)
    for t in range(rows.shape[0]):
        pool[order[t // page], t % page] = rows[t]
    return pool, order[:pages].to(I32)[None]


# ---------------------------------------------------------------- vLLM's side


def topk_restated(logits, visible_blocks, token_topk, compress_ratio, block_indices, _ws):
    """ops/qsa_indexer.py `_topk`, whose CUDA op cannot run here (module doc)."""
    k = token_topk // compress_ratio
    block_indices.fill_(-1)
    for row, n in enumerate(visible_blocks.tolist()):
        if n <= k:
            block_indices[row, :n] = torch.arange(n, dtype=I32)
        else:
            block_indices[row] = logits[row, :n].topk(k).indices.to(I32)


@contextmanager
def sm90(vq, splits: int | None = None):
    """ops/qsa.py's config table as on an H100/H200; `splits` forces the width."""
    saved = vq._is_sm90, vq._is_sm120, vq._is_sm80, vq._select_config
    vq._is_sm90, vq._is_sm120, vq._is_sm80 = (lambda: True), (lambda: False), (lambda: False)
    if splits is not None:
        table = saved[3]

        def forced(*args, **kwargs):
            block_n, warps, tiles, _ = table(*args, **kwargs)
            return block_n, warps, tiles, splits

        vq._select_config = forced
    try:
        yield
    finally:
        vq._is_sm90, vq._is_sm120, vq._is_sm80, vq._select_config = saved


def select(x: dict, args, ix, decode_rows: list[int]) -> torch.Tensor:
    """The packed selection buffer [tokens, budget + RATIO - 1 + 1] from vLLM's
    indexer kernels: prefill scoring for the prompt rows, decode scoring for
    the rows run as decode steps, then the expand kernel."""
    n = args.tokens
    index_cache, index_table = paged(x["index_k"][:, None, :], args.page, args.seed + 7)
    width = -(-max(-(-n // RATIO), 64) // args.page) * args.page
    table = torch.zeros(1, width // args.page, dtype=I32)
    table[0, : index_table.shape[1]] = index_table[0]
    positions = torch.arange(n, dtype=I32)
    visible = (positions + 1) // RATIO
    blocks = torch.empty(n, args.budget // RATIO, dtype=I32)
    ix._topk = topk_restated
    ix.qsa_select_paged_prefill(
        x["index_q"], index_cache, table, torch.tensor([0, n], dtype=I32), visible,
        args.budget, RATIO, n, blocks, n,
    )  # fmt: skip
    for row in decode_rows:
        ix.qsa_select_paged_decode(
            x["index_q"][row : row + 1], index_cache, table, visible[row : row + 1],
            args.budget, RATIO, 1, blocks[row : row + 1],
        )  # fmt: skip
    packed = torch.empty(n, args.budget + RATIO, dtype=I32)
    ix.expand_qsa_block_indices(blocks, positions, visible, RATIO, args.budget, packed)
    return packed


def vram(vq, x, pool, table, selection, rows: slice, prefill: bool, splits=None):
    """(a): forward_qsa's VRAM branch (nvidia/qsa.py) for these rows."""
    q = x["q"][rows].contiguous()
    out = torch.zeros_like(q)
    key_cache, value_cache = pool.transpose(1, 2).split(HEAD_DIM, dim=-1)
    with sm90(vq, splits):
        vq.qsa_sparse_paged_attention(
            q, key_cache, value_cache, selection[rows].contiguous(), table,
            torch.zeros(q.shape[0], dtype=I32), prefill, out,
            output_gate=x["gate"][rows].reshape(q.shape[0], -1).contiguous(),
        )  # fmt: skip
    return out


@contextmanager
def offload_split(qo, splits: int):
    """The diagnosis (b8): qsa_offload_prefill with its one running state per
    row (`state(1, ...)`, `splits=1`) widened to `splits` split-K states, the
    kernels' own NUM_SPLITS; finalize merges them. Nothing else changes."""
    attend, state = qo._attend, qo.OffloadWorkspace.state

    def split_attend(*a, **kw):
        return attend(*a, **(kw | {"splits": splits} if kw["mode"] == qo.MODE_CHUNK else kw))

    def split_state(self, n, *rest):
        return state(self, splits if n == 1 else n, *rest)

    qo._attend, qo.OffloadWorkspace.state = split_attend, split_state
    try:
        yield
    finally:
        qo._attend, qo.OffloadWorkspace.state = attend, state


def offload_prefill(qo, x, arena, table, selection, args, splits: int = 1) -> torch.Tensor:
    """(b) for the prompt rows: _forward_offloaded's prefill branch (0022)."""
    n = args.tokens
    q, gate = x["q"], x["gate"]
    out = torch.zeros_like(q)
    workspace = workspace_for(qo, args, rows=n * splits)
    seq_lens = torch.tensor([n], dtype=I32)
    host_rows = qo.read_host_block_rows(table, seq_lens, range(1), max_context=n,
                                        page_size=arena.shape[1])  # fmt: skip
    qo.qsa_offload_prefill(
        q, arena, selection, table, torch.zeros(n, dtype=I32), seq_lens, gate, out,
        workspace, row_begin=0, row_end=n, requests=range(1), max_context=n,
        host_kv=arena, host_rows=host_rows,
    )  # fmt: skip
    return out


def offload_decode(qo, x, arena, table, selection, row: int, args) -> torch.Tensor:
    """(b) for one decode row: _forward_offloaded's decode branch (0022)."""
    q = x["q"][row : row + 1].contiguous()
    out = torch.zeros_like(q)
    workspace = workspace_for(qo, args)
    capacity = workspace.row_sum.numel() // Q_HEADS
    qo.qsa_offload_decode(
        q, arena[..., :HEAD_DIM], arena[..., HEAD_DIM:], selection[row : row + 1].contiguous(),
        table, torch.zeros(1, dtype=I32), x["gate"][row : row + 1].contiguous(), out,
        workspace, splits=qo.decode_splits(1, capacity, 16),
    )  # fmt: skip
    return out


def workspace_for(qo, args, rows: int | None = None):
    return qo.OffloadWorkspace.allocate(
        max_rows=rows or args.tokens, num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        chunk_tokens=args.chunk, dtype=BF16, device="cpu", selection_width=args.budget + RATIO - 1,
    )  # fmt: skip


# ---------------------------------------------------------------- float64


def reference(x: dict, budget: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(c): the layer's math in float64 from the bf16 inputs. Each row scores
    the complete groups before it (sum over indexer heads of relu(q . k)),
    keeps all of them or the top budget/RATIO, adds its open group's tokens
    up to itself, and attends over those keys (scale 1/sqrt(head_dim)); the
    output is gated by sigmoid(gate). Returns (out, each row's tokens)."""
    f = {k: v.double() for k, v in x.items()}
    n = f["q"].shape[0]
    out = torch.zeros(n, Q_HEADS, HEAD_DIM, dtype=torch.float64)
    chosen = []
    group = Q_HEADS // KV_HEADS
    for t in range(n):
        visible = (t + 1) // RATIO
        scores = torch.relu(f["index_q"][t] @ f["index_k"][:visible].T).sum(0)
        keep = budget // RATIO
        groups = range(visible) if visible <= keep else scores.topk(keep).indices.tolist()
        tokens = sorted(
            [g * RATIO + i for g in groups for i in range(RATIO)]
            + list(range(visible * RATIO, t + 1))
        )
        chosen.append(tokens)
        for h in range(Q_HEADS):
            keys, values = f["k"][tokens, h // group], f["v"][tokens, h // group]
            p = torch.softmax(f["q"][t, h] @ keys.T / HEAD_DIM**0.5, dim=0)
            out[t, h] = (p @ values) * torch.sigmoid(f["gate"][t, h])
    return out, chosen


# ---------------------------------------------------------------- comparison


def row_errors(x: torch.Tensor, ref: torch.Tensor) -> tuple[list[float], list[float]]:
    """compare.py's row measure: max and mean |x - ref| over the row's mean |ref|."""
    diff = (x.double() - ref).abs().flatten(1)
    scale = ref.abs().flatten(1).mean(1).clamp_min(1e-12)
    return (diff.max(1).values / scale).tolist(), (diff.mean(1) / scale).tolist()


def shuffled(selection: torch.Tensor, budget: int, seed: int) -> torch.Tensor:
    """The same selection, each row's tokens in another order (the set kept):
    what a top-k whose output order is not fixed hands the attention."""
    g = torch.Generator().manual_seed(seed + 3)
    out = selection.clone()
    width = budget + RATIO - 1
    for row in out:
        count = int(row[width])
        row[:count] = row[:count][torch.randperm(count, generator=g)]
    return out


def last_dropped(selection: torch.Tensor, budget: int) -> torch.Tensor:
    """The control: each row's last selected key left out (a causal mask one
    short), so the comparison must see an offload that attends wrong keys."""
    out = selection.clone()
    out[:, budget + RATIO - 1] = (out[:, budget + RATIO - 1] - 1).clamp_min(0)
    return out


def selected_tokens(selection: torch.Tensor, budget: int) -> list[list[int]]:
    width = budget + RATIO - 1
    return [sorted(r[: int(r[width])].tolist()) for r in selection]


def run(args) -> dict:
    triton_cpu.enable()
    import vllm.models.qwen4_exp.nvidia.ops.qsa as vq
    import vllm.models.qwen4_exp.nvidia.ops.qsa_indexer as ix
    import vllm.models.qwen4_exp.nvidia.ops.qsa_offload as qo

    n = args.tokens
    decode_rows = list(range(n - args.decode, n))
    x = layer_inputs(n, args.seed)
    kv = torch.cat([x["k"], x["v"]], dim=-1)  # [tokens, kv_heads, 2 * head_dim]
    arena, table = paged(kv, args.page, args.seed)  # the host arena's layout
    pool = arena.transpose(1, 2).contiguous()  # the VRAM cache's [blocks, kv_heads, B, 2D]
    selection = select(x, args, ix, decode_rows)
    ref, chosen = reference(x, args.budget)

    other_order = shuffled(selection, args.budget, args.seed)
    prompt = slice(0, n)
    a = vram(vq, x, pool, table, selection, prompt, True)
    a1 = vram(vq, x, pool, table, selection, prompt, True, splits=1)
    b = offload_prefill(qo, x, arena, table, selection, args)
    a_moved = vram(vq, x, pool, table, other_order, prompt, True)
    a1_moved = vram(vq, x, pool, table, other_order, prompt, True, splits=1)
    b_moved = offload_prefill(qo, x, arena, table, other_order, args)
    vram_splits = vram_config(vq, n)["prefill"]["num_splits"]
    with offload_split(qo, vram_splits):
        b8 = offload_prefill(qo, x, arena, table, selection, args, splits=vram_splits)
    control = offload_prefill(qo, x, arena, table, last_dropped(selection, args.budget), args)
    # The decode rows, one step each: vLLM's decode config, our decode kernel.
    a_dec, a1_dec, b_dec = a.clone(), a1.clone(), b.clone()
    a_dec_moved, b_dec_moved = a_moved.clone(), b_moved.clone()
    for row in decode_rows:
        one = slice(row, row + 1)
        a_dec[row] = vram(vq, x, pool, table, selection, one, False)[0]
        a1_dec[row] = vram(vq, x, pool, table, selection, one, False, splits=1)[0]
        b_dec[row] = offload_decode(qo, x, arena, table, selection, row, args)[0]
        a_dec_moved[row] = vram(vq, x, pool, table, other_order, one, False)[0]
        b_dec_moved[row] = offload_decode(qo, x, arena, table, other_order, row, args)[0]

    floor = ref.to(BF16)  # the bf16 output's own rounding: no kernel gets below it
    control_mean = row_errors(control, ref)[1]
    rows = []
    runs = {
        "prefill": (a, a1, b, a_moved, a1_moved, b_moved, b8),
        "decode": (a_dec, a1_dec, b_dec, a_dec_moved, None, b_dec_moved, None),
    }
    for kind, (va, va1, vb, va_moved, va1_moved, vb_moved, vb8) in runs.items():
        positions = range(n) if kind == "prefill" else decode_rows
        paths = {"vram": va, "vram_1split": va1, "offload": vb, "offload_split": vb8,
                 "bf16_floor": floor}  # fmt: skip
        errs = {k: row_errors(v, ref) for k, v in paths.items() if v is not None}
        for t in positions:
            rows.append({
                "position": t, "kind": kind,
                "keys": len(chosen[t]),
                **{f"{k}_max_rel": e[0][t] for k, e in errs.items()},
                **{f"{k}_mean_rel": e[1][t] for k, e in errs.items()},
                "identical": bool(torch.equal(va[t], vb[t])),
                "identical_1split": bool(torch.equal(va1[t], vb[t])),
                **({"identical_split": bool(torch.equal(va[t], vb8[t]))}
                   if vb8 is not None else {}),
                "vram_moved_by_order": not torch.equal(va[t], va_moved[t]),
                "offload_moved_by_order": not torch.equal(vb[t], vb_moved[t]),
                **({"vram_1split_moved_by_order": not torch.equal(va1[t], va1_moved[t])}
                   if va1_moved is not None else {}),
            })  # fmt: skip
    picked = selected_tokens(selection, args.budget)
    return {
        "tokens": n, "decode_rows": decode_rows, "budget": args.budget, "page": args.page,
        "chunk": args.chunk, "seed": args.seed,
        "shapes": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                   "index_heads": INDEX_HEADS, "index_dim": INDEX_DIM, "ratio": RATIO},
        "vram_config": vram_config(vq, n),
        "selection_equal_rows": sum(p == c for p, c in zip(picked, chosen, strict=True)),
        "nan": {k: bool(v.isnan().any()) for k, v in (("vram", a_dec), ("offload", b_dec))},
        "rows": rows,
        "summary": summarize(rows),
        # Rows 0 and 1 are left out: one key is all the float64 row attends,
        # or all the control keeps (softmax of one key equals that of two alike).
        "control_last_key_dropped": {
            "min_mean_rel": min(control_mean[2:]) if n > 2 else None,
            "avg_mean_rel": sum(control_mean) / n,
        },
    }  # fmt: skip


def vram_config(vq, n: int) -> dict:
    with sm90(vq):
        prefill = vq._select_config(n, KV_HEADS, True, BUDGET + RATIO - 1)
        decode = vq._select_config(1, KV_HEADS, False, BUDGET + RATIO - 1)
    names = ("block_n", "num_warps", "num_tiles", "num_splits")
    return {
        "prefill": dict(zip(names, prefill, strict=True)),
        "decode": dict(zip(names, decode, strict=True)),
    }


def summarize(rows: list[dict]) -> dict:
    out = {}
    for kind in ("prefill", "decode"):
        these = [r for r in rows if r["kind"] == kind]
        if not these:
            continue
        s = {"rows": len(these)}
        for k in ("vram", "vram_1split", "offload", "offload_split", "bf16_floor"):
            if f"{k}_mean_rel" not in these[0]:
                continue
            s[f"{k}_worst_max_rel"] = max(r[f"{k}_max_rel"] for r in these)
            s[f"{k}_worst_mean_rel"] = max(r[f"{k}_mean_rel"] for r in these)
            s[f"{k}_avg_mean_rel"] = sum(r[f"{k}_mean_rel"] for r in these) / len(these)
        parted = [r["position"] for r in these if not r["identical"]]
        s["identical_rows"] = len(these) - len(parted)
        s["first_parting"] = min(parted) if parted else None
        s["identical_rows_1split"] = sum(r["identical_1split"] for r in these)
        s["offload_further_rows"] = sum(r["offload_mean_rel"] > r["vram_mean_rel"] for r in these)
        s["offload_closer_rows"] = sum(r["offload_mean_rel"] < r["vram_mean_rel"] for r in these)
        if "offload_split_mean_rel" in these[0]:
            s["offload_split_further_rows"] = sum(
                r["offload_split_mean_rel"] > r["vram_mean_rel"] for r in these
            )
            s["offload_split_identical_rows"] = sum(r["identical_split"] for r in these)
            s["vram_1split_moved_by_order_rows"] = sum(
                r["vram_1split_moved_by_order"] for r in these
            )
        for k in ("vram", "offload"):
            s[f"{k}_moved_by_order_rows"] = sum(r[f"{k}_moved_by_order"] for r in these)
        out[kind] = s
    return out


PATHS = (
    ("vram", "(a) vLLM's VRAM QSA"),
    ("offload", "(b) our offload"),
    ("vram_1split", "(a1) VRAM kernel, 1 split"),
    ("offload_split", "(b8) offload prefill, VRAM's splits"),
    ("bf16_floor", "float64 rounded to bf16"),
)


def table(r: dict) -> str:
    cfg = r["vram_config"]
    lines = [
        f"One QSA layer, {r['tokens']} tokens (decode rows {r['decode_rows']}), budget "
        f"{r['budget']}, page {r['page']}, seed {r['seed']}; VRAM config on sm_90: prefill "
        f"block_n {cfg['prefill']['block_n']} x {cfg['prefill']['num_splits']} splits, decode "
        f"block_n {cfg['decode']['block_n']} x {cfg['decode']['num_splits']} splits",
        "row error against float64: max and mean |diff| over the row's mean |float64|",
        f"{'pos':>4} {'kind':7} {'keys':>4}  {'(a) max':>8} {'mean':>8}  {'(b) max':>8} "
        f"{'mean':>8}  {'(a1) mean':>9}  {'floor':>8}  a==b  order moves a/b",
    ]  # fmt: skip
    yes = {True: "yes", False: "no"}
    for x in r["rows"]:
        lines.append(
            f"{x['position']:4d} {x['kind']:7} {x['keys']:4d}  {x['vram_max_rel']:8.2e} "
            f"{x['vram_mean_rel']:8.2e}  {x['offload_max_rel']:8.2e} {x['offload_mean_rel']:8.2e}  "
            f"{x['vram_1split_mean_rel']:9.2e}  {x['bf16_floor_mean_rel']:8.2e}  "
            f"{yes[x['identical']]:4}  {yes[x['vram_moved_by_order']]}/"
            f"{yes[x['offload_moved_by_order']]}"
        )  # fmt: skip
    for kind, s in r["summary"].items():
        lines += ["", f"{kind} ({s['rows']} rows)   avg mean   worst mean  worst max"]
        for key, name in PATHS:
            if f"{key}_avg_mean_rel" in s:
                lines.append(
                    f"  {name:38} {s[f'{key}_avg_mean_rel']:9.2e}  "
                    f"{s[f'{key}_worst_mean_rel']:9.2e}  {s[f'{key}_worst_max_rel']:9.2e}"
                )
        lines.append(
            f"  (a) == (b) in {s['identical_rows']} rows, first parting at {s['first_parting']}; "
            f"(a1) == (b) in {s['identical_rows_1split']}; (b) further from float64 than (a) "
            f"in {s['offload_further_rows']} rows, closer in {s['offload_closer_rows']}"
        )
        if "offload_split_identical_rows" in s:
            lines.append(
                f"  (b8) == (a) in {s['offload_split_identical_rows']} rows; the same keys in "
                f"another order move (a) in {s['vram_moved_by_order_rows']} rows, (a1) in "
                f"{s['vram_1split_moved_by_order_rows']}, (b) in {s['offload_moved_by_order_rows']}"
            )
        else:
            lines.append(
                f"  the same keys in another order move (a) in {s['vram_moved_by_order_rows']} "
                f"rows, (b) in {s['offload_moved_by_order_rows']}"
            )
    c = r["control_last_key_dropped"]
    lines += [
        "",
        f"selection equal to float64's in {r['selection_equal_rows']} of {r['tokens']} rows; "
        f"NaN in (a) {r['nan']['vram']}, (b) {r['nan']['offload']}",
        f"control, (b) with each row's last key dropped: mean rel avg {c['avg_mean_rel']:.2e}, "
        f"least {c['min_mean_rel']:.2e} (rows 2 on)",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse(argv)
    r = run(args)
    print(json.dumps(r) if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
