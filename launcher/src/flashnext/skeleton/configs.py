"""The JSON files of a Qwen3.8-Flash-Next INT4-mixed checkpoint: config, quantization, generation.

Full = the shipped config as SPEC.md describes it. Tiny = the same
architecture at toy size, shaped so that vLLM 0.33.0's config path accepts it
on a CPU machine (see CPU_TESTING.md) and every quantized Linear's input width
divides its group size.

The quantization_config reproduces the export defect: four config_groups
whose targets are all ["Linear"] (vLLM keys its scheme map by target, so the
last group, INT8 g128, wins for every Linear). The fixed metadata is not
spelled out here: `flashnext.skeleton` derives it from this one with the code
`checkpoint fix` runs. `generation_config(fixed_metadata=True)` adds sampling
keys.
"""

from __future__ import annotations

import copy
from typing import Any

# Dtype of the checkpoint's unquantized tensors and of every scale.
TORCH_DTYPE = "bfloat16"

# ---------------------------------------------------------------- text configs

_FULL_TEXT: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "hidden_size": 2560,
    "num_hidden_layers": 48,
    "full_attention_interval": 4,
    "num_attention_heads": 24,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "hidden_act": "silu",
    "output_gate_type": "sigmoid",
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 640,
    "shared_expert_intermediate_size": 640,
    "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001,
    "hc_count": 4,
    "hc_lowrank": 320,
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 128,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    "ple_layer_ids": [2],
    "ple_embed_dim": 2560,
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "split_ngram_parts": 128,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "bos_token_id": 248044,
    "eos_token_id": 248044,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "dtype": TORCH_DTYPE,
}

# Toy sizes. Constraints honoured (vLLM 0.33.0 / transformers 5.20 validation):
# rotary dim (head_dim x 0.25 = 16) <= indexer_head_dim, mrope_section sums to
# rotary_dim / 2, indexer_budget % indexer_compress_ratio == 0, eos_token_id set
# because ple_layer_ids is, PLE on a linear-attention layer, and every quantized
# Linear's input width a multiple of its group size (128, or 64 for the HC up mix).
_TINY_TEXT_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10_000_000,
        "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    # CPU_TESTING.md: the tiny model instantiates on CPU/meta with "silu".
    "output_gate_type": "silu",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "hc_lowrank": 64,
    "indexer_n_heads": 2,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "ple_embed_dim": 128,
    "heads_per_ngram": 2,
    "split_ngram_parts": 4,
    "ngram_vocab_size_base": 1000,
    "vocab_size": 1024,
    # The real model's context: plans of the shipped profile (262,144 tokens) fit it.
    "max_position_embeddings": 262144,
    "bos_token_id": 1023,
    "eos_token_id": 1023,
}


def _layer_types(num_layers: int, interval: int) -> list[str]:
    # As published: "full_attention" marks the QSA layers (transformers maps it
    # to "indexed_attention"; vLLM accepts both spellings).
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def _with_layer_types(text: dict[str, Any]) -> dict[str, Any]:
    if "layer_types" not in text:
        text["layer_types"] = _layer_types(
            int(text["num_hidden_layers"]), int(text["full_attention_interval"])
        )
    return text


def full_text_config() -> dict[str, Any]:
    """text_config of the shipped Qwen3.8-Flash-Next config.json."""
    return _with_layer_types(copy.deepcopy(_FULL_TEXT))


# Overrides that turn QSA off (plain gated attention on the full-attention
# layers): vLLM's QSA needs FlashAttention, so a model built on CPU must drop it.
QSA_OFF: dict[str, None] = dict.fromkeys(
    (
        "indexer_n_heads",
        "indexer_kv_heads",
        "indexer_head_dim",
        "indexer_budget",
        "indexer_compress_ratio",
    )
)


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """A tiny text_config vLLM 0.33.0 accepts.

    `overrides` replace keys; a key given as None is removed (`**QSA_OFF`).
    layer_types is recomputed from num_hidden_layers / full_attention_interval
    unless given.
    """
    text = copy.deepcopy(_FULL_TEXT)
    text.update(copy.deepcopy(_TINY_TEXT_OVERRIDES))
    text.update(copy.deepcopy(overrides))
    text = {k: v for k, v in text.items() if v is not None}
    return _with_layer_types(text)


# ---------------------------------------------------------------- vision tower

_FULL_VISION: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2560,
    "num_position_embeddings": 2304,
    "initializer_range": 0.02,
}

_TINY_VISION_OVERRIDES: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 2,
    "out_hidden_size": 128,
    "num_position_embeddings": 16,
}


def model_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """config.json around a text and a vision config (quantization_config added by the writer)."""
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
        "dtype": TORCH_DTYPE,
    }


def full_vision_config() -> dict[str, Any]:
    return copy.deepcopy(_FULL_VISION)


def tiny_vision_config(text: dict[str, Any]) -> dict[str, Any]:
    vision = copy.deepcopy(_FULL_VISION)
    vision.update(_TINY_VISION_OVERRIDES)
    vision["out_hidden_size"] = int(text["hidden_size"])
    return vision


def tiny_config(**text_overrides: Any) -> dict[str, Any]:
    """config.json (without quantization_config) of the tiny variant."""
    text = tiny_text_config(**text_overrides)
    cfg = model_config(text, tiny_vision_config(text))
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        # Keep the special ids inside the toy vocabulary, clear of eos (vocab - 1).
        cfg[key] = int(text["vocab_size"]) - 8 + (cfg[key] - 248053)
    return cfg


def full_config() -> dict[str, Any]:
    return model_config(full_text_config(), full_vision_config())


# ---------------------------------------------------------------- quantization

# Scheme names used by the inventory; each maps to one config group.
# (bits, group size). Order = the order of config_groups in the export, so the
# last one (INT8 g128) is the one vLLM keeps when every target is "Linear".
SCHEMES: dict[str, tuple[int, int]] = {
    "int4_g128": (4, 128),  # routed experts
    "int6_g128": (
        6,
        128,
    ),  # dense: linear_attn, self_attn (+ indexer), shared expert, PLE projections
    "int8_g64": (
        8,
        64,
    ),  # HC input_mix_weight_up: in_features = hc_lowrank = 320, not a multiple of 128
    "int8_g128": (8, 128),  # HC input_mix_weight_down, embed_tokens, lm_head
}


def _weight_args(bits: int, group: int) -> dict[str, Any]:
    return {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "group_size": group,
        "strategy": "group",
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """compressed-tensors quantization_config as exported (every target "Linear"); `ignore`
    lists the unquantized Linear modules. The fixed one is derived from it by `checkpoint
    fix`'s own code (`flashnext.skeleton.repaired_quantization_config`)."""
    groups = {}
    for i, (bits, group) in enumerate(SCHEMES.values()):
        groups[f"group_{i}"] = {
            "targets": ["Linear"],
            "weights": _weight_args(bits, group),
            "input_activations": None,
            "output_activations": None,
            "format": "pack-quantized",
        }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


# ---------------------------------------------------------------- generation config


def generation_config(text: dict[str, Any], *, fixed_metadata: bool) -> dict[str, Any]:
    """generation_config.json; as exported it has no sampling keys (SPEC defect 2).

    The fixed values are representative Qwen sampling defaults, NOT the values
    of the published checkpoint (which cannot be verified here); `checkpoint
    fix` must take its values from the user or the model card.
    """
    gen: dict[str, Any] = {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["eos_token_id"],
    }
    if fixed_metadata:
        gen.update({"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20})
    return gen
