"""Patch 0004: embed_tokens, lm_head and the HC projections honour quant_config.

The tiny qwen4_exp gets a compressed-tensors config shaped like the shipped
checkpoint's groups: embed_tokens, lm_head and HC input_mix_weight_down INT8
(group 128), block_inject_weight left BF16. The real model is built on CPU
and loads a real safetensors file with the checkpoint's tensor names.

One stand-in: compressed-tensors asks for a WNA16 GEMM kernel while creating
the weights; a 3090 gets Marlin, which refuses to construct without CUDA. The
stand-in is Marlin with its CUDA check answered yes; no GEMM is ever run.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_qwen4_exp import (
    NUM_LAYERS,
    TEXT_CONFIG,
    build_model,
    engine_args,
    write_tiny_qwen4_exp,
)

PATCH = "0004-qwen4-exp-quantized-embed-head-hc.patch"
INT8_G128 = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 128,
    "dynamic": False,
    "actorder": None,
    "observer": "minmax",
}
QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "hc_embed_head_int8": {
            # Explicit patterns (SPEC row L: repeated ["Linear"] targets collide).
            "targets": ["re:.*embed_tokens$", "re:.*lm_head$", "re:.*input_mix_weight_down$"],
            "weights": INT8_G128,
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    },
    "ignore": [],
}
HC = "language_model.model.layers.0.attn_hyper_connection"


@pytest.fixture(scope="module")
def marlin_standin():
    from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16,
    )

    class MarlinAsOnSm86(MarlinLinearKernel):
        @classmethod
        def can_implement(cls, c):
            return True, None

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compressed_tensors_wNa16, "choose_mp_linear_kernel", lambda c: MarlinAsOnSm86)
        yield


@pytest.fixture(scope="module")
def quant_config(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("tiny-qwen4-exp-ct"), quantization_config=QUANT_CONFIG
    )
    return engine_args(model_dir, engram_config={"cpu_offload": False}).create_engine_config()


@pytest.fixture(scope="module")
def quant_model(quant_config, marlin_standin):
    return build_model(quant_config, device="cpu")


def _method(module) -> str:
    return type(getattr(module, "quant_method", None)).__name__


def _hc_modules(model):
    layers = model.language_model.model.layers
    for layer in layers:
        yield layer.attn_hyper_connection
        yield layer.mlp_hyper_connection


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_embed_and_lm_head_get_their_quant_methods(quant_model) -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsWNA16,
    )

    lm = quant_model.language_model
    assert _method(lm.model.embed_tokens) == "CompressedTensorsEmbeddingWNA16Int"
    assert _method(lm.lm_head) == "CompressedTensorsLinearMethod"
    assert isinstance(lm.lm_head.scheme, CompressedTensorsWNA16)
    assert lm.lm_head.weight_packed.dtype.is_floating_point is False


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_hc_down_and_inject_are_two_linears_with_their_own_schemes(quant_model) -> None:
    import torch

    hcs = list(_hc_modules(quant_model))
    assert len(hcs) == 2 * NUM_LAYERS
    for hc in hcs:
        assert not hasattr(hc, "input_mix_weight_down_block_inject")
        assert _method(hc.input_mix_weight_down) == "CompressedTensorsLinearMethod"
        assert hc.input_mix_weight_down.weight_packed.dtype == torch.int32
        assert _method(hc.block_inject_weight) == "UnquantizedLinearMethod"
        assert hc.block_inject_weight.weight.dtype == torch.bfloat16
    mixer = quant_model.language_model.model.hyper_connection_mixer
    assert _method(mixer.input_mix_weight_down) == "CompressedTensorsLinearMethod"


def _int8_g128(rows: int, cols: int, scale_dtype) -> dict[str, object]:
    """compressed-tensors pack-quantized INT8: 4 values per int32, one scale per 128."""
    import torch

    gen = torch.Generator().manual_seed(rows * 7919 + cols)
    return {
        "weight_packed": torch.randint(0, 2**30, (rows, cols // 4), generator=gen).int(),
        "weight_scale": torch.rand((rows, cols // 128), generator=gen).to(scale_dtype),
        "weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
    }


def _checkpoint_tensors() -> dict[str, object]:
    """The tiny checkpoint's tensors under their HF names (shapes from the config)."""
    import torch

    hidden, vocab = TEXT_CONFIG["hidden_size"], TEXT_CONFIG["vocab_size"]
    hc_in = hidden * TEXT_CONFIG["hc_count"]
    hc = "model.language_model.layers.0.attn_hyper_connection"
    parts = {
        f"{hc}.input_mix_weight_down": _int8_g128(TEXT_CONFIG["hc_lowrank"], hc_in, torch.bfloat16),
        "model.language_model.embed_tokens": _int8_g128(vocab, hidden, torch.float32),
        "lm_head": _int8_g128(vocab, hidden, torch.float32),
    }
    tensors = {f"{m}.{t}": v for m, group in parts.items() for t, v in group.items()}
    tensors[f"{hc}.block_inject_weight.weight"] = torch.rand(
        (TEXT_CONFIG["hc_count"], hc_in), generator=torch.Generator().manual_seed(1)
    ).to(torch.bfloat16)
    return tensors


