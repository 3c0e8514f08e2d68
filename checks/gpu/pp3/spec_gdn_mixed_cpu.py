#!/usr/bin/env python3
"""MTP verify rows in steps that also prefill, through the pinned vLLM's own
GDN metadata builder and GDN `_forward_core`, on CPU (triton_cpu.py).

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python checks/gpu/pp3/spec_gdn_mixed_cpu.py

e3's draft rows parted only at batch 4 with long prompts, where verify
pairs share steps with other requests' prefill chunks (RESULTS.md, e3 item
6); at 100x4, where every verify step is pure, they were identical. In a
mixed step vLLM splits the batch: `GDNAttentionMetadataBuilder.build` gives
the spec rows their own indices, slots and accepted counts, and
`_forward_core` index-selects them, runs them through the spec kernels and
copies them back among the prefill rows. This runs a request life of three
requests as e3's 20000x4 had them: A verifies while B prefills two chunks
(the second with initial state) and D prefills, then A and D verify
together, with rejections and one acceptance. At every step each verify
request's two rows are held to the same request run alone in a pure verify
step from a copy of the same cache, so anything mixing does to a spec row
shows. Every slot and conv column starts as NaN.

The builder is vLLM's class with its configuration set by hand (MTP K=1,
no FULL graphs: a mixed step is never staged into them, no prefix caching);
`_forward_core` is vLLM's function on a stand-in holding the layer's
parameters. FLA's chunk prefill kernel cannot run in the interpreter;
FLA's recurrent kernel stands in for it, on prefill rows only, which are
not compared. fp16 throughout (triton_cpu.py: bf16 is not interpreted
faithfully).

Prints one JSON line: per step and verify request, the largest difference
of its verified and draft rows from the pure step, NaN flags and the
step's GDN counts; and a control, A's mixed step built with a wrong
accepted count, which must part.
"""

from __future__ import annotations

import copy
import json
import types
from types import SimpleNamespace

import torch
import triton_cpu

triton_cpu.enable()

import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402
from vllm.third_party.flash_linear_attention.ops.fused_recurrent import (  # noqa: E402
    fused_recurrent_gated_delta_rule,
)
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder  # noqa: E402

I32, HALF = torch.int32, torch.float16
HEADS, HEAD_DIM, WIDTH, K, SLOTS = 2, 16, 4, 1, 10
KEY_DIM = VALUE_DIM = HEADS * HEAD_DIM
CONV_DIM = 2 * KEY_DIM + VALUE_DIM
PREFIX = "model.layers.0.linear_attn"


def builder() -> GDNAttentionMetadataBuilder:
    b = object.__new__(GDNAttentionMetadataBuilder)
    b.__dict__.update(
        num_spec=K, use_spec_decode=True, use_full_cuda_graph=False,
        gdn_prefill_backend="triton", plan_flashinfer_checkpoints=False, kv_cache_spec=None,
        decode_cudagraph_max_bs=8,
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none")),
        checkpoint_builder=SimpleNamespace(build=lambda m, rows: None),  # align mode only
    )  # fmt: skip
    return b


def chunk_stand_in(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, **_):
    """FLA's recurrent kernel, per sequence, where the chunk kernel would run."""
    outs, finals, cu = [], [], cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        o, h = fused_recurrent_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e],
            initial_state=initial_state[i : i + 1].float(), inplace_final_state=False,
            cu_seqlens=torch.tensor([0, e - s], dtype=I32),
        )  # fmt: skip
        outs.append(o)
        finals.append(h[-1])
    return torch.cat(outs, 1), torch.stack(finals)


def layer(g: torch.Generator) -> SimpleNamespace:
    """What `_forward_core` reads of a QwenGatedDeltaNetAttention."""
    self = SimpleNamespace(
        prefix=PREFIX, enable_packed_recurrent_decode=False, activation="silu", tp_size=1,
        conv1d=SimpleNamespace(
            weight=(torch.randn(CONV_DIM, 1, WIDTH, generator=g) * 0.5).to(HALF),
            bias=(torch.randn(CONV_DIM, generator=g) * 0.1).to(HALF),
        ),
        A_log=torch.randn(HEADS, generator=g), dt_bias=torch.randn(HEADS, generator=g),
        num_k_heads=HEADS, num_v_heads=HEADS, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        key_dim=KEY_DIM, value_dim=VALUE_DIM, chunk_gated_delta_rule=chunk_stand_in,
    )  # fmt: skip
    cls = gdn.QwenGatedDeltaNetAttention
    self.rearrange_mixed_qkv = types.MethodType(cls.rearrange_mixed_qkv, self)
    self.forward_core = types.MethodType(cls._forward_core, self)
    return self


def fresh_cache() -> list[torch.Tensor]:
    state_len = WIDTH - 1 + K
    shape = (
        (SLOTS, CONV_DIM, state_len) if is_conv_state_dim_first() else (SLOTS, state_len, CONV_DIM)
    )
    return [
        torch.full(shape, float("nan"), dtype=HALF),
        torch.full((SLOTS, HEADS, HEAD_DIM, HEAD_DIM), float("nan")),
    ]


