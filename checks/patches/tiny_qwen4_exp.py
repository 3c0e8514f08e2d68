"""A tiny but real qwen4_exp checkpoint directory for the patch proofs.

Shapes are cut down so configs and models build in seconds on CPU; the
structure is the shipped one: the same architecture and config classes, a
[linear x3, full] layer pattern, hyper-connections (hc_count 4), MoE, and PLE
at `ple_layer_ids=[2]` (one-based, i.e. decoder layer 1). Seven layers split
over PP=3 as (0,2), (2,5), (5,7), so PLE lands on rank 0 by default.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

NUM_LAYERS = 7
PLE_LAYER = 1  # zero-based decoder index of ple_layer_ids=[2]

TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    # As shipped (skeleton/configs.py) and as qsa_sizing assumes: fp32 SSM state.
    # Without it vLLM's "auto" follows the host CPU: the CPU platform forces
    # float32 only where torch reports AVX512-BF16, else the state is bf16 and
    # the GDN page (and every QSA block size derived from it) halves.
    "mamba_ssm_dtype": "float32",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "hc_count": 4,
    "hc_lowrank": 32,
    "ple_layer_ids": [PLE_LAYER + 1],
    "ple_embed_dim": 128,  # 16 n-gram heads x 8
    "ngram_vocab_size_base": 1000,
    "split_ngram_parts": 4,
    # vLLM needs eos_token_id with PLE (EOS resets the n-gram history).
    "eos_token_id": 1,
    "bos_token_id": 1,
    # The shipped "sigmoid" gate is not accepted by transformers' config class.
    "output_gate_type": "silu",
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

VISION_CONFIG: dict[str, Any] = {
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 128,
    # No deepstack: a non-first PP rank asserts start_layer >= len(indexes).
    "deepstack_visual_indexes": [],
}


def write_tiny_qwen4_exp(
    directory: Path,
    *,
    text_overrides: dict[str, Any] | None = None,
    quantization_config: dict[str, Any] | None = None,
) -> Path:
    """Write config.json (via transformers' own Qwen4ExpConfig) into directory."""
    from transformers import Qwen4ExpConfig

    config = Qwen4ExpConfig(
        text_config={**TEXT_CONFIG, **(text_overrides or {})},
        vision_config=VISION_CONFIG,
        architectures=["Qwen4ExpForConditionalGeneration"],
        tie_word_embeddings=False,
    )
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    if quantization_config is not None:
        path = directory / "config.json"
        data = json.loads(path.read_text())
        data["quantization_config"] = quantization_config
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)
    return directory


def engine_args(model_dir: Path, **overrides: Any):
    """EngineArgs for the CPU platform, as CPU_TESTING.md measured them."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "load_format": "dummy",
        "max_model_len": 512,
        "enforce_eager": True,
        "language_model_only": True,
    }
    kwargs.update(overrides)
    return EngineArgs(**kwargs)


_distributed_owned = False  # set when ensure_single_process_distributed set it up


def ensure_single_process_distributed() -> None:
    """World size 1 over gloo, as a PP=1 CPU worker has; kept until released."""
    import tempfile

    from vllm.distributed import (
        init_distributed_environment,
        initialize_model_parallel,
        parallel_state,
    )

    global _distributed_owned
    if parallel_state.model_parallel_is_initialized():
        return
    fd, init_file = tempfile.mkstemp(prefix="flashnext-dist-")
    os.close(fd)
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"file://{init_file}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    _distributed_owned = True


def release_single_process_distributed() -> None:
    """Undo ensure_single_process_distributed, so other modules may set up their own."""
    global _distributed_owned
    if not _distributed_owned:
        return
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    _distributed_owned = False


def build_model(vllm_config, device: str = "meta"):
    """Instantiate the real Qwen4ExpForConditionalGeneration (no weights, no forward).

    Runs inside set_current_vllm_config, which also registers the attention
    layers in the config's static forward context (the KV cache spec source).
    """
    import torch
    from vllm.config import set_current_vllm_config

    # A config builds one model: layers register their names in it.
    vllm_config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vllm_config):
        ensure_single_process_distributed()
        from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration

        with torch.device(device):
            return Qwen4ExpForConditionalGeneration(vllm_config=vllm_config, prefix="")
