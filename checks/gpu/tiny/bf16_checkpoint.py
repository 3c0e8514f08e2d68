"""Test helper: small sharded BF16 safetensors checkpoints, framed by hand
(numpy has no bfloat16), for the checkpoint-editing tools' tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from checkpoint_copy import INDEX, to_float32


def bf16_exact(values) -> np.ndarray:
    """float32 values with the low 16 bits cleared: exact in BF16."""
    return (np.asarray(values, np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)


def write_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """One BF16 safetensors file; every value must be exact in BF16."""
    header, blobs, offset = {}, [], 0
    for name, values in tensors.items():
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        assert not (bits & 0xFFFF).any(), f"{name} is not exact in BF16"
        data = (bits >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(values.shape),
                        "data_offsets": [offset, offset + len(data)]}  # fmt: skip
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))


def write_checkpoint(root: Path, shards: dict[str, dict[str, np.ndarray]]) -> Path:
    """A sharded checkpoint: {shard file name: {tensor name: values}} plus its index."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        write_shard(root / shard, tensors)
        weight_map |= dict.fromkeys(tensors, shard)
    (root / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return root


def read_bf16(path: Path, name: str) -> np.ndarray:
    blob = path.read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + size])
    begin, end = header[name]["data_offsets"]
    return to_float32(blob[8 + size + begin : 8 + size + end], "BF16").reshape(
        header[name]["shape"]
    )
