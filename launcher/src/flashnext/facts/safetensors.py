"""The one safetensors header reader: every header the launcher reads goes through here.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then the data region; each tensor's `data_offsets` are relative to the start of
that region. `read_header_json` reads the frame (one size limit, the JSON);
`read_safetensors_header` validates every tensor as strictly as the
`safetensors` library that vLLM loads with (a file that library would refuse is
refused here, with the file named and the fix said) and returns `TensorInfo`s
that carry their absolute data offsets, so nothing else re-reads a header.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from operator import itemgetter, sub
from pathlib import Path
from typing import Any

from flashnext.facts.schema import ModelFactsError, TensorInfo
from flashnext.read_errors import unreadable

# The `safetensors` library refuses headers above 100 MB (MAX_HEADER_SIZE);
# so do we, before allocating anything of that size.
MAX_HEADER_BYTES = 100_000_000

# Bits per element of every dtype tag the safetensors format defines (0.8.0).
# Sub-byte types (F4, F6_*) pack elements; a tensor's byte size must be whole.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}

REDOWNLOAD = "re-download this shard (a partial or corrupt download is the usual cause)"


class SafetensorsError(ModelFactsError):
    """A header the safetensors library would refuse: `detail` names the file and the
    defect, `fix` says what to do; str() is both, as one line."""

    def __init__(self, detail: str, fix: str = REDOWNLOAD) -> None:
        super().__init__(f"{detail}; {fix}", fix=fix)
        self.detail = detail
        self.fix: str = fix


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies in a safetensors data region."""
    count = 1
    for dim in shape:
        count *= dim
    bits = DTYPE_BITS[dtype] * count
    if bits % 8:
        raise ValueError(f"{count} elements of {dtype} are not a whole number of bytes")
    return bits // 8


def _read_frame(path: Path) -> tuple[int, int, bytes]:
    """(file size, header length, raw header bytes)."""
    where = str(path)
    try:
        # O_NONBLOCK: a FIFO named like a shard must not wait for a writer.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SafetensorsError(
                    f"{where}: not a regular file, so not a safetensors shard",
                    "replace it with the shard itself (re-download it)",
                )
            size = st.st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(
                    f"{where}: truncated: {size} bytes, too short for the 8-byte header length"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length == 0 or length > MAX_HEADER_BYTES:
                raise SafetensorsError(
                    f"{where}: header length {length} is not a plausible safetensors header "
                    f"(1..{MAX_HEADER_BYTES} bytes); not a safetensors file or corrupt"
                )
            if 8 + length > size:
                raise SafetensorsError(
                    f"{where}: truncated: header says {length} bytes of JSON but the file has "
                    f"{size - 8} after the length prefix"
                )
            raw = fh.read(length)
    except OSError as exc:
        denied = unreadable(path, exc)
        if denied:  # not a damaged download: downloading again would not help
            raise SafetensorsError(*denied) from exc
        raise SafetensorsError(
            f"{where}: cannot read ({exc.strerror})", "check the path and its permissions"
        ) from exc
    return size, length, raw


def _parse_json(path: Path, raw: bytes, parse_float: Any = None) -> dict[str, Any]:
    try:
        header = json.loads(raw, parse_float=parse_float)
    except RecursionError:
        raise SafetensorsError(f"{path}: header is not JSON (nested too deeply)") from None
    except ValueError as exc:  # invalid UTF-8 or JSON, or an integer of thousands of digits
        raise SafetensorsError(f"{path}: header is not JSON (not valid JSON: {exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is JSON but not an object")
    return header


def read_header_json(path: Path) -> tuple[dict[str, Any], int, int]:
    """(header object as stored, absolute offset of the data region, file size).

    Only the frame is checked (length, limit, JSON object); the entries are the
    caller's to judge (the table tools judge only the PLE shards' entries).
    """
    size, length, raw = _read_frame(path)
    return _parse_json(path, raw), 8 + length, size


@dataclass(frozen=True)
class ShardHeader:
    """One validated header as columns (a full checkpoint has ~225k tensors: no object
    per tensor until one is asked for, see `tensors`)."""

    file: str
    size_bytes: int
    header_bytes: int
    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    nbytes: list[int]
    starts: list[int]
    """data_offsets[0] of each tensor, relative to the data region."""

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    def tensors(self) -> list[TensorInfo]:
        base, file = self.data_start, self.file
        return [
            TensorInfo(n, d, s, b, file, base + o)
            for n, d, s, b, o in zip(
                self.names, self.dtypes, self.shapes, self.nbytes, self.starts, strict=True
            )
        ]


def read_safetensors_header(path: Path) -> tuple[int, int, list[TensorInfo]]:
    """Parse and validate one shard's header: (file size, header length, tensors).

    Tensors come back in header order; `TensorInfo.file` is the file's name and
    `TensorInfo.offset_bytes` the tensor's absolute offset in it.
    """
    shard = read_shard_header(path)
    return shard.size_bytes, shard.header_bytes, shard.tensors()


def read_shard_header(path: Path) -> ShardHeader:
    """Parse and validate one shard's header, as strictly as the safetensors library."""
    size, length, raw = _read_frame(path)
    floats: list[str] = []  # float literals seen (parse_float keeps the C scanner)
    header = _parse_json(path, raw, lambda text: floats.append(text) or float(text))
    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise SafetensorsError(f"{path}: __metadata__ must map strings to strings")
    data_bytes = size - 8 - length
    # When the JSON holds no float, bool or null, every number is an int and the
    # columns can be checked in bulk: a full checkpoint has ~225k tensors but a few
    # dozen distinct (dtype, shape, span) triples. Anything unusual (a name holding
    # "true" included) goes through `_checked_entries`, which checks every field and
    # says what is wrong.
    fast = not floats and b"true" not in raw and b"false" not in raw and b"null" not in raw
    columns = _bulk_columns(header, data_bytes) if fast else None
    if columns is None:
        columns = _checked_entries(str(path), path.name, header, data_bytes)
    names, dtypes, shapes, nbytes, starts, ends = columns
    _check_tiling(str(path), names, starts, ends, data_bytes)
    return ShardHeader(path.name, size, length, names, dtypes, shapes, nbytes, starts)


_DTYPE, _SHAPE, _OFFSETS = itemgetter("dtype"), itemgetter("shape"), itemgetter("data_offsets")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
_Columns = tuple[list[str], list[str], list[tuple[int, ...]], list[int], list[int], list[int]]


def _bulk_columns(header: dict[str, Any], data_bytes: int) -> _Columns | None:
    """The columns when every entry is well formed, checked per distinct triple; None
    when anything is off (the entry-by-entry check then names it)."""
    entries = list(header.values())
    try:  # map/itemgetter: the loops run in C
        dtypes = list(map(_DTYPE, entries))
        shapes = list(map(tuple, map(_SHAPE, entries)))
        offsets = list(map(_OFFSETS, entries))
        if entries and (set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}):
            return None
        starts = list(map(_FIRST, offsets))
        ends = list(map(_SECOND, offsets))
        spans = list(map(sub, ends, starts))
        triples = set(zip(dtypes, shapes, spans, strict=True))
        if entries and (min(starts) < 0 or max(ends) > data_bytes):
            return None
    except (TypeError, KeyError, ValueError):
        return None
    for dtype, shape, span in triples:
        if dtype not in DTYPE_BITS or not all(type(d) is int and d >= 0 for d in shape):
            return None
        try:
            if tensor_nbytes(dtype, shape) != span:
                return None
        except ValueError:
            return None
    return list(header), dtypes, shapes, spans, starts, ends


