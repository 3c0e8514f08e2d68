"""Issue 27's arithmetic, pure (stdlib only): HBM bytes a decode step reads on
one rank, its roofline fraction, and the 3x3090 projection of measured steps.

Nothing here is a measurement. The inputs are the plan's bytes (per rank,
from the checkpoint's safetensors headers), the model's config, and the
figures the harness measured on the H200 (`pp3_perf.py` passes them in);
the constants below are the 3090's, each with its source. The CPU test
(`test_pp3_perf.py`) runs every function on made-up inputs labelled as such.

HBM bytes per decode step on a rank (`hbm_bytes_per_step`), `rows` decode
rows (batch x (1 + MTP K)) at context `context` tokens:
- the rank's dense weights (non-expert, not the embedding: the plan's
  `DecodeRoofline.dense_bytes` split per rank), read once per step;
- routed experts: each MoE layer reads the distinct experts its rows pick.
  With top-k of E experts and rows drawn independently and uniformly, the
  expected distinct count is E x (1 - (1 - k/E)^rows) (an assumption: dummy
  weights give a random router, real weights need not be uniform);
- the embedding: one row per decode row (rank 0; negligible, counted);
- GDN layers: the recurrent state, float32 (config `mamba_ssm_dtype`),
  heads x key dim x value dim, read and written once per row; the conv
  state (conv dim x (kernel - 1), bf16) likewise;
- QSA layers: the indexer's pooled keys over the context (context /
  compress ratio keys of indexer_kv_heads x indexer_head_dim, bf16 assumed),
  read once per row; the selected K/V rows (min(context, indexer_budget) x
  kv heads x head_dim x 2, bf16) read from HBM only when K/V is in VRAM.
  With the offload (patch 0022) the selected rows cross PCIe instead
  (`pcie_bytes_per_step`): UVA reads inside the decode kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# One RTX 3090's memory bandwidth, GDDR6X peak: shared/SPEC.md line 11
# ("sm_86, PCIe 4.0 x16, 936 GB/s each") and profiles/3x3090.toml
# gpu.bandwidth_bytes_per_s. A datasheet figure, not measured (the H200's
# side is measured: results/hbm_bandwidth-h200-b1.json).
BANDWIDTH_3090_BYTES_PER_S = 936_000_000_000
# One 3090's host link, PCIe 4.0 x16: profiles/3x3090.toml
# gpu.host_link_bytes_per_s, the field report's "約 25 GiB/s" (shared/seed
# section 5.1), not measured here.
HOST_LINK_3090_BYTES_PER_S = 26_843_545_600
BF16 = 2
FLOAT32 = 4


def expected_distinct_experts(rows: int, top_k: int, num_experts: int) -> float:
    """Expected distinct experts `rows` independent uniform top-k picks touch."""
    if rows <= 0 or num_experts <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


@dataclass(frozen=True)
class RankBytes:
    """A rank's weight bytes by how decode reads them (the checkpoint's headers)."""

    dense_bytes: int  # non-expert, non-embedding: read once per step
    routed_expert_bytes: int  # all routed experts of the rank's layers
    moe_layers: int
    embedding_row_bytes: int  # one embedding row (rank 0), 0 elsewhere
    gdn_layers: int
    qsa_layers: int


def _text(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def state_bytes_per_row(config: dict[str, Any]) -> dict[str, int]:
    """Per decode row and layer: GDN state read+written, QSA indexer bytes per
    context token, the selected K/V bytes per token (module docstring)."""
    t = _text(config)
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_dim = t["linear_num_value_heads"] * t["linear_value_head_dim"]
    recurrent = (
        t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"]
    ) * (FLOAT32 if t.get("mamba_ssm_dtype", "float32") == "float32" else BF16)
    conv = (2 * key_dim + value_dim) * (t["linear_conv_kernel_dim"] - 1) * BF16
    return {
        "gdn_read_write": 2 * (recurrent + conv),
        "indexer_per_context_token": t["indexer_kv_heads"] * t["indexer_head_dim"] * BF16,
        "kv_per_selected_token": t["num_key_value_heads"] * t["head_dim"] * 2 * BF16,
    }


def selected_tokens(config: dict[str, Any], context: int) -> int:
    return min(context, _text(config)["indexer_budget"])


def hbm_bytes_per_step(
    rank: RankBytes,
    config: dict[str, Any],
    *,
    rows: int,
    context: int,
    kv_in_vram: bool,
) -> dict[str, int]:
    """Bytes one decode step reads from HBM on the rank, by term, and the total."""
    t = _text(config)
    per = state_bytes_per_row(config)
    distinct = expected_distinct_experts(rows, t["num_experts_per_tok"], t["num_experts"])
    routed_per_layer = rank.routed_expert_bytes / rank.moe_layers if rank.moe_layers else 0
    terms = {
        "dense_weights": rank.dense_bytes,
        "routed_experts": round(rank.moe_layers * routed_per_layer * distinct / t["num_experts"]),
        "embedding_rows": rows * rank.embedding_row_bytes,
        "gdn_state": rows * rank.gdn_layers * per["gdn_read_write"],
        "qsa_indexer": rows
        * rank.qsa_layers
        * math.ceil(context / t["indexer_compress_ratio"])
        * per["indexer_per_context_token"],
        "qsa_kv": (
            rows * rank.qsa_layers * selected_tokens(config, context) * per["kv_per_selected_token"]
            if kv_in_vram
            else 0
        ),
    }
    terms["total"] = sum(terms.values())
    return terms


def pcie_bytes_per_step(
    rank: RankBytes, config: dict[str, Any], *, rows: int, context: int, kv_in_vram: bool
) -> int:
    """QSA K/V bytes a decode step reads from host memory (offload only)."""
    if kv_in_vram:
        return 0
    per = state_bytes_per_row(config)
    return rows * rank.qsa_layers * selected_tokens(config, context) * per["kv_per_selected_token"]


def roofline_fraction(hbm_bytes: int, gpu_busy_ms: float | None, read_bytes_per_s: float):
    """Bytes per step over busy time, as a share of the measured streaming read."""
    if not gpu_busy_ms:
        return None
    return hbm_bytes / (gpu_busy_ms / 1e3) / read_bytes_per_s


@dataclass(frozen=True)
class MeasuredStep:
    """One rank's decode step as measured on the H200 (inputs of the projection)."""

    gpu_busy_ms: float  # kernels' device time per step (torch profiler)
    cpu_ms: float  # the host's time on the critical path per step (measured)
    pcie_bytes: int  # QSA host reads per step (offload)
    hbm_bytes: int  # computed bytes read from HBM per step


