"""Patch 0032: under QSA K/V offload the MTP drafter's QSA layer sizes the block.

Real path on CPU, as the model runner collects KV specs with MTP on: the
target (`Qwen4ExpForConditionalGeneration`) and the drafter (`Qwen4ExpMTP`,
built in the draft config `apply_draft_overrides` gives, into the same static
forward context) are built on `meta` with VLLM_QSA_KV_OFFLOAD=1 and one draft
token, `get_kv_cache_spec` collects both, and vLLM's own planner
(get_global_kv_cache_groups, get_kv_cache_configs; BLNHC, as QSA selects)
plans them.

- Shipped text shapes at PP=3: the specs are split per rank with
  get_pp_indices and the drafter's layer goes to the last rank (where 0030
  builds it). Without 0032 the block is sized for 4 QSA layers (12,224
  tokens) and the last rank's QSA group page (5 layers, 4,033,920 B) outgrows
  the 3,227,648 B mamba page: 136 blocks on every rank instead of 170.
- The tiny qwen4_exp at PP=1: the pool is allocated and bound on CPU (the
  host arena replaced by a CPU stand-in, as in test_qsa_offload_layer.py),
  and the drafter layer's arena is the size the planner pins for it.

The launcher's arithmetic (flashnext.plan.qsa_sizing / plan.host_pools, with
QsaShape.drafter_qsa_layers) must give the same block size, block count,
tokens and arena bytes.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
from qsa_offload_cpu import offload_on_cpu
from test_qsa_block_size import REAL_SHAPES
from test_qsa_offload_layer import INDEXER as TINY_INDEXER
from test_qsa_offload_layer import TINY as TINY_WITHOUT_MTP
from tiny_qwen4_exp import build_model, engine_args, write_tiny_qwen4_exp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.plan import host_pools, qsa_sizing  # noqa: E402

PATCH = "0032-qsa-offload-block-size-mtp.patch"
MTP = {"mtp_num_hidden_layers": 1}
SPEC = {"method": "mtp", "num_speculative_tokens": 1}
KV_REAL_BYTES = 550_000_000  # per rank, the 3x3090 profile's figure
KV_TINY_BYTES = 2 << 20
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")

# The shipped shapes (test_qsa_block_size.py) and the tiny model's indexer and
# planner shape (test_qsa_offload_layer.py), with one MTP layer and one draft token.
REAL = qsa_sizing.QsaShape(num_speculative_tokens=1, drafter_qsa_layers=1)
TINY = dataclasses.replace(TINY_WITHOUT_MTP, num_speculative_tokens=1, drafter_qsa_layers=1)
DRAFTER_QSA = "mtp.layers.7.self_attn.attn"


def specs_for_pp(config, pp_size: int) -> dict:
    """Every layer's KV spec as one process of a `pp_size` pipeline collects them:
    the block aligned for `pp_size`, the whole target built on `meta` (and the
    drafter, when the config drafts), BLNHC as QSA selects. Split them per rank
    with split_per_rank."""
    import torch
    import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (qsa imports model)
    import vllm.models.qwen4_exp.nvidia.qsa as qsa
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP
    from vllm.platforms.interface import Platform
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    config.parallel_config.pipeline_parallel_size = pp_size
    config.cache_config.block_size = 16  # CUDA's default before hybrid alignment
    config.cache_config.mamba_page_size_padded = None
    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSAFlashAttentionBackend)
    # Build the whole target (one process), then split its specs per rank.
    config.parallel_config.pipeline_parallel_size = 1
    build_model(config)
    if config.speculative_config is not None:
        draft_config = config.speculative_config.apply_draft_overrides(config)
        with set_current_vllm_config(draft_config), torch.device("meta"):
            Qwen4ExpMTP(vllm_config=draft_config, prefix="")
    specs = get_kv_cache_spec(config)
    config.cache_config.kv_cache_layout = "BLNHC"
    return specs


def split_per_rank(specs: dict, num_layers: int, pp_size: int) -> list[dict]:
    """Each rank's layers (vLLM's get_pp_indices); the drafter's layers, numbered
    after the target's, sit on the last rank."""
    from vllm.distributed.utils import get_pp_indices

    per_rank: list[dict] = [{} for _ in range(pp_size)]
    for name, spec in specs.items():
        index = int(LAYER_INDEX.search(name).group(1))
        for rank in range(pp_size):
            start, end = get_pp_indices(num_layers, rank, pp_size)
            if start <= index < end or (index >= num_layers and rank == pp_size - 1):
                per_rank[rank][name] = spec
    return per_rank


def _specs_with_drafter(model_dir: Path, pp_size: int):
    """(config, specs of target + drafter) with the block aligned for `pp_size`."""
    config = engine_args(
        model_dir, engram_config={"cpu_offload": False}, speculative_config=SPEC
    ).create_engine_config()
    return config, specs_for_pp(config, pp_size)


