#!/usr/bin/env python3
"""The pinned vLLM's GDN spec-decode kernels, run on CPU by Triton's interpreter.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python checks/gpu/pp3/spec_gdn_cpu.py   (triton_cpu.py)

e3 saw MTP draft rows part at layer 0's GDN between PP=1 and PP=3 where the
verify rows' GDN metadata was equal (RESULTS.md, e3 item 6). A row that
reads state nothing wrote would do that: it holds whatever the slot held
before, which differs between engines. This runs the two kernels a verify
step takes (`causal_conv1d_update` with `num_accepted_tokens`, then
`fused_sigmoid_gating_delta_rule_update` on the spec state slots), as
`_forward_core` calls them, through a request's life: a prefill (the conv
kernel `causal_conv1d_fn`; the recurrent state put in its slot as
`_forward_core` does), then verify steps whose drafts are rejected or
accepted. Every state slot and conv column starts as NaN, so a read of
anything not written shows as NaN in a row. Each verify step's two rows
are held to the same kernels run over the accepted history as one plain
sequence from a zero state (no slots, no offsets).

Prints one JSON line: per layout and step, the largest difference of the
verified and the draft row from the plain run, and whether either is NaN;
and a control, the same life with every acceptance kept from the kernels,
which must part from the plain run (else the comparison could not see a
row that reads the wrong state).
The CPU test (test_pp3.py) runs it in the pinned vLLM env; the interpreter
runs the kernels' Python, so a kernel the GPU compiles is what is read here,
not a copy.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import triton_cpu

triton_cpu.enable()

from vllm.model_executor.layers.mamba.ops.causal_conv1d import (  # noqa: E402
    causal_conv1d_fn,
    causal_conv1d_update,
)
from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (  # noqa: E402
    fused_sigmoid_gating_delta_rule_update,
)
from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata  # noqa: E402

WIDTH, K = 4, 1  # the tiny model's conv kernel; MTP K=1 (one draft per verify)
DIM, HEADS, HEAD_DIM = 16, 2, 16
PROMPT, SLOTS = 7, 6
# Per verify step: was its draft accepted? Rejections first (every e3 draft
# was rejected), then acceptances, which shift the conv window and the slot.
ACCEPTED = (False, False, True, False, True, True, False)
I32 = torch.int32


def conv_metadata(seqlens: list[int]) -> SimpleNamespace:
    """causal_conv1d_fn's program map, as vLLM's GDN builder makes it."""
    qsl = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=I32)
    nums, batch_ptr, offsets = compute_causal_conv1d_metadata(qsl, device=torch.device("cpu"))
    return SimpleNamespace(nums_dict=nums, batch_ptr=batch_ptr, token_chunk_offset_ptr=offsets)


def conv_plain(w, b, rows: list[torch.Tensor]) -> torch.Tensor:
    x = torch.stack(rows, 1).contiguous()
    return causal_conv1d_fn(
        x, w, b, conv_states=torch.zeros(1, DIM, WIDTH - 1),
        query_start_loc=torch.tensor([0, len(rows)], dtype=I32),
        cache_indices=torch.tensor([0], dtype=I32), has_initial_state=torch.tensor([False]),
        activation="silu", null_block_id=-1, metadata=conv_metadata([len(rows)]),
    ).T  # fmt: skip


def conv_state_of(layout: str) -> torch.Tensor:
    """(slots, dim, width - 1 + K), as the cache holds it: dim-first, or
    token-first seen through a transpose (`_forward_core`'s two layouts)."""
    if layout == "dim_first":
        return torch.full((SLOTS, DIM, WIDTH - 1 + K), float("nan"))
    return torch.full((SLOTS, WIDTH - 1 + K, DIM), float("nan")).transpose(-1, -2)


def conv_life(layout: str, history, drafts, told_accepted: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(DIM, WIDTH, generator=g), torch.randn(DIM, generator=g)
    state, slot = conv_state_of(layout), 2
    x = torch.stack(history[:PROMPT], 1).contiguous()
    causal_conv1d_fn(
        x, w, b, conv_states=state, query_start_loc=torch.tensor([0, PROMPT], dtype=I32),
        cache_indices=torch.tensor([slot], dtype=I32), has_initial_state=torch.tensor([False]),
        activation="silu", metadata=conv_metadata([PROMPT]),
    )  # fmt: skip
    return step(
        lambda rows, accepted: causal_conv1d_update(
            torch.stack(rows).contiguous(),
            state,
            w,
            b,
            "silu",
            conv_state_indices=torch.tensor([slot], dtype=I32),
            num_accepted_tokens=torch.tensor([accepted], dtype=I32),
            query_start_loc=torch.tensor([0, 2], dtype=I32),
            max_query_len=1 + K,
        ),  # fmt: skip
        lambda rows: conv_plain(w, b, rows),
        history,
        drafts,
        told_accepted,
    )


def recurrent_inputs(n: int, g: torch.Generator) -> list[dict]:
    return [
        {
            "q": torch.randn(HEADS, HEAD_DIM, generator=g),
            "k": torch.randn(HEADS, HEAD_DIM, generator=g),
            "v": torch.randn(HEADS, HEAD_DIM, generator=g),
            "a": torch.randn(HEADS, generator=g),
            "b": torch.randn(HEADS, generator=g),
        }
        for _ in range(n)
    ]


def recurrent_life(history, drafts, told_accepted: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    a_log, dt_bias = torch.randn(HEADS, generator=g), torch.randn(HEADS, generator=g)

    def run(rows, **kw):
        def stack(name):
            return torch.stack([r[name] for r in rows])

        return fused_sigmoid_gating_delta_rule_update(
            A_log=a_log, a=stack("a"), b=stack("b"), dt_bias=dt_bias,
            q=stack("q")[None], k=stack("k")[None], v=stack("v")[None],
            cu_seqlens=torch.tensor([0, len(rows)], dtype=I32), use_qk_l2norm_in_kernel=True, **kw,
        )  # fmt: skip

    def plain(rows):
        zero = torch.zeros(1, HEADS, HEAD_DIM, HEAD_DIM)
        return run(rows, initial_state=zero, inplace_final_state=False)

    state = torch.full((SLOTS, HEADS, HEAD_DIM, HEAD_DIM), float("nan"))
    slots = torch.tensor([[3, 4]], dtype=I32)  # the request's 1 + K state slots
    # The prefill: its last state into the slot (`ssm_state[prefill_state_indices] = ...`).
    state[3] = plain(history[:PROMPT])[1][-1]
    return step(
        lambda rows, accepted: run(
            rows,
            initial_state=state,
            inplace_final_state=True,
            ssm_state_indices=slots,
            num_accepted_tokens=torch.tensor([accepted], dtype=I32),
        )[0][0],  # fmt: skip
        lambda rows: plain(rows)[0][0],
        history,
        drafts,
        told_accepted,
    )


def step(verify, plain, history, drafts, told_accepted: bool = True) -> list[dict]:
    """Verify steps over `history` (the target's tokens, in order) with one
    draft each: a rejected draft is `drafts[i]`, an accepted one is the next
    history token. Returns per step the verified and draft rows' largest
    difference from the plain run and whether either is NaN. told_accepted
    False: the kernels are told 1 accepted token every step (the control:
    bookkeeping that misses an acceptance must show)."""
    results, at, accepted_before = [], PROMPT, 1
    for i, accepted in enumerate(ACCEPTED):
        draft = history[at + 1] if accepted else drafts[i]
        out = verify([history[at], draft], accepted_before if told_accepted else 1)
        ref = plain(history[: at + 1] + [draft])
        results.append({
            "accepted_before": accepted_before,
            "verified": float((out[0] - ref[-2]).abs().max()),
            "draft": float((out[1] - ref[-1]).abs().max()),
            "nan": [bool(out[0].isnan().any()), bool(out[1].isnan().any())],
        })  # fmt: skip
        # Rejected: the target's token at at + 1 replaces the draft; accepted:
        # the draft stands and the bonus token follows it.
        at, accepted_before = (at + 2, 2) if accepted else (at + 1, 1)
    return results


def main() -> None:
    g = torch.Generator().manual_seed(0)
    n = PROMPT + 2 * len(ACCEPTED) + 1
    conv_history = [torch.randn(DIM, generator=g) for _ in range(n)]
    conv_drafts = [torch.randn(DIM, generator=g) for _ in ACCEPTED]
    rec_history, rec_drafts = recurrent_inputs(n, g), recurrent_inputs(len(ACCEPTED), g)
    result = {
        "accepted": list(ACCEPTED),
        "conv": {
            layout: conv_life(layout, conv_history, conv_drafts)
            for layout in ("dim_first", "token_first")
        },  # fmt: skip
        "recurrent": recurrent_life(rec_history, rec_drafts),
        "control": {
            "conv": conv_life("dim_first", conv_history, conv_drafts, told_accepted=False),
            "recurrent": recurrent_life(rec_history, rec_drafts, told_accepted=False),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
