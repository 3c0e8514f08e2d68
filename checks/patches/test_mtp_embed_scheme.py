"""Patch 0033: the MTP drafter's embedding takes the scheme of the tensors it loads.

The drafter has no embedding of its own in the checkpoint: it loads the
target's (`model.language_model.embed_tokens.*`, INT8 g128 pack-quantized in
the shipped checkpoint). Its quant config ignores every `mtp.*` module (the
skeleton writes `re:^mtp\\..*`, flashnext/skeleton/inventory.py, as the MTP
layer ships BF16), so under the name "mtp.embed_tokens" vLLM builds a BF16
table that the packed tensors cannot load into. The real drafter
(`Qwen4ExpMTP`) of the tiny qwen4_exp with one MTP layer is built on CPU
under that config and loads the checkpoint's embedding tensors.

One stand-in, as in test_quant_embed_head_hc.py: Marlin with its CUDA check
answered yes (compressed-tensors asks for a GEMM kernel while creating the
weights); no GEMM runs.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from test_quant_embed_head_hc import QUANT_CONFIG, _int8_g128, _method, marlin_standin  # noqa: F401
from tiny_qwen4_exp import (
    TEXT_CONFIG,
    engine_args,
    ensure_single_process_distributed,
    write_tiny_qwen4_exp,
)

PATCH = "0033-qwen4-exp-mtp-embed-target-scheme.patch"
EMBED = "model.language_model.embed_tokens"


@pytest.mark.proves(PATCH, raises=ValueError)
def test_the_drafter_loads_the_targets_int8_embedding_under_an_mtp_ignore(
    tmp_path: Path,
    marlin_standin,  # noqa: F811
) -> None:
    import torch
    from vllm.config import set_current_vllm_config

    quant = copy.deepcopy(QUANT_CONFIG)
    quant["ignore"] = [r"re:^mtp\..*"]  # the MTP layer ships BF16
    model_dir = write_tiny_qwen4_exp(
        tmp_path / "tiny-qwen4-exp-mtp-int8-embed",
        text_overrides={"mtp_num_hidden_layers": 1},
        quantization_config=quant,
    )
    config = engine_args(
        model_dir,
        engram_config={"cpu_offload": False},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    tensors = _int8_g128(TEXT_CONFIG["vocab_size"], TEXT_CONFIG["hidden_size"], torch.float32)
    with set_current_vllm_config(config):
        ensure_single_process_distributed()
        from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

        with torch.device("cpu"):
            drafter = Qwen4ExpMTP(vllm_config=config, prefix="")
        loaded = drafter.load_weights(iter({f"{EMBED}.{k}": v for k, v in tensors.items()}.items()))

    embed = drafter.model.embed_tokens
    assert _method(embed) == "CompressedTensorsEmbeddingWNA16Int"
    assert {f"model.embed_tokens.{k}" for k in tensors} <= loaded
    assert torch.equal(embed.weight_packed.data, tensors["weight_packed"])
    # The drafter's own layers still follow the ignore: its fc stays BF16.
    assert _method(drafter.model.fc_embedding) == "UnquantizedLinearMethod"