@dataclass(frozen=True)
class Links:
    """The bandwidths the projection scales by (H200 measured, 3090 cited)."""

    h200_read_bytes_per_s: float
    h200_h2d_bytes_per_s: float
    b3090_bytes_per_s: float = BANDWIDTH_3090_BYTES_PER_S
    link_3090_bytes_per_s: float = HOST_LINK_3090_BYTES_PER_S


# How a rank's H200 GPU time becomes a 3090's (README, "The projection's rules"):
# "streaming" scales only the step's HBM bytes' streaming time and carries the rest of
# the kernels' time over as measured; "bandwidth" (the rule before 2026-12-07) scales
# all of it by the bandwidth ratio. RULE is the contract's; both are reported.
RULES = ("streaming", "bandwidth")
RULE = "streaming"


def project_step_ms(step: MeasuredStep, links: Links, rule: str = RULE) -> dict[str, float]:
    """One rank's step on a 3090.

    The QSA host reads come off the GPU time at the H200's pinned H2D rate and
    go back on at the 3090's link. The rest of the GPU time (`device`):
    - rule "streaming": the step's HBM bytes at the H200's measured read are
      its streaming time; on a 3090 those bytes take bytes / its bandwidth,
      and what is left of `device` (launches, small kernels' tails, the GPU
      waiting on itself: time no bandwidth buys back) is carried over as
      measured, a lower bound on a card with fewer, slower SMs;
    - rule "bandwidth": all of `device` scaled by H200 read / 3090 bandwidth,
      never below the step's bytes at the 3090's bandwidth.
    CPU: as measured (the host's CPU, not the 3090 machine's). The parts are
    added: no overlap assumed."""
    if rule not in RULES:
        raise ValueError(f"unknown projection rule {rule!r}; known: {RULES}")
    pcie_h200_ms = step.pcie_bytes / links.h200_h2d_bytes_per_s * 1e3
    device_ms = max(step.gpu_busy_ms - pcie_h200_ms, 0.0)
    streaming_ms = step.hbm_bytes / links.b3090_bytes_per_s * 1e3
    if rule == "streaming":
        carried_ms = max(device_ms - step.hbm_bytes / links.h200_read_bytes_per_s * 1e3, 0.0)
    else:
        scaled = device_ms * links.h200_read_bytes_per_s / links.b3090_bytes_per_s
        streaming_ms, carried_ms = max(scaled, streaming_ms), 0.0
    gpu_ms = streaming_ms + carried_ms + step.pcie_bytes / links.link_3090_bytes_per_s * 1e3
    return {"gpu_ms": gpu_ms, "streaming_ms": streaming_ms, "carried_ms": carried_ms,
            "cpu_ms": step.cpu_ms, "step_ms": gpu_ms + step.cpu_ms}  # fmt: skip


