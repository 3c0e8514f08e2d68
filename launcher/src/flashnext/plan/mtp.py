"""Does the checkpoint's MTP drafter fit on the last PP rank? (issue 16)

Under PP the drafter runs on the last rank only (patch 0030 builds it there
and nowhere else). What it adds to that rank:
- its decoder layer as the checkpoint stores it: one QSA layer whose 512
  routed experts ship in BF16 (4.69 GiB), or INT4 g128 once `flashnext
  checkpoint mtp-int4` has rewritten them (half a byte per weight plus one
  BF16 scale per 128: about 1.2 GiB);
- fc_embedding, fc_hidden, its norms and its HC mixer;
- its own embed_tokens, vocab x hidden in BF16: under PP>1 vLLM does not
  share the target's (`spec_decode/eagle/utils.py maybe_share_target_embed`),
  and the target's sits on rank 0 anyway;
- the K/V of its QSA layer in VRAM, for every token of every sequence:
  patch 0022 offloads the target's QSA layers only.

`fit_mtp` compares that with the rank's headroom and says, when it does not
fit, by how much and what is missing; `max_context_tokens` is how many
tokens of drafter K/V the headroom left after the weights would hold. What
the drafter would gain, fit or not, is plan/mtp_projection.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashnext.plan.mtp_projection import MtpProjection
from flashnext.plan.qsa_sizing import QsaShape, kv_bytes_per_token
from flashnext.units import gib

MTP_PREFIX = "mtp."
ROUTED = ".mlp.experts."
LM_HEAD_PREFIX = "lm_head."
GROUP = 128  # INT4 g128, the scheme the target's experts use
BF16_BYTES = 2


@dataclass(frozen=True)
class MtpNeeds:
    layer_bytes: int
    """The MTP decoder layer(s) as stored, routed experts included."""
    routed_expert_bytes: int
    """Of layer_bytes: the routed experts, as stored."""
    experts_bf16: bool
    """The routed experts are stored as plain BF16 `weight`s (as shipped), not INT4."""
    other_bytes: int
    """fc_embedding, fc_hidden, norms, the HC mixer."""
    embed_bytes: int
    """The drafter's own embed_tokens under PP>1 (BF16)."""
    kv_bytes_per_token: int
    """VRAM per token of context for the drafter's QSA layer (K/V + pooled key)."""


@dataclass(frozen=True)
class MtpFit:
    fits: bool
    rank: int
    placed_bytes: dict[str, int]
    """What the drafter puts on `rank`, by part (kv for `tokens` tokens)."""
    headroom_bytes: int
    tokens: int
    max_context_tokens: int
    reason: str
    projection: MtpProjection | None = None
    """What it would gain in single-stream decode, on paper (None: no MTP tensors)."""

    def to_json(self) -> dict[str, Any]:
        doc = {
            "fits": self.fits,
            "rank": self.rank,
            "placed_bytes": dict(self.placed_bytes),
            "needed_bytes": sum(self.placed_bytes.values()),
            "headroom_bytes": self.headroom_bytes,
            "tokens": self.tokens,
            "max_context_tokens": self.max_context_tokens,
            "reason": self.reason,
        }
        if self.projection is not None:
            doc["projection"] = self.projection.to_json()
        return doc


def int4_bytes(bf16_bytes: int) -> int:
    """Bytes of BF16 weights requantized to INT4 with one BF16 scale per GROUP."""
    weights = bf16_bytes // BF16_BYTES
    return weights // 2 + weights // GROUP * BF16_BYTES