def _checked_entries(where: str, name: str, header: dict[str, Any], data_bytes: int) -> _Columns:
    columns: _Columns = ([], [], [], [], [], [])
    names, dtypes, shapes, nbytes, starts, ends = columns
    for key, entry in header.items():
        info = _tensor_entry(where, name, key, entry, 0)  # raises when invalid
        start, end = entry["data_offsets"]
        if end > data_bytes:
            raise SafetensorsError(
                f"{where}: tensor {key!r} ends at byte {end} of the data region, which holds "
                f"only {data_bytes} bytes: the file is truncated"
            )
        names.append(key)
        dtypes.append(info.dtype)
        shapes.append(info.shape)
        nbytes.append(info.nbytes)
        starts.append(start)
        ends.append(end)
    return columns


def _check_tiling(
    where: str,
    names: list[str],
    starts: list[int],
    ends: list[int],
    data_bytes: int,
) -> None:
    """The safetensors library requires the tensors to tile the data region exactly:
    sorted by offset, each starts where the previous one ended, the last ends at
    the end of the file."""
    order = sorted(range(len(starts)), key=starts.__getitem__)
    if len(order) > 1:
        s, e = list(itemgetter(*order)(starts)), list(itemgetter(*order)(ends))
    else:
        s, e = [starts[i] for i in order], [ends[i] for i in order]
    if s[:1] == [0] * min(1, len(s)) and s[1:] == e[:-1] and (e[-1] if e else 0) == data_bytes:
        return
    cursor = 0
    for i in order:
        key, start, end = names[i], starts[i], ends[i]
        if start < cursor:
            raise SafetensorsError(
                f"{where}: tensor {key!r} at data offsets [{start}, {end}) overlaps the previous "
                f"tensor (which ends at {cursor})"
            )
        if start > cursor:
            raise SafetensorsError(
                f"{where}: {start - cursor} unused bytes before tensor {key!r} at offset {start}; "
                f"the safetensors library refuses holes in the data region"
            )
        cursor = end
    raise SafetensorsError(
        f"{where}: tensors cover {cursor} bytes but the data region holds {data_bytes}: "
        f"{'trailing bytes' if cursor < data_bytes else 'truncated'}"
    )


def _tensor_entry(where: str, file: str, key: str, entry: Any, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsError(f"{where}: entry for tensor {key!r} is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:  # a list or dict is unhashable
        raise SafetensorsError(
            f"{where}: tensor {key!r} has unknown dtype {dtype!r} "
            f"(known: {', '.join(sorted(DTYPE_BITS))})"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise SafetensorsError(f"{where}: tensor {key!r} has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SafetensorsError(f"{where}: tensor {key!r} has invalid data_offsets {offsets!r}")
    try:
        nbytes = tensor_nbytes(dtype, shape)
    except ValueError as exc:
        raise SafetensorsError(f"{where}: tensor {key!r}: {exc}") from exc
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsError(
            f"{where}: tensor {key!r} is {dtype} {shape} = {nbytes} bytes but its data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(key, dtype, tuple(shape), nbytes, file, data_start + offsets[0])