def round_ms(steps: list[MeasuredStep], links: Links, rule: str = RULE) -> float:
    """A token's way through the ranks on 3x3090: their projected steps in turn."""
    return sum(project_step_ms(s, links, rule)["step_ms"] for s in steps)


def mtp_c1_tok_s(
    verify: list[MeasuredStep],
    draft_ms: float,
    links: Links,
    tokens_per_round: float,
    rule: str = RULE,
) -> float:
    """c=1 with MTP on 3x3090: a round is each rank's verify step in turn and
    the draft step on the last rank, and yields tokens_per_round (at K drafts
    and acceptance a, the launcher's mtp_projection.tokens_per_step). The
    draft's GPU time: scaled whole under "bandwidth"; carried over as measured
    under "streaming" (its bytes are not counted apart: a lower bound)."""
    ratio = links.h200_read_bytes_per_s / links.b3090_bytes_per_s if rule == "bandwidth" else 1.0
    return tokens_per_round * 1e3 / (round_ms(verify, links, rule) + draft_ms * ratio)


def project_3090(
    c1: list[MeasuredStep],
    c4: list[MeasuredStep] | None,
    mtp1: list[MeasuredStep] | None,
    links: Links,
    *,
    mtp1_draft_ms: float | None = None,
    acceptance_rate: float | None = None,
    rule: str = RULE,
) -> dict[str, Any]:
    """tok/s on 3x3090 from each rank's measured step (one entry per rank).

    A token crosses the ranks in turn: c=1 is 1000 / sum of the ranks'
    projected steps; c=4 is 4 tokens per such round (no overlap of the
    ranks' microbatches assumed: one GPU cannot show it, three cards can
    overlap them, so this is a floor). MTP K=1 at c=1: each round yields
    1 + acceptance tokens and costs the verify steps plus the draft step
    (measured on the last rank, scaled like its GPU time)."""

    out: dict[str, Any] = {
        "c1_tok_s": 1e3 / round_ms(c1, links, rule) if c1 else None,
        "c4_tok_s": 4e3 / round_ms(c4, links, rule) if c4 else None,
        "mtp1_c1_tok_s": None,
    }
    if mtp1 and mtp1_draft_ms is not None and acceptance_rate is not None:
        # One draft token: the target's own token plus the draft when accepted.
        out["mtp1_c1_tok_s"] = mtp_c1_tok_s(mtp1, mtp1_draft_ms, links, 1 + acceptance_rate, rule)
    gpu = (
        f"the step's HBM bytes at the 3090's {links.b3090_bytes_per_s / 1e9:.0f} GB/s "
        "(SPEC.md) + the rest of the GPU time (less those bytes at the H200's measured read "
        f"{links.h200_read_bytes_per_s / 1e9:.1f} GB/s) carried over as measured"
        if rule == "streaming"
        else f"x H200 measured read {links.h200_read_bytes_per_s / 1e9:.1f} GB/s / 3090 "
        f"{links.b3090_bytes_per_s / 1e9:.0f} GB/s (SPEC.md; at least the step's HBM bytes "
        "at that rate)"
    )
    out["basis"] = (
        f"rule {rule}: per rank: (GPU busy - QSA host reads at the H200's measured pinned H2D "
        f"{links.h200_h2d_bytes_per_s / 1e9:.1f} GB/s) -> {gpu} + QSA host reads at the "
        "3090's link "
        f"{links.link_3090_bytes_per_s / 1e9:.1f} GB/s (profiles/3x3090.toml, field report) "
        "+ the host's critical time as measured on the H200 host (its last wait's end "
        "to its graph launch); ranks added in turn (no pipeline overlap; the PP "
        "transfers between cards not counted: loopback sockets here); MTP: "
        "(1 + acceptance) tokens per round, acceptance "
        f"{acceptance_rate} from the profile (not measured: dummy weights)"
    )
    return out
