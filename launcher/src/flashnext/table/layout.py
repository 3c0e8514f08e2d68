"""Where the PLE table's rows lie in a checkpoint: safetensors headers, no tensor data read.

A safetensors file is an 8-byte little-endian header length, a JSON header
(name → dtype, shape, data_offsets relative to the data region), then the data;
facts/safetensors.py reads the frame, the PLE entries are judged here.
Rows of shard i are bytes [data_start + begin, data_start + end) of its file,
row-major, so the flat table is the shards' data regions concatenated in shard order.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.facts.jsonfile import (
    MAX_CONFIG_BYTES,
    JsonFileError,
    parse_json,
    read_json_object,
    read_limited,
)
from flashnext.facts.model import not_a_file_in_the_directory
from flashnext.facts.model_derived import config_int, ple_table_shape
from flashnext.facts.safetensors import DTYPE_BITS, SafetensorsError, read_header_json
from flashnext.read_errors import unreadable
from flashnext.table.errors import TableError
from flashnext.table.file_layout import PACKED, check_layout, table_bytes

# Checkpoint names look like
# model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_17.weight;
# the prefix before `layers.` varies between exports, the tail is what vLLM matches.
SHARD_NAME = re.compile(
    r"^(?P<layer>(?:.*\.)?layers\.\d+\.ple)\..*ngram_embedding\.shard_(?P<index>\d+)\.(?P<leaf>\w+)$"
)
# The element types a flat table can hold (whole bytes; sizes from the one dtype table).
TABLE_DTYPES = ("BF16", "F16", "F32", "F8_E4M3", "U8", "I8")
DTYPE_BYTES = {dtype: DTYPE_BITS[dtype] // 8 for dtype in TABLE_DTYPES}


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
    file_size_bytes: int = 0
    """Size of `file` its safetensors header implies (read_layout checks the disk against it)."""

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
        from another checkpoint (or a re-exported one) is never extended. File sizes
        are the ones the headers imply (read_layout refuses a file of another size),
        so a shard that was short and is downloaded again keeps the identity and the
        copy resumes.
        """
        h = hashlib.sha256()
        for s in self.shards:
            size = s.file_size_bytes
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
    """(header dict, absolute offset of the data region) of one safetensors file, read
    by the one header reader (facts/safetensors.py); the PLE entries are judged here."""
    try:
        header, data_start, _ = read_header_json(path)
    except SafetensorsError as exc:
        raise TableError(exc.detail, fix=exc.fix) from exc
    return header, data_start


def _checkpoint_files(model_dir: Path) -> list[str]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            doc = read_json_object(index, "safetensors index")
            weight_map = doc["weight_map"]
        except (JsonFileError, KeyError) as exc:
            raise TableError(
                f"{index}: unreadable or without weight_map ({exc})",
                fix="re-download the checkpoint's model.safetensors.index.json",
            ) from exc
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise TableError(
                f"{index}: weight_map is not an object of tensor name -> file name",
                fix="re-download the checkpoint's model.safetensors.index.json",
            )
        # The rule `checkpoint check` applies: an entry outside the directory is never read.
        ple_entries = ((n, f) for n, f in weight_map.items() if SHARD_NAME.match(n))
        outside = next(((n, f) for n, f in ple_entries if not_a_file_in_the_directory(f)), None)
        if outside:
            raise TableError(
                f"{index}: weight_map entry {outside[0]!r} names {outside[1]!r}, not a file in "
                "the model directory; it is not followed",
                fix="re-download the checkpoint's model.safetensors.index.json",
            )
        # Only the files that hold PLE shards are opened: their names say so.
        return sorted({f for n, f in weight_map.items() if SHARD_NAME.match(n)})
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise TableError(
            f"{model_dir}: no model.safetensors.index.json and no *.safetensors files",
            fix="pass --model the checkpoint directory (the one with config.json)",
        )
    return files


_RESTORE_CONFIG = "restore config.json from the published checkpoint"


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null"
    )


def _text_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = parse_json(read_limited(path, "model config", MAX_CONFIG_BYTES), str(path),
                            "model config")  # fmt: skip
    except (OSError, JsonFileError) as exc:
        denied = unreadable(path, exc) if isinstance(exc, OSError) else None
        if denied:
            raise TableError(*denied) from exc
        raise TableError(
            f"{path}: cannot read ({exc})", fix="pass --model the checkpoint directory"
        ) from exc
    if not isinstance(config, dict):
        raise TableError(
            f"{path}: the model config is a JSON {_json_kind(config)}, not an object",
            fix=_RESTORE_CONFIG,
        )
    text_config = config.get("text_config", config)
    if not isinstance(text_config, dict):
        raise TableError(
            f"{path}: text_config is a JSON {_json_kind(text_config)}, not an object",
            fix=_RESTORE_CONFIG,
        )
    return text_config


