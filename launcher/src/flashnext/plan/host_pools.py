"""The pinned host K/V pools a plan implies: exact, and as PyTorch would round them.

Block and byte arithmetic comes from `qsa_sizing` (the same formulas as the
patched vLLM); this module adds what the planner decides on top: the cost of
each pinning method, and the largest KV budget that stays under a host cap or
under a power of two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashnext.facts.model_derived import config_int, ple_layer_ids
from flashnext.plan import qsa_sizing


def shape_from_text(
    text: dict[str, Any], num_speculative_tokens: int = 0, drafter_qsa_layers: int = 0
) -> qsa_sizing.QsaShape:
    """The sizing inputs, read from the checkpoint's text_config; the MTP drafter's
    draft tokens and QSA layers when it is placed (0: none)."""
    return qsa_sizing.QsaShape(
        num_hidden_layers=config_int(text, "num_hidden_layers"),
        full_attention_interval=config_int(text, "full_attention_interval", 4),
        num_key_value_heads=config_int(text, "num_key_value_heads"),
        head_dim=config_int(text, "head_dim"),
        linear_num_key_heads=config_int(text, "linear_num_key_heads"),
        linear_num_value_heads=config_int(text, "linear_num_value_heads"),
        linear_key_head_dim=config_int(text, "linear_key_head_dim"),
        linear_value_head_dim=config_int(text, "linear_value_head_dim"),
        linear_conv_kernel_dim=config_int(text, "linear_conv_kernel_dim"),
        num_attention_heads=config_int(text, "num_attention_heads"),
        indexer_head_dim=config_int(text, "indexer_head_dim"),
        indexer_compress_ratio=config_int(text, "indexer_compress_ratio"),
        indexer_budget=config_int(text, "indexer_budget", 2048),
        ssm_state_bytes=4 if text.get("mamba_ssm_dtype", "float32") == "float32" else 2,
        num_speculative_tokens=num_speculative_tokens,
        drafter_qsa_layers=drafter_qsa_layers,
        ple_layers=len(ple_layer_ids(text)),
    )


def pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class HostPools:
    pinning: str
    """"exact" (cudaHostRegister, our patch) or "pow2" (PyTorch's pinned allocator)."""
    block_tokens: int
    num_blocks: int
    layers_per_rank: tuple[int, ...]
    per_layer_exact_bytes: int
    per_layer_pow2_bytes: int

    @property
    def tokens(self) -> int:
        """K/V capacity in tokens, shared by all running requests."""
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
    def busiest_rank_pinned_bytes(self) -> int:
        return max(self.layers_per_rank) * self.per_layer_pinned_bytes


def host_pools(
    shape: qsa_sizing.QsaShape, pp_size: int, partition: list[int] | None, kv: int, pinning: str
) -> HostPools:
    per_rank = qsa_sizing.qsa_layers_per_rank(shape, pp_size, partition)
    block = qsa_sizing.offload_block_size(shape, max(per_rank))
    try:
        blocks = qsa_sizing.size_offload(kv, pp_size, shape, partition).num_blocks
    except ValueError:  # not even one block: the plan shows zero capacity
        blocks = 0
    exact = blocks * block * qsa_sizing.kv_bytes_per_token(shape)
    return HostPools(pinning, block, blocks, tuple(per_rank), exact, pow2_ceil(exact))


def _block_bytes(shape: qsa_sizing.QsaShape, pools: HostPools) -> int:
    """VRAM one pool block costs (what --kv-cache-memory-bytes is divided by)."""
    return qsa_sizing.pool_block_bytes(shape, max(pools.layers_per_rank))


def largest_kv_within_host_cap(
    shape: qsa_sizing.QsaShape,
    pp_size: int,
    partition: list[int] | None,
    kv: int,
    cap_bytes: int,
    pinning: str,
) -> int:
    """The largest KV bytes <= kv whose busiest rank pins at most cap_bytes."""
    pools = host_pools(shape, pp_size, partition, kv, pinning)
    block_vram = _block_bytes(shape, pools)
    blocks = pools.num_blocks
    while blocks > 0:
        fitted = host_pools(shape, pp_size, partition, blocks * block_vram, pinning)
        if fitted.busiest_rank_pinned_bytes <= cap_bytes:
            return kv if blocks == pools.num_blocks else blocks * block_vram
        blocks -= 1
    return 0


def largest_kv_below_pow2(
    shape: qsa_sizing.QsaShape, pp_size: int, partition: list[int] | None, kv: int
) -> int:
    """The largest KV bytes <= kv whose per-layer pool fits the power of two below it.

    PyTorch's pinned allocator rounds 4.03 GiB up to 8 GiB; 3.96 GiB costs 4.
    """
    pools = host_pools(shape, pp_size, partition, kv, "pow2")
    exact = pools.per_layer_exact_bytes
    if exact == 0 or exact & (exact - 1) == 0:
        return kv
    floor_pow2 = pow2_ceil(exact) // 2
    row_bytes = pools.block_tokens * qsa_sizing.kv_bytes_per_token(shape)
    return floor_pow2 // row_bytes * _block_bytes(shape, pools)
