"""Small checkpoints with real safetensors files and random PLE rows.

The writer here is independent of flashnext.table: it lays out its own headers,
so a layout bug in the tools shows up as a byte mismatch, not as agreement
between two copies of the same mistake. Rows are random (seeded), so a wrong
offset cannot pass by comparing zeros with zeros.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

from flashnext.facts.model_derived import ple_shard_rows

DIM = 160
ROW_BYTES = DIM * 2  # BF16


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    shards: int
    rows_per_shard: int
    """Rows of every shard but the last."""
    flat: bytes
    """The expected flat table: shard data in shard order."""

    @property
    def rows(self) -> int:
        return len(self.flat) // ROW_BYTES


def _write_safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, data in tensors:
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for *_, data in tensors:
            f.write(data)


def make_checkpoint(
    path: Path, *, shards: int = 8, vocab_base: int = 128, files: int = 3, seed: int = 0
) -> Checkpoint:
    """A Qwen4Exp-shaped checkpoint dir whose PLE shards are spread over `files` files.

    The table has as many rows as vLLM derives from `ngram_vocab_size_base`
    (16 primes from vocab_base, rounded up to 128), split into `shards` parts;
    the last shard is shorter whenever the split is uneven, as in vLLM.

    Shards go to files round-robin in reverse, so file order != shard order, and
    each file also holds an unrelated tensor before the shards (non-zero offsets).
    """
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    text_config = {
        "model_type": "qwen4_exp_text",
        "ple_layer_ids": [2],
        "ple_embed_dim": DIM * 16,
        "ngram_size": 3,
        "heads_per_ngram": 8,
        "split_ngram_parts": shards,
        "ngram_vocab_size_base": vocab_base,
        "make_ngram_vocab_size_divisible_by": 128,
    }
    config = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": text_config,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    prefix = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
    shard_rows = ple_shard_rows(text_config)
    shard_data = [rng.randbytes(rows * ROW_BYTES) for rows in shard_rows]
    per_file: dict[int, list[tuple[str, str, list[int], bytes]]] = {
        i: [(f"model.language_model.layers.{i}.mlp.gate.weight", "BF16", [4, 8], rng.randbytes(64))]
        for i in range(files)
    }
    for i in reversed(range(shards)):
        per_file[i % files].append(
            (f"{prefix}.shard_{i}.weight", "BF16", [shard_rows[i], DIM], shard_data[i])
        )
    weight_map = {}
    for i, tensors in per_file.items():
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        _write_safetensors(path / name, tensors)
        weight_map.update({t[0]: name for t in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return Checkpoint(path, shards, shard_rows[0], b"".join(shard_data))