def tokens(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "qkv": torch.randn(n, CONV_DIM, generator=g).to(HALF),
        "a": torch.randn(n, HEADS, generator=g).to(HALF),
        "b": torch.randn(n, HEADS, generator=g).to(HALF),
    }


def run_step(gdn_layer, build, cache, reqs: list[dict]) -> tuple[list[torch.Tensor], object]:
    """One step of `reqs` (each: its rows, tokens computed before, state
    slots, spec or not, accepted count): the builder's metadata from the
    batch as the runner lays it out, then `_forward_core`. Returns each
    request's output rows and the metadata."""
    qlens = [len(r["qkv"]) for r in reqs]
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=I32)
    seq_lens = torch.tensor(
        [r["computed"] + n for r, n in zip(reqs, qlens, strict=True)], dtype=I32
    )
    n = int(qsl[-1])
    m = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens,
        num_reqs=len(reqs), num_actual_tokens=n, max_query_len=max(qlens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=torch.tensor(
            [r["slots"] + [0] * (1 + K - len(r["slots"])) for r in reqs], dtype=I32
        ),
        slot_mapping=torch.zeros(n, dtype=torch.int64), seq_lens_cpu_upper_bound=seq_lens.clone(),
        is_prefilling=torch.tensor([not r["spec"] and r["computed"] == 0 for r in reqs]),
    )  # fmt: skip
    meta = build.build(
        0, m,
        num_accepted_tokens=torch.tensor([r.get("accepted", 1) for r in reqs], dtype=I32),
        num_decode_draft_tokens_cpu=torch.tensor([K if r["spec"] else -1 for r in reqs], dtype=I32),
    )  # fmt: skip
    gdn_layer.kv_cache = cache
    out = torch.zeros(n, HEADS, HEAD_DIM, dtype=HALF)
    # _forward_core reads its metadata from the forward context, by layer prefix.
    gdn.get_forward_context = lambda: SimpleNamespace(attn_metadata={PREFIX: meta})

    def cat(name):
        return torch.cat([r[name] for r in reqs]).clone()

    gdn_layer.forward_core(cat("qkv"), cat("b"), cat("a"), out)
    bounds = qsl.tolist()
    return [out[bounds[i] : bounds[i + 1]].clone() for i in range(len(reqs))], meta


def life(wrong_accepted_in_a_mixed_step: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    gdn_layer, build, cache = layer(g), builder(), fresh_cache()

    def req(name, rows, computed, slots, spec, accepted=1):
        return dict(rows, name=name, computed=computed, slots=slots, spec=spec, accepted=accepted)

    def verify(name, computed, slots, accepted=1):
        return req(name, tokens(2, g), computed, slots, True, accepted)

    b_prompt = tokens(23, g)
    b_first = {k: v[:11] for k, v in b_prompt.items()}
    b_rest = {k: v[11:] for k, v in b_prompt.items()}
    steps = [
        [req("A", tokens(9, g), 0, [3], False)],
        [verify("A", 9, [3, 4]), req("B", b_first, 0, [5], False)],
        [req("B", b_rest, 11, [5], False), verify("A", 10, [3, 4])],
        # A's draft of the last step accepted: 2 tokens computed past it, its slot 1 read.
        [verify("A", 12, [3, 4], accepted=2), req("D", tokens(5, g), 0, [6], False)],
        [verify("A", 13, [3, 4]), verify("D", 5, [6, 7])],
        [verify("D", 6, [6, 7]), req("C", tokens(13, g), 0, [8], False)],
    ]
    results = []
    for number, reqs in enumerate(steps, 1):
        pure = {
            r["name"]: run_step(gdn_layer, build, copy.deepcopy(cache), [r])[0][0]
            for r in reqs
            if r["spec"]
        }
        if wrong_accepted_in_a_mixed_step and number == 2:
            reqs = [dict(r, accepted=2) if r["name"] == "A" else r for r in reqs]
        rows, meta = run_step(gdn_layer, build, cache, reqs)
        for r, out in zip(reqs, rows, strict=True):
            if not r["spec"]:
                continue
            ref = pure[r["name"]].float()
            results.append({
                "step": number,
                "request": r["name"],
                "prefills": meta.num_prefills,
                "spec_decodes": meta.num_spec_decodes,
                "verified": float((out[0].float() - ref[0]).abs().max()),
                "draft": float((out[1].float() - ref[1]).abs().max()),
                "row_mean": float(ref.abs().mean()),
                "nan": [bool(out[0].isnan().any()), bool(out[1].isnan().any())],
            })  # fmt: skip
    return results


def main() -> None:
    print(json.dumps({"life": life(), "control": life(wrong_accepted_in_a_mixed_step=True)}))


if __name__ == "__main__":
    main()