def mtp_needs(bytes_by_class: dict[str, int], text_config: dict[str, Any]) -> MtpNeeds | None:
    """From the checkpoint's tensor bytes (by class) and its text_config; None
    when the checkpoint has no MTP tensors."""
    layer = routed = other = 0
    bf16 = False
    for name, nbytes in bytes_by_class.items():
        if not name.startswith(MTP_PREFIX):
            continue
        if name.startswith(f"{MTP_PREFIX}layers."):
            layer += nbytes
            if ROUTED in name:
                routed += nbytes
                bf16 = bf16 or name.endswith(".weight")
        else:
            other += nbytes
    if layer + other == 0:
        return None
    shape = QsaShape(
        num_key_value_heads=int(text_config["num_key_value_heads"]),
        head_dim=int(text_config["head_dim"]),
        indexer_head_dim=int(text_config["indexer_head_dim"]),
        indexer_compress_ratio=int(text_config["indexer_compress_ratio"]),
    )
    pooled = shape.indexer_head_dim * shape.dtype_bytes // shape.indexer_compress_ratio
    return MtpNeeds(
        layer_bytes=layer,
        routed_expert_bytes=routed,
        experts_bf16=bf16,
        other_bytes=other,
        embed_bytes=int(text_config["vocab_size"]) * int(text_config["hidden_size"]) * BF16_BYTES,
        kv_bytes_per_token=kv_bytes_per_token(shape) + pooled,
    )


def drafter_bytes_per_step(
    needs: MtpNeeds, *, head_bytes: int, experts_per_token: int, num_experts: int
) -> int:
    """Weights one drafter step reads: its layer's dense part, fc/norms/mixer, one token's
    routed experts as INT4 (as `checkpoint mtp-int4` would leave them when stored BF16),
    and the shared LM head. Its embedding row is left out, as the roofline leaves the
    target's."""
    routed = (
        int4_bytes(needs.routed_expert_bytes) if needs.experts_bf16 else needs.routed_expert_bytes
    )
    per_token = routed * experts_per_token // max(num_experts, 1)
    dense = needs.layer_bytes - needs.routed_expert_bytes
    return dense + needs.other_bytes + per_token + head_bytes


def lm_head_bytes(bytes_by_class: dict[str, int]) -> int:
    """The target's LM head as stored (all its tensors: packed weight, scales)."""
    return sum(n for name, n in bytes_by_class.items() if name.startswith(LM_HEAD_PREFIX))


def fit_mtp(needs: MtpNeeds, *, rank: int, headroom_bytes: int, tokens: int) -> MtpFit:
    """Place the drafter on `rank` with `headroom_bytes` to spare, for `tokens`
    tokens of context (max_num_seqs x max_model_len)."""
    placed = {
        "layer": needs.layer_bytes - needs.routed_expert_bytes,
        "routed_experts": needs.routed_expert_bytes,
        "fc_norms_mixer": needs.other_bytes,
        "embed_tokens": needs.embed_bytes,
        "kv": tokens * needs.kv_bytes_per_token,
    }
    weights = sum(v for k, v in placed.items() if k != "kv")
    left = headroom_bytes - weights
    max_tokens = max(left, 0) // needs.kv_bytes_per_token
    fits = left >= placed["kv"]
    if fits:
        reason = (
            f"fits on rank {rank}: {gib(weights + placed['kv'])} of {gib(headroom_bytes)} headroom"
        )
    elif left < 0:
        how = "BF16" if needs.experts_bf16 else "INT4"
        reason = (
            f"the drafter's weights alone need {gib(weights)} on rank {rank} "
            f"({how} experts {gib(needs.routed_expert_bytes)}, its own embedding "
            f"{gib(needs.embed_bytes)}, the rest {gib(placed['layer'] + needs.other_bytes)}); "
            f"the rank has {gib(headroom_bytes)} of headroom"
        )
        if needs.experts_bf16:
            reason += (
                f"; `flashnext checkpoint mtp-int4` would make the experts "
                f"{gib(int4_bytes(needs.routed_expert_bytes))}"
            )
    else:
        reason = (
            f"its QSA layer's K/V stays in VRAM (the offload covers the target's layers): "
            f"{tokens} tokens need {gib(placed['kv'])}, {gib(left)} is left after its weights "
            f"({max_tokens} tokens)"
        )
    return MtpFit(fits, rank, placed, headroom_bytes, tokens, int(max_tokens), reason)