def expected_dim(text_config: dict[str, Any]) -> int | None:
    """Row width (elements) the model expects: ple_embed_dim over the n-gram heads.

    None when the config does not say (a key is absent); ConfigValueError when it
    says something no model has (heads_per_ngram 0, a word for a number).
    """
    if any(k not in text_config for k in ("ngram_size", "heads_per_ngram", "ple_embed_dim")):
        return None
    heads = (config_int(text_config, "ngram_size", minimum=2) - 1) * config_int(
        text_config, "heads_per_ngram"
    )
    return config_int(text_config, "ple_embed_dim") // heads


def _offsets(file: Path, name: str, info: Any) -> tuple[int, int]:
    """A tensor's [begin, end) in the data region, refused unless two ordered byte offsets."""
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise TableError(
            f"{file}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end] byte offsets",
            fix=f"re-download {file.name}: its header is damaged",
        )
    return offsets[0], offsets[1]


def _check_file_size(file: Path, header: dict[str, Any], data_start: int) -> int:
    """The file's size must be what its header describes: a short one is a partial download.

    Checked before anything is written, so a copy never stops halfway on it. Returns
    the size.
    """
    ends = [_offsets(file, n, i)[1] for n, i in header.items() if n != "__metadata__"]
    want = data_start + max(ends, default=0)
    try:
        have = file.stat().st_size
    except OSError as exc:
        raise TableError(f"{file}: cannot read ({exc.strerror})") from exc
    redo = (
        f"re-download {file.name}, then rerun the same command (an interrupted prepare "
        "resumes where it stopped)"
    )
    if have < want:
        raise TableError(
            f"{file}: {have} bytes, but its safetensors header describes {want}: "
            f"{want - have} bytes are missing (an interrupted download)",
            fix=redo,
        )
    if have > want:
        raise TableError(
            f"{file}: {have} bytes, but its safetensors header describes {want}: "
            f"{have - want} bytes more than it should hold (not the file its header belongs to)",
            fix=redo,
        )
    return have


def _shard_shape(file: Path, name: str, info: dict[str, Any]) -> tuple[int, int]:
    shape = info.get("shape")
    if not (
        isinstance(shape, list)
        and len(shape) == 2
        and all(type(d) is int and d >= 0 for d in shape)
    ):
        raise TableError(
            f"{file}: tensor {name!r} has shape {shape!r}, not [rows, width] in whole numbers",
            fix=f"re-download {file.name}: its header is damaged",
        )
    return shape[0], shape[1]


def read_layout(model_dir: str | os.PathLike[str]) -> TableLayout:
    """Find the PLE shards of a checkpoint and check them against its config.json."""
    base = Path(model_dir)
    if not base.is_dir():
        raise TableError(f"{base}: not a directory", fix="pass --model the checkpoint directory")
    text_config = _text_config(base)
    try:
        return _read_layout(base, text_config)
    except ValueError as exc:  # ConfigValueError names the key; the rest, the clash
        raise TableError(f"{base / 'config.json'}: {exc}", fix=_RESTORE_CONFIG) from exc


def _read_layout(base: Path, text_config: dict[str, Any]) -> TableLayout:
    found: dict[int, PleShard] = {}
    layers: set[str] = set()
    dtypes: set[str] = set()
    dims: set[int] = set()
    parts = None
    if "split_ngram_parts" in text_config:
        parts = config_int(text_config, "split_ngram_parts")
    want_dim = expected_dim(text_config)
    for file in _checkpoint_files(base):
        path = base / file
        header, data_start = read_header(path)
        file_size = _check_file_size(path, header, data_start)
        for name, info in header.items():
            m = SHARD_NAME.match(name)
            if not m:
                continue
            if m["leaf"] != "weight":
                raise TableError(
                    f"{file}: {name}: a quantized PLE table ({m['leaf']}) cannot be served "
                    "from a flat file; this kit expects the BF16 table",
                )
            rows, width = _shard_shape(path, name, info)
            dtype = info.get("dtype")
            if dtype not in DTYPE_BYTES:
                raise TableError(f"{file}: {name}: unexpected dtype {dtype!r}")
            begin, end = _offsets(path, name, info)
            row_bytes = width * DTYPE_BYTES[dtype]
            if end - begin != rows * row_bytes:
                raise TableError(f"{file}: {name}: data_offsets do not match shape {info['shape']}")
            index = int(m["index"])
            if index in found:
                raise TableError(f"{name} appears twice ({found[index].file} and {file})")
            found[index] = PleShard(
                index, name, file, data_start + begin, rows, row_bytes, file_size
            )
            layers.add(m["layer"])
            dtypes.add(dtype)
            dims.add(width)
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
    if missing or (parts is not None and len(shards) != parts):
        raise TableError(
            f"{base}: found {len(shards)} PLE shards, config split_ngram_parts={parts}; "
            f"missing shard indices {missing[:8]}{'...' if len(missing) > 8 else ''}",
            fix="re-download the shard files named in model.safetensors.index.json",
        )
    full = shards[0].rows
    if any(s.rows != full for s in shards[:-1]) or shards[-1].rows > full:
        raise TableError(f"{base}: PLE shards have uneven row counts; only the last may be short")
    dim = dims.pop()
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
