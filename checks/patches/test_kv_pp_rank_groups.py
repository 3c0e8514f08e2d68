"""Patch 0002: each PP rank's KV tensors cover only the layers that rank holds.

Real path: the tiny qwen4_exp model is built on `meta`, its attention layers
report their real KV cache specs (GDN state, PLE short-conv state, full
attention), the specs are split over PP=3 with get_pp_indices (the split
make_layers uses), and vLLM's own planner (get_global_kv_cache_groups,
get_kv_cache_configs) plans every rank with the block-outermost BLNHC layout
that QSA selects. `allocate_kv_cache(device="cpu")` then binds each rank.
"""

from __future__ import annotations

import re

import pytest
from tiny_qwen4_exp import NUM_LAYERS, build_model, engine_args, write_tiny_qwen4_exp

PATCH = "0002-kv-cache-tensors-per-pp-rank.patch"
PP_SIZE = 3
KV_MEMORY_BYTES = 64 << 20  # per rank; enough blocks for max_model_len 512
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory):
    """(vllm_config, per-rank specs, per-rank KVCacheConfigs, global groups)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

    model_dir = write_tiny_qwen4_exp(tmp_path_factory.mktemp("tiny-qwen4-exp-kv"))
    config = engine_args(model_dir, engram_config={"cpu_offload": False}).create_engine_config()
    build_model(config)
    specs = get_kv_cache_spec(config)
    # QSA layers force a block-outermost layout; the planner reads it from here.
    config.cache_config.kv_cache_layout = "BLNHC"

    per_rank = []
    for rank in range(PP_SIZE):
        start, end = get_pp_indices(NUM_LAYERS, rank, PP_SIZE)
        per_rank.append(
            {
                name: spec
                for name, spec in specs.items()
                if start <= int(LAYER_INDEX.search(name).group(1)) < end
            }
        )
    groups = get_global_kv_cache_groups(config, per_rank)
    configs = get_kv_cache_configs(config, per_rank, [KV_MEMORY_BYTES] * PP_SIZE, groups)
    return config, per_rank, configs, groups


def test_ple_state_is_a_rank_0_only_group(planned) -> None:
    _, per_rank, configs, groups = planned
    ple = [name for name in per_rank[0] if name.endswith(".ple")]
    assert ple == ["language_model.model.layers.1.ple"]
    assert all(not any(n.endswith(".ple") for n in specs) for specs in per_rank[1:])
    # Projection keeps every group on every rank, so group ids line up.
    assert all(len(c.kv_cache_groups) == len(groups) for c in configs)
    for rank, cfg in enumerate(configs):
        assert sum(len(g.layer_names) for g in cfg.kv_cache_groups) == len(per_rank[rank])


@pytest.mark.proves(PATCH, raises=StopIteration)
@pytest.mark.parametrize("rank", range(PP_SIZE))
def test_allocate_kv_cache_binds_exactly_this_ranks_layers(planned, rank: int) -> None:
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    config, per_rank, configs, _ = planned
    kv_cache_config = configs[rank]
    layout = config.cache_config.get_resolved_kv_cache_layout()

    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)

    assert set(caches) == set(per_rank[rank])
    tensor_layers = [n for t in kv_cache_config.kv_cache_tensors for n in t.layers]
    assert sorted(tensor_layers) == sorted(per_rank[rank])
    backing = {t.untyped_storage().data_ptr() for t in caches.values()}
    assert len(backing) == 1, "all layers of a rank view one allocation"
    for name, view in caches.items():
        assert view.shape[0] == kv_cache_config.num_blocks, name
        spec = per_rank[rank][name]
        assert view[0].numel() * view.element_size() == spec.page_size_bytes, name
