"""QSA K/V sizing under host offload: block size, block count, pinned host bytes.

Pure arithmetic over the text config, shared by the launcher's planner and
checked against the patched vLLM's own formula (checks/patches). Figures from
shared/maps/QSA.md section 5 for the shipped config, 4 QSA layers per rank:
mamba page 3,207,168 B (padded 3,211,264 = 1568 x 2048), offloaded QSA keeps
66 B/token in VRAM, block = 12,144 tokens; 550e6 B of KV -> 171 blocks ->
2,076,624 tokens -> 3.961 GiB of host K/V per layer.

Interface used by flashnext.plan (keep it stable): HostPools, host_pools,
largest_kv_within_host_cap, largest_kv_below_pow2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_BYTES_PER_TOKEN = 2048
"""Host K/V of one QSA layer per token: 2 KV heads x (K + V) x 256 x bf16."""
SLOT_BYTES_PER_TOKEN = 2
"""VRAM per token under offload: the slot number of the host row."""
BLOCK_ALIGN = 16
"""QSA kernels need block sizes that are multiples of 16."""


def mamba_state_bytes(text: dict[str, Any]) -> int:
    """Unpadded per-sequence state of one gated delta-net layer (conv + SSM)."""
    key_dim = int(text["linear_num_key_heads"]) * int(text["linear_key_head_dim"])
    value_dim = int(text["linear_num_value_heads"]) * int(text["linear_value_head_dim"])
    conv_dim = 2 * key_dim + value_dim
    conv = (int(text["linear_conv_kernel_dim"]) - 1) * conv_dim * 2  # bf16
    ssm_itemsize = 4 if text.get("mamba_ssm_dtype", "float32") == "float32" else 2
    ssm = (
        int(text["linear_num_value_heads"])
        * int(text["linear_key_head_dim"])
        * int(text["linear_value_head_dim"])
        * ssm_itemsize
    )
    return conv + ssm


def offloaded_vram_bytes_per_token(text: dict[str, Any]) -> int:
    """Slot number plus the pooled indexer key (head_dim bf16 / compress ratio)."""
    pooled = int(text["indexer_head_dim"]) * 2 // int(text["indexer_compress_ratio"])
    return SLOT_BYTES_PER_TOKEN + pooled


def block_tokens(text: dict[str, Any], qsa_layers_on_rank: int) -> int:
    """Tokens per block so that the rank's QSA layers fill one mamba page."""
    per_token = qsa_layers_on_rank * offloaded_vram_bytes_per_token(text)
    tokens = mamba_state_bytes(text) // per_token
    return tokens - tokens % BLOCK_ALIGN


def num_blocks(text: dict[str, Any], kv_cache_bytes: int) -> int:
    """Blocks that fit in --kv-cache-memory-bytes: one mamba page per block."""
    return kv_cache_bytes // mamba_state_bytes(text)


def pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class HostPools:
    pinning: str
    """"exact" (cudaHostRegister) or "pow2" (torch pinned allocator)."""
    block_tokens: int
    num_blocks: int
    layers_per_rank: tuple[int, ...]
    per_layer_exact_bytes: int
    per_layer_pow2_bytes: int

    @property
    def tokens(self) -> int:
        """K/V capacity in tokens (shared by all sequences)."""
        return self.num_blocks * self.block_tokens

    @property
    def layers(self) -> int:
        return sum(self.layers_per_rank)

    @property
    def per_layer_pinned_bytes(self) -> int:
        return self.per_layer_exact_bytes if self.pinning == "exact" else self.per_layer_pow2_bytes

    @property
    def total_exact_bytes(self) -> int:
        return self.layers * self.per_layer_exact_bytes

    @property
    def total_pow2_bytes(self) -> int:
        return self.layers * self.per_layer_pow2_bytes

    @property
    def pinned_total_bytes(self) -> int:
        return self.layers * self.per_layer_pinned_bytes

    @property
    def max_rank_pinned_bytes(self) -> int:
        return max(self.layers_per_rank) * self.per_layer_pinned_bytes


def host_pools(
    text: dict[str, Any], layers_per_rank: list[int], kv_cache_bytes: int, pinning: str
) -> HostPools:
    # vLLM needs one block size for every rank: size it for the rank with
    # the most QSA layers (the smallest block).
    tokens = block_tokens(text, max(layers_per_rank))
    blocks = num_blocks(text, kv_cache_bytes)
    exact = blocks * tokens * KV_BYTES_PER_TOKEN
    return HostPools(
        pinning=pinning,
        block_tokens=tokens,
        num_blocks=blocks,
        layers_per_rank=tuple(layers_per_rank),
        per_layer_exact_bytes=exact,
        per_layer_pow2_bytes=pow2_ceil(exact),
    )


def largest_kv_within_host_cap(
    text: dict[str, Any], layers_per_rank: list[int], kv: int, cap_bytes: int, pinning: str
) -> int:
    """The largest KV bytes <= kv whose busiest rank pins at most cap_bytes."""
    page = mamba_state_bytes(text)
    while kv >= page:
        if host_pools(text, layers_per_rank, kv, pinning).max_rank_pinned_bytes <= cap_bytes:
            return kv
        kv = (kv // page - 1) * page  # one block fewer
    return 0


def largest_kv_below_pow2(text: dict[str, Any], layers_per_rank: list[int], kv: int) -> int:
    """The largest KV bytes <= kv whose per-layer pool fits the power of two below it.

    PyTorch's pinned allocator rounds 4.03 GiB up to 8 GiB; 3.96 GiB costs 4.
    """
    pools = host_pools(text, layers_per_rank, kv, "pow2")
    exact = pools.per_layer_exact_bytes
    if exact == 0 or exact & (exact - 1) == 0:
        return kv
    floor_pow2 = pow2_ceil(exact) // 2
    blocks = floor_pow2 // (pools.block_tokens * KV_BYTES_PER_TOKEN)
    return blocks * mamba_state_bytes(text)
