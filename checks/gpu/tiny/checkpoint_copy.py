"""A copy of a sharded safetensors checkpoint with a few float tensors rewritten.

    edited_copy(src, dst, edit, record_name, record)

`edit(reader)` returns {tensor name: new values}; each is written in place
over the tensor's bytes in the copied shard, in the tensor's own dtype (BF16,
F16 or F32), so every header and every other byte stays as it was. DST is
staged beside itself and renamed into place when complete: a failed edit
leaves nothing half-written. Used by narrow_head.py and echo_drafter.py, the
two derived checkpoints of the MTP run (issue 16). Imports: the standard
library, numpy and the launcher's safetensors header reader (launcher/src).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launcher" / "src"))

from flashnext.facts.safetensors import (  # noqa: E402
    SafetensorsError,
    read_safetensors_header,
)

INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = ("BF16", "F16", "F32")


class CheckpointEditError(Exception):
    """The checkpoint cannot be edited as asked (said how to fix it)."""


def to_float32(raw: bytes, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # the high half of a float32
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype="<f2" if dtype == "F16" else "<f4").astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> bytes:
    if dtype == "BF16":  # round to nearest even, as torch's .to(bfloat16)
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).astype("<u2").tobytes()
    return values.astype("<f2" if dtype == "F16" else "<f4").tobytes()


class Reader:
    """Float tensors of a sharded checkpoint by name, as float32 arrays."""

    def __init__(self, root: Path) -> None:
        index = root / INDEX
        if not index.is_file():
            raise CheckpointEditError(
                f"{index} is missing: the source must be a sharded checkpoint"
            )
        self.root = root
        self.weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        self._headers: dict[str, dict[str, Any]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def info(self, name: str):
        """(shard file name, the tensor's header entry)."""
        if name not in self.weight_map:
            raise CheckpointEditError(f"{self.root} has no tensor {name}")
        shard = self.weight_map[name]
        if shard not in self._headers:
            try:
                _, _, tensors = read_safetensors_header(self.root / shard)
            except SafetensorsError as exc:
                raise CheckpointEditError(str(exc)) from exc
            self._headers[shard] = {t.name: t for t in tensors}
        tensor = self._headers[shard][name]
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointEditError(f"{name} is {tensor.dtype}: only {FLOAT_DTYPES} are edited")
        return shard, tensor

    def read(self, name: str) -> np.ndarray:
        shard, tensor = self.info(name)
        with (self.root / shard).open("rb") as f:
            f.seek(tensor.offset_bytes)
            raw = f.read(tensor.nbytes)
        return to_float32(raw, tensor.dtype).reshape(tensor.shape)


def edited_copy(
    src: Path,
    dst: Path,
    edit: Callable[[Reader], Mapping[str, np.ndarray]],
    record_name: str,
    record: Mapping[str, Any],
) -> Path:
    """Copy SRC to DST with edit(reader)'s tensors rewritten, plus a JSON record."""
    if dst.exists():
        raise CheckpointEditError(f"{dst} exists: remove it or pick another destination")
    reader = Reader(src)
    changes = dict(edit(reader))
    for name, values in changes.items():
        _, tensor = reader.info(name)
        if tuple(values.shape) != tuple(tensor.shape):
            raise CheckpointEditError(f"{name}: new shape {values.shape}, stored {tensor.shape}")

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        for path in src.iterdir():
            if path.is_file():
                shutil.copy2(path, staging / path.name)
        for name, values in changes.items():
            shard, tensor = reader.info(name)
            with (staging / shard).open("r+b") as f:
                f.seek(tensor.offset_bytes)
                f.write(from_float32(values, tensor.dtype))
        (staging / record_name).write_text(json.dumps(dict(record), indent=2) + "\n")
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst
