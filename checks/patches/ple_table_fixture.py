"""A tiny qwen4_exp checkpoint with real PLE table shards, and its flat table file.

The shards are random BF16 rows saved with safetensors under the checkpoint's
real names (model.language_model.layers.1.ple.ple_embedding.ngram_embedding.
shard_<i>.weight), next to one unrelated tensor in the same file, so a loader
that skips the table must skip tensor by tensor, not file by file. The flat
file is the shards concatenated in shard order: what `flashnext table prepare`
writes (checks/table proves that part byte for byte).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_qwen4_exp import PLE_LAYER, write_tiny_qwen4_exp

SHARD_NAME = (
    f"model.language_model.layers.{PLE_LAYER}.ple.ple_embedding.ngram_embedding.shard_{{}}.weight"
)
OTHER_NAME = f"model.language_model.layers.{PLE_LAYER}.ple.norm_key.weight"


@dataclass
class PleTable:
    model_dir: Path
    table_path: Path
    shard_file: Path
    rows: int
    dim: int
    heads: int
    shards: list[Any]
    """The shard tensors (torch, BF16) as saved."""


def table_geometry(text_config: Any) -> tuple[int, int, int, list[int]]:
    """(rows, dim, heads, rows per shard) exactly as vLLM's Qwen4ExpNGramEmbedding derives them."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
    from vllm.utils.math_utils import round_up

    heads = (int(text_config.ngram_size) - 1) * int(text_config.heads_per_ngram)
    _, _, total = Qwen4ExpNGramEmbedding._make_vocab_layout(
        ngram_vocab_size_base=int(text_config.ngram_vocab_size_base),
        ngram_heads=heads,
        ple_dense_layer_id=0,
    )
    rows = round_up(total, int(text_config.make_ngram_vocab_size_divisible_by))
    parts = int(text_config.split_ngram_parts)
    per = -(-rows // parts)
    shard_rows = [max(0, min(per, rows - i * per)) for i in range(parts)]
    return rows, int(text_config.ple_embed_dim) // heads, heads, shard_rows


def write_ple_table(directory: Path, *, seed: int = 0, **text_overrides: Any) -> PleTable:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    model_dir = write_tiny_qwen4_exp(directory / "model", text_overrides=text_overrides)
    text_config = AutoConfig.from_pretrained(model_dir).text_config
    rows, dim, heads, shard_rows = table_geometry(text_config)
    gen = torch.Generator().manual_seed(seed)
    shards = [torch.randn(n, dim, generator=gen).to(torch.bfloat16) for n in shard_rows]
    tensors = {SHARD_NAME.format(i): s for i, s in enumerate(shards)}
    # A real PLE weight ([hidden x hc_count] norm), loaded as usual.
    width = int(text_config.hidden_size) * int(text_config.hc_count)
    tensors[OTHER_NAME] = torch.ones(width, dtype=torch.bfloat16)
    shard_file = model_dir / "model-00001-of-00001.safetensors"
    save_file(tensors, str(shard_file))
    index = {"metadata": {}, "weight_map": {name: shard_file.name for name in tensors}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    table_path = directory / "ple.bin"
    with table_path.open("wb") as f:
        for shard in shards:
            f.write(shard.view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return PleTable(model_dir, table_path, shard_file, rows, dim, heads, shards)
