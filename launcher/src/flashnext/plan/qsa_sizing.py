"""Block and host-byte arithmetic for QSA K/V offload (pure, bytes throughout).

The planner uses this to size `--kv-cache-memory-bytes` and the pinned host
RAM of the offloaded QSA arenas. It mirrors, formula for formula, what the
patched vLLM 0.33.0 does (patch 0020, `_align_hybrid_block_size` and the
`get_qsa_offload_page_layout` model hook; the arena sizing of 0021); the
proof `checks/patches/test_qsa_block_size.py` runs the real vLLM code and
asserts the two agree. Figures for the 3x3090 profile (SPEC.md, maps/QSA.md
section 5): stock block 1568 tokens and a 3,211,264 B padded mamba page;
under offload 12,144-token blocks, 550e6 B -> 171 blocks -> 2,076,624
tokens -> 3.961 GiB of host K/V per QSA layer, 47.5 GiB for 12 layers.
How many requests those blocks hold is vLLM's grouping and block accounting
(`kv_groups`, `request_capacity`), held to vLLM's own planner and block
manager by `checks/patches/test_kv_request_capacity.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import lcm

# The attention kernels take block sizes in multiples of 16
# (Qwen4ExpQSAFlashAttentionBackend.get_supported_kernel_block_sizes).
KERNEL_BLOCK_MULTIPLE = 16
# What one offloaded QSA layer keeps in VRAM per token besides the pooled key:
# the 2 B slot-number page of the main spec.
SLOT_BYTES_PER_TOKEN = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(value: int, multiple: int) -> int:
    return _cdiv(value, multiple) * multiple


@dataclass(frozen=True)
class QsaShape:
    """The text_config fields the sizing depends on (Qwen3.8-Flash-Next values)."""

    num_hidden_layers: int = 48
    full_attention_interval: int = 4  # QSA at layers 3, 7, ..., 47
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 48
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_attention_heads: int = 24
    indexer_head_dim: int = 128
    indexer_compress_ratio: int = 4
    indexer_budget: int = 2048
    dtype_bytes: int = 2  # bf16 activations and K/V
    ssm_state_bytes: int = 4  # mamba_ssm_dtype float32
    num_speculative_tokens: int = 0
    drafter_qsa_layers: int = 0
    """QSA layers of the MTP drafter, all on the last PP rank (0: no drafter). Its
    layer joins that rank's KV pool and offloads like the target's (plan/mtp.py), so
    the sizing counts it as one more QSA layer there."""
    ple_layers: int = 1
    """Layers with a PLE short-conv state (ple_layer_ids); a state like a GDN layer's."""

    def qsa_layer_ids(self) -> list[int]:
        step = self.full_attention_interval
        return [i for i in range(self.num_hidden_layers) if (i + 1) % step == 0]

    @property
    def gdn_layers(self) -> int:
        """Gated delta-net layers of the target: every layer that is not QSA."""
        return self.num_hidden_layers - len(self.qsa_layer_ids())


def pp_partition(
    num_layers: int, pp_size: int, partition: list[int] | None = None
) -> list[tuple[int, int]]:
    """[start, end) layer ranges per PP rank, as vLLM's get_pp_indices computes them.

    ``partition`` is VLLM_PP_LAYER_PARTITION as a list of layer counts.
    Without it, layers are spread evenly and the remainder goes to the
    middle-to-last ranks (vllm.distributed.utils.get_pp_indices).
    """
    if pp_size <= 0:
        raise ValueError(f"pipeline size must be positive, got {pp_size}")
    if partition is not None:
        if len(partition) != pp_size or sum(partition) != num_layers or min(partition) <= 0:
            raise ValueError(
                f"layer partition {partition} must be {pp_size} positive counts "
                f"summing to {num_layers}"
            )
        counts = list(partition)
    else:
        counts = [num_layers // pp_size] * pp_size
        remaining = num_layers % pp_size
        for i in range(2, remaining + 2):
            counts[-i] += 1
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def qsa_layers_per_rank(
    shape: QsaShape, pp_size: int, partition: list[int] | None = None
) -> list[int]:
    """Number of QSA layers each PP rank holds, the drafter's on the last."""
    ids = shape.qsa_layer_ids()
    counts = [
        sum(start <= i < end for i in ids)
        for start, end in pp_partition(shape.num_hidden_layers, pp_size, partition)
    ]
    counts[-1] += shape.drafter_qsa_layers
    return counts


def mamba_page_bytes(shape: QsaShape) -> int:
    """One gated-delta-net layer's state: conv state + fp32 temporal state."""
    conv_dim = (
        shape.linear_key_head_dim * shape.linear_num_key_heads * 2
        + shape.linear_value_head_dim * shape.linear_num_value_heads
    )
    conv = (shape.linear_conv_kernel_dim - 1 + shape.num_speculative_tokens) * conv_dim
    temporal = (
        shape.linear_num_value_heads * shape.linear_value_head_dim * shape.linear_key_head_dim
    )
    return conv * shape.dtype_bytes + temporal * shape.ssm_state_bytes


def kv_bytes_per_token(shape: QsaShape) -> int:
    """Full K/V of one QSA layer per token (2048 B): what the host arena holds."""
    return shape.num_key_value_heads * 2 * shape.head_dim * shape.dtype_bytes


def offload_vram_bytes_per_token(shape: QsaShape) -> int:
    """VRAM per token of one offloaded QSA layer: slot number + pooled indexer key (66 B)."""
    pooled = shape.indexer_head_dim * shape.dtype_bytes // shape.indexer_compress_ratio
    return SLOT_BYTES_PER_TOKEN + pooled


def selection_width(shape: QsaShape) -> int:
    """Selected tokens per query row: the budget plus an open group's tail (2051)."""
    return shape.indexer_budget + shape.indexer_compress_ratio - 1


def offload_workspace_bytes(
    shape: QsaShape,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    chunk_tokens: int = 16384,
) -> int:
    """VRAM of the per-rank offload workspace (patch 0022, ops/qsa_offload.py).

    Two chunk slots of K/V, the fp32 running state (acc, max, sum) and the
    sorted-selection buffers (int32, int32, int64) for every workspace row.
    vLLM's memory profile never runs QSA, so the planner reserves this by
    hand. 3x3090 profile (512 rows, 16k chunks): 96,591,872 B (92.1 MiB).
    """
    rows = max(max_num_batched_tokens, max_num_seqs * (1 + shape.num_speculative_tokens))
    chunk = 2 * chunk_tokens * kv_bytes_per_token(shape)
    state = rows * shape.num_attention_heads * (shape.head_dim + 2) * 4
    selection = rows * selection_width(shape) * (4 + 4 + 8)
    return chunk + state + selection


def ring_capacity(shape: QsaShape) -> int:
    """Raw-key ring tokens per request (QSAKeyStateCache.get_kv_cache_spec)."""
    ratio = shape.indexer_compress_ratio
    return _round_up(ratio + shape.num_speculative_tokens, ratio)


def stock_block_size(shape: QsaShape, initial_block_size: int = 16) -> int:
    """vLLM's stock hybrid block size: 2048 B/token pages covering a mamba page (1568)."""
    align = max(KERNEL_BLOCK_MULTIPLE, initial_block_size)
    return align * _cdiv(mamba_page_bytes(shape), align * kv_bytes_per_token(shape))


def offload_block_size(shape: QsaShape, qsa_layers_on_busiest_rank: int) -> int:
    """Patched block size under offload (12,144 for 4 QSA layers per rank).

    The largest multiple of lcm(16, ring capacity) whose group page
    (layers x VRAM bytes per token x block) fits in one unpadded mamba page.
    """
    align = lcm(KERNEL_BLOCK_MULTIPLE, ring_capacity(shape))
    group = max(qsa_layers_on_busiest_rank, 1) * offload_vram_bytes_per_token(shape)
    block = align * (mamba_page_bytes(shape) // (group * align))
    if block < align:
        raise ValueError(
            f"{qsa_layers_on_busiest_rank} QSA layers per rank do not fit one block in the "
            "mamba page; use more pipeline stages"
        )
    return block


def pool_block_bytes(shape: QsaShape, qsa_layers_on_busiest_rank: int) -> int:
    """What vLLM divides `--kv-cache-memory-bytes` by under offload: the largest page.

    The planner (block-outermost layout) gives every pool block the largest
    page of any group: the mamba state (3,207,168 B), which the QSA group's
    page (layers x 66 B x block, 3,206,016 B) fits inside.
    """
    block = offload_block_size(shape, qsa_layers_on_busiest_rank)
    group = max(qsa_layers_on_busiest_rank, 1) * offload_vram_bytes_per_token(shape) * block
    return max(mamba_page_bytes(shape), group)


@dataclass(frozen=True)
class QsaOffloadSizing:
    """Everything the planner needs for one deployment (bytes unless named otherwise)."""

    block_size_tokens: int
    stock_block_size_tokens: int
    mamba_page_bytes: int
    stock_padded_page_bytes: int
    group_page_bytes: int  # VRAM per block of one rank's QSA group (slot pages + pooled keys)
    pool_block_bytes: int  # one block of vLLM's shared pool: the largest page (mamba)
    stock_waste_ratio: float  # padded page / what offloaded layers use at the stock size
    num_blocks: int
    tokens: int
    host_bytes_per_layer: int
    host_bytes_total: int  # all QSA layers (every rank together, the drafter's included)
    host_bytes_busiest_rank: int
    qsa_layers_per_rank: tuple[int, ...]


def size_offload(
    kv_cache_memory_bytes: int,
    pp_size: int,
    shape: QsaShape | None = None,
    partition: list[int] | None = None,
) -> QsaOffloadSizing:
    """Blocks, tokens and exact host bytes for a per-rank KV budget.

    ``kv_cache_memory_bytes`` is what `--kv-cache-memory-bytes` gives each
    rank. vLLM's planner (block-outermost layout, as QSA selects) cuts it into
    blocks of the largest page: the mamba state, which the QSA group's page
    fits inside by construction of the block size.
    """
    shape = shape or QsaShape()
    if kv_cache_memory_bytes <= 0:
        raise ValueError(f"KV cache bytes must be positive, got {kv_cache_memory_bytes}")
    per_rank = qsa_layers_per_rank(shape, pp_size, partition)
    busiest = max(per_rank)
    block = offload_block_size(shape, busiest)
    group_page = busiest * offload_vram_bytes_per_token(shape) * block
    pool_block = pool_block_bytes(shape, busiest)
    num_blocks = kv_cache_memory_bytes // pool_block
    if num_blocks < 1:
        raise ValueError(
            f"{kv_cache_memory_bytes} bytes hold no {pool_block}-byte block; raise "
            "--kv-cache-memory-bytes"
        )
    stock_block = stock_block_size(shape)
    stock_page = stock_block * kv_bytes_per_token(shape)
    used_at_stock = busiest * offload_vram_bytes_per_token(shape) * stock_block
    host_layer = num_blocks * block * kv_bytes_per_token(shape)
    return QsaOffloadSizing(
        block_size_tokens=block,
        stock_block_size_tokens=stock_block,
        mamba_page_bytes=mamba_page_bytes(shape),
        stock_padded_page_bytes=stock_page,
        group_page_bytes=group_page,
        pool_block_bytes=pool_block,
        stock_waste_ratio=stock_page / used_at_stock,
        num_blocks=num_blocks,
        tokens=num_blocks * block,
        host_bytes_per_layer=host_layer,
        host_bytes_total=host_layer * sum(per_rank),
        host_bytes_busiest_rank=host_layer * busiest,
        qsa_layers_per_rank=tuple(per_rank),
    )


# ---------------------------------------------------------------- requests in the pool
# vLLM gives every PP rank the same num_blocks, and a request takes blocks from that one
# pool for every KV cache group: its K/V pages (cdiv(length, block)) and, whatever its
# length, its GDN, PLE and raw-key-ring states. Every block is the largest page, so a
# state block costs as much as a K/V block: num_blocks x block tokens would hold only
# for requests without states.


def approximate_gcd(values: list[int], lower_bound: int) -> int:
    """vLLM's `_approximate_gcd` (v1/core/kv_cache_planning.py): the width d in
    [lower_bound, max(values)] that pads the fewest layers, ties to the larger d."""
    best, best_pad = lower_bound, None
    for d in range(lower_bound, max(values) + 1):
        pad = sum(-x % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


@dataclass(frozen=True)
class KvGroups:
    """The KV cache groups vLLM 0.33.0 forms for this model under QSA offload
    (`_get_packed_kv_cache_groups`, the block-outermost layout QSA selects). It groups
    the whole model's layers, every PP rank's together; each rank keeps every group,
    emptied where it holds none of the group's layers."""

    qsa: int
    """Groups of the QSA layers' VRAM pages (slot numbers and pooled keys)."""
    ring: int
    """Groups of their raw-key rings."""
    gdn: int
    """Groups of GDN states."""
    gdn_layers_per_group: int
    """The most GDN layers one group holds, model-wide."""
    ple: int
    """Groups of PLE short-conv states."""


def kv_groups(shape: QsaShape, block_size_tokens: int) -> KvGroups:
    """vLLM's grouping. QSA, ring, GDN and PLE layers form a bucket each; the QSA one
    mixes two page sizes (slot numbers, pooled keys), which keeps its layers in one
    group. A GDN group holds as many states as the widest group's page (the anchor)
    fits. The anchor is the whole model's QSA page while each PP rank's block is its
    own: 0020 makes a rank's page just fit one state, so 3 ranks' pages hold 2 states,
    not 3, and 36 GDN layers make 18 groups, each split over two ranks."""
    n_qsa = len(shape.qsa_layer_ids()) + shape.drafter_qsa_layers
    n_gdn, n_ple = shape.gdn_layers, shape.ple_layers
    repeats = approximate_gcd([n for n in (n_qsa, n_qsa, n_gdn, n_ple) if n], n_qsa)
    qsa = _cdiv(n_qsa, repeats)
    mamba = mamba_page_bytes(shape)
    # The PLE state (180 KiB) and a ring (1 KiB per layer) never set the anchor.
    anchor = max(_cdiv(n_qsa, qsa) * offload_vram_bytes_per_token(shape) * block_size_tokens, mamba)
    gdn = max(_cdiv(n_gdn, repeats), _cdiv(n_gdn, max(anchor // mamba, 1))) if n_gdn else 0
    return KvGroups(
        qsa=qsa,
        ring=qsa,
        gdn=gdn,
        gdn_layers_per_group=_cdiv(n_gdn, gdn) if gdn else 0,
        ple=_cdiv(n_ple, repeats) if n_ple else 0,
    )


@dataclass(frozen=True)
class RequestCapacity:
    """Requests of max_model_len tokens the pool holds, as vLLM counts them."""

    max_model_len: int
    num_blocks: int
    """Per rank (vLLM gives every rank the smallest rank's count)."""
    block_size_tokens: int
    groups: KvGroups
    kv_blocks_per_request: int
    """A request's K/V pages: cdiv(max_model_len, block) per QSA group."""
    state_blocks_per_request: int
    """Its states, whatever its length: 1 + k blocks per GDN and PLE group (prefix caching
    off; 2 + k on: vLLM's MambaSpec), one per ring group."""

    @property
    def blocks_per_request(self) -> int:
        return self.kv_blocks_per_request + self.state_blocks_per_request

    @property
    def usable_blocks(self) -> int:
        """num_blocks less the null block vLLM's BlockPool holds back."""
        return max(self.num_blocks - 1, 0)

    @property
    def full_length_requests(self) -> int:
        """Requests of max_model_len tokens that can hold their blocks at once."""
        return self.usable_blocks // self.blocks_per_request

    @property
    def starts(self) -> bool:
        """vLLM refuses to start when one such request does not fit (get_kv_cache_configs)."""
        return self.full_length_requests >= 1

    @property
    def max_concurrency(self) -> float:
        """vLLM's `get_max_concurrency_for_kv_cache_config` (it counts the null block)."""
        return self.num_blocks / self.blocks_per_request

    @property
    def kv_cache_tokens(self) -> int:
        """vLLM's logged "KV cache size: N tokens": max_concurrency x max_model_len."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def longest_request_tokens(self) -> int:
        """The largest --max-model-len one request fits at (vLLM's estimate when it refuses)."""
        return self.longest_for(1)

    def longest_for(self, requests: int) -> int:
        """The largest --max-model-len at which `requests` such requests fit at once."""
        room = self.usable_blocks // requests - self.state_blocks_per_request
        return max(room, 0) // self.groups.qsa * self.block_size_tokens

    def with_fewer_drafts(self, n: int) -> RequestCapacity:
        """The same pool and length with n draft tokens fewer: each draft keeps one
        more block per GDN and PLE state group (request_capacity's per_state)."""
        fewer = n * (self.groups.gdn + self.groups.ple)
        return replace(self, state_blocks_per_request=self.state_blocks_per_request - fewer)


def request_capacity(
    shape: QsaShape,
    num_blocks: int,
    block_size_tokens: int,
    max_model_len: int,
    *,
    prefix_caching: bool = False,
) -> RequestCapacity:
    """The pool's requests at max_model_len. Prefix caching selects vLLM's mamba cache
    mode: "none" keeps 1 + k blocks per state, "align" 2 + k."""
    groups = kv_groups(shape, block_size_tokens)
    per_state = (2 if prefix_caching else 1) + shape.num_speculative_tokens
    return RequestCapacity(
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size_tokens=block_size_tokens,
        groups=groups,
        kv_blocks_per_request=groups.qsa * _cdiv(max_model_len, block_size_tokens),
        state_blocks_per_request=(groups.gdn + groups.ple) * per_state + groups.ring,
    )