@pytest.mark.proves(PATCH, raises=ValueError)
def test_checkpoint_names_load_into_the_split_modules(quant_model, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    tensors = _checkpoint_tensors()
    shard = tmp_path / "model-00001-of-00001.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(shard))

    loaded = quant_model.load_weights(
        safetensors_weights_iterator([str(shard)], use_tqdm_on_load=False)
    )

    hc = quant_model.language_model.model.layers[0].attn_hyper_connection
    expected = {
        f"{HC}.input_mix_weight_down.weight_packed": hc.input_mix_weight_down.weight_packed,
        f"{HC}.input_mix_weight_down.weight_scale": hc.input_mix_weight_down.weight_scale,
        f"{HC}.block_inject_weight.weight": hc.block_inject_weight.weight,
        "language_model.model.embed_tokens.weight_packed": (
            quant_model.language_model.model.embed_tokens.weight_packed
        ),
        "language_model.lm_head.weight_packed": quant_model.language_model.lm_head.weight_packed,
    }
    assert set(expected) <= set(loaded), sorted(set(expected) - set(loaded))
    hf = "model.language_model.layers.0.attn_hyper_connection"
    assert torch.equal(
        expected[f"{HC}.input_mix_weight_down.weight_packed"],
        tensors[f"{hf}.input_mix_weight_down.weight_packed"],
    )
    assert torch.equal(
        expected[f"{HC}.block_inject_weight.weight"], tensors[f"{hf}.block_inject_weight.weight"]
    )
    assert torch.equal(
        expected["language_model.lm_head.weight_packed"], tensors["lm_head.weight_packed"]
    )


def test_unquantized_model_keeps_the_merged_hc_linear(tmp_path_factory) -> None:
    """Without quant_config the stock merged layout (and sm90 fused kernel) stays."""
    model_dir = write_tiny_qwen4_exp(tmp_path_factory.mktemp("tiny-qwen4-exp-bf16"))
    config = engine_args(model_dir, engram_config={"cpu_offload": False}).create_engine_config()
    model = build_model(config)
    for hc in _hc_modules(model):
        assert _method(hc.input_mix_weight_down_block_inject) == "UnquantizedLinearMethod"
        assert not hasattr(hc, "block_inject_weight")


@pytest.fixture
def pp_rank(monkeypatch: pytest.MonkeyPatch):
    """Build as PP rank r of 3 sees it: the PP group is the multi-GPU fact replayed."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.models.qwen4_exp.nvidia.model as qwen4_exp_model

    def set_rank(rank: int) -> None:
        group = SimpleNamespace(
            rank_in_group=rank, world_size=3, is_first_rank=rank == 0, is_last_rank=rank == 2
        )
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group)
        monkeypatch.setattr(qwen4_exp_model, "get_pp_group", lambda: group)

    return set_rank


@pytest.mark.proves(PATCH, raises=AssertionError)
@pytest.mark.parametrize("rank", [0, 1, 2])
def test_embed_only_on_first_rank_lm_head_only_on_last(
    quant_config, marlin_standin, pp_rank, rank: int
) -> None:
    from vllm.model_executor.models.utils import PPMissingLayer

    pp_rank(rank)
    lm = build_model(quant_config).language_model

    assert isinstance(lm.model.embed_tokens, PPMissingLayer) == (rank != 0)
    assert isinstance(lm.lm_head, PPMissingLayer) == (rank != 2)


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_mtp_drafter_gets_the_same_treatment(tmp_path: Path, marlin_standin) -> None:
    import torch
    from tiny_qwen4_exp import ensure_single_process_distributed
    from vllm.config import set_current_vllm_config

    model_dir = write_tiny_qwen4_exp(
        tmp_path / "tiny-qwen4-exp-mtp",
        text_overrides={"mtp_num_hidden_layers": 1},
        quantization_config=QUANT_CONFIG,
    )
    config = engine_args(
        model_dir,
        engram_config={"cpu_offload": False},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    with set_current_vllm_config(config):
        ensure_single_process_distributed()
        from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

        with torch.device("meta"):
            mtp = Qwen4ExpMTP(vllm_config=config, prefix="")

    assert _method(mtp.model.embed_tokens) == "CompressedTensorsEmbeddingWNA16Int"
    assert _method(mtp.lm_head) == "CompressedTensorsLinearMethod"
    hc = mtp.model.layers[0].attn_hyper_connection
    assert _method(hc.input_mix_weight_down) == "CompressedTensorsLinearMethod"
    assert _method(hc.block_inject_weight) == "UnquantizedLinearMethod"
    assert _method(mtp.model.hyper_connection_mixer.input_mix_weight_down) == (
        "CompressedTensorsLinearMethod"
    )