@pytest.fixture(scope="module")
def offload_env():
    mp = pytest.MonkeyPatch()
    offload_on_cpu(mp)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def real_pp3(offload_env, tmp_path_factory: pytest.TempPathFactory):
    """(block size, per-rank specs, per-rank KVCacheConfigs) at PP=3."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("qwen4_exp_real_shapes_mtp"),
        text_overrides=REAL_SHAPES | MTP,
    )
    config, specs = _specs_with_drafter(model_dir, pp_size=3)
    per_rank = split_per_rank(specs, REAL.num_hidden_layers, 3)
    groups = get_global_kv_cache_groups(config, per_rank)
    configs = get_kv_cache_configs(config, per_rank, [KV_REAL_BYTES] * 3, groups)
    return config.cache_config.block_size, per_rank, configs


def _qsa_group_page(kv_config) -> int:
    """Bytes per block of the rank's QSA group (slot pages + pooled keys)."""
    for group in kv_config.kv_cache_groups:
        if any(n.endswith(".self_attn.attn") for n in group.layer_names):
            specs = group.kv_cache_spec.kv_cache_specs
            return sum(specs[n].page_size_bytes for n in group.layer_names)
    raise AssertionError("no QSA group")


def test_the_drafter_layer_is_a_qsa_layer_of_the_last_rank(real_pp3):
    _, per_rank, _ = real_pp3
    drafter = sorted(n for n in per_rank[2] if n.startswith("mtp."))
    assert drafter == [
        "mtp.layers.48.self_attn.attn",
        "mtp.layers.48.self_attn.indexer.compressed_key_cache",
        "mtp.layers.48.self_attn.indexer.raw_key_cache",
    ]
    qsa = [sum(n.endswith(".self_attn.attn") for n in specs) for specs in per_rank]
    assert qsa == qsa_sizing.qsa_layers_per_rank(REAL, 3) == [4, 4, 5]


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_pp3_last_rank_qsa_page_fits_the_mamba_page(real_pp3):
    block, _, configs = real_pp3
    sizing = qsa_sizing.size_offload(KV_REAL_BYTES, pp_size=3, shape=REAL)
    # Without 0032: 12,224 tokens and a 4,033,920 B page on the last rank.
    assert block == sizing.block_size_tokens == 9776
    assert _qsa_group_page(configs[2]) == sizing.group_page_bytes == 3_226_080
    assert sizing.group_page_bytes <= qsa_sizing.mamba_page_bytes(REAL) == 3_227_648


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_pp3_every_rank_holds_the_planners_blocks(real_pp3):
    block, _, configs = real_pp3
    sizing = qsa_sizing.size_offload(KV_REAL_BYTES, pp_size=3, shape=REAL)
    # Without 0032: 136 on every rank (the last rank's 4,033,920 B blocks).
    assert [c.num_blocks for c in configs] == [sizing.num_blocks] * 3 == [170] * 3
    assert sizing.num_blocks * block == sizing.tokens == 1_661_920
    assert sizing.pool_block_bytes == qsa_sizing.mamba_page_bytes(REAL)


@pytest.fixture(scope="module")
def tiny_pp1(offload_env, tmp_path_factory: pytest.TempPathFactory):
    """(config, KVCacheConfig, forward context) of the tiny model at PP=1, bound;
    the arenas are released afterwards."""
    import torch
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers

    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("tiny-qwen4-exp-qsa-mtp"), text_overrides=TINY_INDEXER | MTP
    )
    config, specs = _specs_with_drafter(model_dir, pp_size=1)
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [KV_TINY_BYTES], groups)
    if config.cache_config.block_size != qsa_sizing.offload_block_size(TINY, 2):
        yield config, kv_config, None  # not worth binding (and stock cannot)
        return
    # Bind on CPU: replace the meta-built layers' storage by real CPU tensors.
    layout = config.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    context = config.compilation_config.static_forward_context
    bind_kv_cache_to_layers(caches, context, 1, kv_cache_groups=kv_config.kv_cache_groups)
    yield config, kv_config, context
    # Unpin (uncount) the arenas: the process-wide tally is checked by later modules.
    for layer in context.values():
        if getattr(layer, "host_arena", None) is not None:
            layer.release_host_arena()


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_pp1_drafter_arena_is_what_the_planner_pins(tiny_pp1):
    config, kv_config, context = tiny_pp1
    pools = host_pools.host_pools(TINY, 1, None, KV_TINY_BYTES, "exact")
    # Without 0032: 1,024-token blocks (one QSA layer counted), 56 blocks.
    assert config.cache_config.block_size == pools.block_tokens == 512
    assert kv_config.num_blocks == pools.num_blocks == 113
    assert context is not None
    drafter = context[DRAFTER_QSA]
    assert drafter.host_arena is not None
    assert drafter.host_arena.nbytes == pools.per_layer_exact_bytes
    assert pools.layers_per_rank == (2,)  # the target's QSA layer and the drafter's
    target = context["language_model.model.layers.3.self_attn.attn"]
    assert target.host_arena.nbytes == drafter.host_arena.nbytes
