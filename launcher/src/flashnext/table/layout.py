"""Where the PLE table's rows lie in a checkpoint: safetensors headers, no tensor data read.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name → dtype, shape, data_offsets relative to the data region), then the data.
Rows of shard i are bytes [data_start + begin, data_start + end) of its file,
row-major, so the flat table is the shards' data regions concatenated in shard order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.facts.model_derived import ple_table_shape
from flashnext.table.errors import TableError
from flashnext.table.file_layout import PACKED, check_layout, table_bytes

# Checkpoint names look like
# model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_17.weight;
# the prefix before `layers.` varies between exports, the tail is what vLLM matches.
SHARD_NAME = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+\.ple)\..*ngram_embedding\.shard_(?P<index>\d+)\.(?P<leaf>\w+)$"
)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit; a bigger value means a corrupt file


@dataclass(frozen=True)
class PleShard:
    index: int
    name: str
    file: str
    """Shard file path relative to the model dir."""
    data_offset_bytes: int
    """Absolute offset of the shard's first row in `file`."""
    rows: int
    row_bytes: int

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class TableLayout:
    model_dir: str
    layer: str
    """Checkpoint prefix of the PLE layer, e.g. model.language_model.layers.1.ple."""
    dtype: str
    dim: int
    shards: tuple[PleShard, ...]

    @property
    def row_bytes(self) -> int:
        return self.dim * DTYPE_BYTES[self.dtype]

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def total_bytes(self) -> int:
        """The rows' bytes as the checkpoint holds them (= the packed file's size)."""
        return table_bytes(self.rows, self.row_bytes, PACKED)

    def file_bytes(self, file_layout: str) -> int:
        """Size of the flat file in `file_layout` (packed or page-aligned)."""
        return table_bytes(self.rows, self.row_bytes, file_layout)

    def shard_start_row(self, index: int) -> int:
        return sum(s.rows for s in self.shards[:index])

    def locate(self, row: int) -> tuple[PleShard, int]:
        """Flat row → (shard, row within shard)."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} outside the table's {self.rows} rows")
        for shard in self.shards:
            if row < shard.rows:
                return shard, row
            row -= shard.rows
        raise AssertionError("unreachable: rows add up")

    def identity(self) -> str:
        """Digest of what the flat file is built from: names, offsets, shapes, file sizes.

        A resumed prepare continues only if this is unchanged, so a partial file
        from another checkpoint (or a re-exported one) is never extended.
        """
        h = hashlib.sha256()
        base = Path(self.model_dir)
        for s in self.shards:
            size = (base / s.file).stat().st_size
            h.update(
                f"{s.name}|{s.file}|{size}|{s.data_offset_bytes}|{s.rows}|{s.row_bytes}\n".encode()
            )
        h.update(f"{self.dtype}|{self.dim}".encode())
        return h.hexdigest()

    def manifest(self, file_layout: str = PACKED) -> dict[str, Any]:
        """What the patched vLLM checks beside the flat file (shape, dtype, layout, bytes)."""
        return {
            "format": "flashnext-ple-table",
            "version": 1,
            "layer": self.layer,
            "dtype": self.dtype,
            "rows": self.rows,
            "dim": self.dim,
            "row_bytes": self.row_bytes,
            "layout": check_layout(file_layout),
            "total_bytes": self.file_bytes(file_layout),
            "shards": len(self.shards),
            "shard_rows": self.shards[0].rows,
            "source_identity": self.identity(),
        }


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header dict, absolute offset of the data region) of one safetensors file."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise TableError(f"{path}: shorter than a safetensors header (8 bytes)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise TableError(f"{path}: header length {length} is not plausible; corrupt file?")
            raw = f.read(length)
    except OSError as exc:
        raise TableError(f"{path}: cannot read ({exc.strerror})") from exc
    if len(raw) != length:
        raise TableError(f"{path}: truncated header ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TableError(f"{path}: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise TableError(f"{path}: header is not a JSON object")
    return header, 8 + length


def _checkpoint_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TableError(
                f"{index}: unreadable or without weight_map ({exc})",
                fix="re-download the checkpoint's model.safetensors.index.json",
            ) from exc
        # Only the files that hold PLE shards are opened: their names say so.
        return sorted({f for n, f in weight_map.items() if SHARD_NAME.match(n)})
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise TableError(
            f"{model_dir}: no model.safetensors.index.json and no *.safetensors files",
            fix="pass --model the checkpoint directory (the one with config.json)",
        )
    return files


def _text_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TableError(
            f"{path}: cannot read ({exc})", fix="pass --model the checkpoint directory"
        ) from exc
    return config.get("text_config", config)


def expected_dim(text_config: dict[str, Any]) -> int | None:
    """Row width (elements) the model expects: ple_embed_dim over the n-gram heads."""
    try:
        heads = (int(text_config["ngram_size"]) - 1) * int(text_config["heads_per_ngram"])
        return int(text_config["ple_embed_dim"]) // heads
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def read_layout(model_dir: str | os.PathLike[str]) -> TableLayout:
    """Find the PLE shards of a checkpoint and check them against its config.json."""
    base = Path(model_dir)
    if not base.is_dir():
        raise TableError(f"{base}: not a directory", fix="pass --model the checkpoint directory")
    text_config = _text_config(base)
    found: dict[int, PleShard] = {}
    layers: set[str] = set()
    dtypes: set[str] = set()
    dims: set[int] = set()
    for file in _checkpoint_files(base):
        header, data_start = read_header(base / file)
        for name, info in header.items():
            m = SHARD_NAME.match(name)
            if not m:
                continue
            if m["leaf"] != "weight":
                raise TableError(
                    f"{file}: {name}: a quantized PLE table ({m['leaf']}) cannot be served "
                    "from a flat file; this kit expects the BF16 table",
                )
            shape = info.get("shape") or []
            dtype = info.get("dtype")
            if len(shape) != 2 or dtype not in DTYPE_BYTES:
                raise TableError(f"{file}: {name}: unexpected shape {shape} / dtype {dtype}")
            begin, end = info["data_offsets"]
            row_bytes = shape[1] * DTYPE_BYTES[dtype]
            if end - begin != shape[0] * row_bytes:
                raise TableError(f"{file}: {name}: data_offsets do not match shape {shape}")
            index = int(m["index"])
            if index in found:
                raise TableError(f"{name} appears twice ({found[index].file} and {file})")
            found[index] = PleShard(index, name, file, data_start + begin, shape[0], row_bytes)
            layers.add(m["layer"])
            dtypes.add(dtype)
            dims.add(shape[1])
    if not found:
        raise TableError(
            f"{base}: no PLE shards (*.ple.*ngram_embedding.shard_N.weight) in the checkpoint",
            fix="check that --model is the Qwen3.8-Flash-Next checkpoint",
        )
    if len(layers) > 1 or len(dtypes) > 1 or len(dims) > 1:
        raise TableError(
            f"PLE shards disagree: layers {sorted(layers)}, dtypes {sorted(dtypes)}, "
            f"widths {sorted(dims)}"
        )
    shards = tuple(found[i] for i in sorted(found))
    missing = sorted(set(range(max(found) + 1)) - set(found))
    parts = text_config.get("split_ngram_parts")
    if missing or (parts is not None and len(shards) != int(parts)):
        raise TableError(
            f"{base}: found {len(shards)} PLE shards, config split_ngram_parts={parts}; "
            f"missing shard indices {missing[:8]}{'...' if len(missing) > 8 else ''}",
            fix="re-download the shard files named in model.safetensors.index.json",
        )
    full = shards[0].rows
    if any(s.rows != full for s in shards[:-1]) or shards[-1].rows > full:
        raise TableError(f"{base}: PLE shards have uneven row counts; only the last may be short")
    dim = dims.pop()
    want_dim = expected_dim(text_config)
    if want_dim is not None and dim != want_dim:
        raise TableError(
            f"{base}: PLE rows are {dim} wide, config.json implies {want_dim} "
            "(ple_embed_dim / ((ngram_size - 1) * heads_per_ngram))"
        )
    layout = TableLayout(str(base), layers.pop(), dtypes.pop(), dim, shards)
    if "ngram_vocab_size_base" in text_config:
        want_rows, _ = ple_table_shape(text_config)
        if layout.rows != want_rows:
            raise TableError(
                f"{base}: the PLE shards hold {layout.rows} rows, config.json implies "
                f"{want_rows} (ngram_vocab_size_base, 16 prime-sized heads, rounded up)",
                fix="the shards and config.json come from different exports: re-download",
            )
    return layout
