"""Patch 0020: QSA block size under K/V offload, on the real vLLM 0.33.0 code.

Runs `Platform._align_hybrid_block_size` (platforms/interface.py) on a
config.json with the shipped text shapes (48 layers, [linear x3, full] x 12,
GDN state 3,207,168 B) and the QSA backend, as the CUDA platform does after
picking its 16-token default. PP=3 is set on the parallel config directly so
the stock tree fails on G (block size), not on the PP refusal (patch 0001).
The launcher's planner arithmetic (flashnext.plan.qsa_sizing) must give the same
numbers: the test imports it from launcher/src.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_qwen4_exp import engine_args, write_tiny_qwen4_exp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.plan import qsa_sizing  # noqa: E402
from flashnext.skeleton.configs import full_text_config  # noqa: E402

PATCH = "0020-qsa-offload-block-size.patch"

# The shipped text_config's shapes that the block arithmetic reads, from the
# launcher's skeleton (the one place the kit writes them down).
_SHIPPED = full_text_config()
REAL_SHAPES = {
    key: _SHIPPED[key]
    for key in (
        "hidden_size", "num_hidden_layers", "full_attention_interval",
        "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "indexer_n_heads",
        "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio",
        "mamba_ssm_dtype", "hc_count", "hc_lowrank",
    )
} | {"partial_rotary_factor": _SHIPPED["rope_parameters"]["partial_rotary_factor"]}  # fmt: skip


@pytest.fixture(scope="module")
def real_config(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("qwen4_exp_real_shapes"), text_overrides=REAL_SHAPES
    )
    return engine_args(model_dir).create_engine_config()


def _align(config, pp_size: int) -> tuple[int, int | None]:
    """Block size and padded mamba page after the stock/patched alignment."""
    from vllm.models.qwen4_exp.nvidia.qsa import Qwen4ExpQSAFlashAttentionBackend
    from vllm.platforms.interface import Platform

    config.parallel_config.pipeline_parallel_size = pp_size
    cache = config.cache_config
    cache.block_size = 16  # CUDA's default before hybrid alignment
    cache.mamba_page_size_padded = None
    Platform._align_hybrid_block_size(config, Qwen4ExpQSAFlashAttentionBackend)
    return cache.block_size, cache.mamba_page_size_padded


def test_stock_sizing_matches_the_planner_formula(real_config, monkeypatch):
    """Offload off: both trees give the report's 1568 tokens / 3,211,264 B page."""
    monkeypatch.delenv("VLLM_QSA_KV_OFFLOAD", raising=False)
    block, padded = _align(real_config, pp_size=3)
    shape = qsa_sizing.QsaShape()
    assert block == qsa_sizing.stock_block_size(shape) == 1568
    assert padded == block * qsa_sizing.kv_bytes_per_token(shape) == 3_211_264


def test_mamba_page_matches_the_planner_formula(real_config):
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration

    specs = Qwen4ExpForConditionalGeneration.get_mamba_specs_from_config(real_config)
    assert max(s.page_size_bytes for s in specs) == qsa_sizing.mamba_page_bytes(
        qsa_sizing.QsaShape()
    )


@pytest.mark.proves(PATCH)
def test_offload_block_size_is_sized_from_vram_bytes(real_config, monkeypatch):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    block, padded = _align(real_config, pp_size=3)
    assert block == 12_144
    assert padded is None  # the mamba page is no longer padded
    sizing = qsa_sizing.size_offload(550_000_000, pp_size=3)
    assert block == sizing.block_size_tokens
    # The seed's figures, from the same block size.
    assert (sizing.num_blocks, sizing.tokens) == (171, 2_076_624)
    assert round(sizing.host_bytes_per_layer / 2**30, 3) == 3.961


@pytest.mark.proves(PATCH)
@pytest.mark.parametrize("pp_size,partition", [(1, None), (2, None), (3, "20,16,12")])
def test_offload_block_size_follows_the_pp_partition(real_config, monkeypatch, pp_size, partition):
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    if partition:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    else:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    block, _ = _align(real_config, pp_size=pp_size)
    counts = [int(n) for n in partition.split(",")] if partition else None
    busiest = max(qsa_sizing.qsa_layers_per_rank(qsa_sizing.QsaShape(), pp_size, counts))
    assert block == qsa_sizing.offload_block_size(qsa_sizing.QsaShape(), busiest)


@pytest.mark.proves(PATCH)
def test_offload_knobs_are_registered_and_default_off(monkeypatch):
    import vllm.envs as envs

    for name in (
        "VLLM_QSA_KV_OFFLOAD",
        "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES",
        "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS",
    ):
        monkeypatch.delenv(name, raising=False)
        assert name in envs.environment_variables
    assert envs.VLLM_QSA_KV_OFFLOAD is False
    assert envs.VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES == 0
    assert envs.VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS == 16384


@pytest.mark.proves(PATCH)
def test_offload_on_a_model_without_qsa_layers_warns_and_keeps_stock_sizing(tmp_path, monkeypatch):
    """A config without indexer settings builds plain attention layers, so
    there is no QSA K/V to offload: the flag is ignored with a warning (seen
    on an H200: `TypeError: int() argument must be ... not 'NoneType'` from
    the page layout reading indexer_compress_ratio), and the block size is
    stock's."""
    import logging

    config = engine_args(write_tiny_qwen4_exp(tmp_path / "no-indexer")).create_engine_config()
    monkeypatch.delenv("VLLM_QSA_KV_OFFLOAD", raising=False)
    stock = _align(config, pp_size=1)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD", "1")
        assert _align(config, pp_size=1) == stock
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert any("VLLM_QSA_KV_OFFLOAD=1 is ignored" in w for w in warnings), warnings
