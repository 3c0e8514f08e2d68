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
import struct
from collections.abc import Iterable
from operator import itemgetter
from pathlib import Path
from typing import Any

from flashnext.facts.schema import ModelFactsError, TensorInfo

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
        super().__init__(f"{detail}; {fix}")
        self.detail = detail
        self.fix = fix


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
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
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
        raise SafetensorsError(
            f"{where}: cannot read ({exc.strerror})", "check the path and its permissions"
        ) from exc
    return size, length, raw


def _parse_json(path: Path, raw: bytes, parse_float: Any = None) -> dict[str, Any]:
    try:
        header = json.loads(raw, parse_float=parse_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
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


def read_safetensors_header(path: Path) -> tuple[int, int, list[TensorInfo]]:
    """Parse and validate one shard's header: (file size, header length, tensors).

    Tensors come back in header order; `TensorInfo.file` is the file's name and
    `TensorInfo.offset_bytes` the tensor's absolute offset in it.
    """
    where = str(path)
    size, length, raw = _read_frame(path)
    floats: list[str] = []  # float literals seen (parse_float keeps the C scanner)
    header = _parse_json(path, raw, lambda text: floats.append(text) or float(text))

    data_start = 8 + length
    data_bytes = size - data_start
    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise SafetensorsError(f"{where}: __metadata__ must map strings to strings")

    # Hot loop (a full checkpoint has ~225k tensors but a few dozen distinct
    # (dtype, shape) pairs). When the JSON holds no float, bool or null, every
    # number is an int, so a pair validated once stays valid and a tensor costs
    # a dict lookup and one offsets check (a name containing "true" only costs
    # the slow path). Anything else goes through `_tensor_entry`, which checks
    # every field and says what is wrong.
    name = path.name
    fast = not floats and b"true" not in raw and b"false" not in raw and b"null" not in raw
    known: dict[tuple[Any, tuple[Any, ...]], int] = {}
    tensors: list[TensorInfo] = []
    starts: list[int] = []
    ends: list[int] = []
    for key, entry in header.items():
        info = None
        if fast:
            try:
                dtype = entry["dtype"]
                shape = tuple(entry["shape"])
                start, end = entry["data_offsets"]
                nbytes = known[(dtype, shape)]
                if start >= 0 and end - start == nbytes:
                    info = TensorInfo(key, dtype, shape, nbytes, name, data_start + start)
            except (TypeError, KeyError, ValueError):
                pass
        if info is None:
            info = _tensor_entry(where, name, key, entry, data_start)  # raises when invalid
            known[(info.dtype, info.shape)] = info.nbytes
            start, end = entry["data_offsets"]
        if end > data_bytes:
            raise SafetensorsError(
                f"{where}: tensor {key!r} ends at byte {end} of the data region, which holds "
                f"only {data_bytes} bytes: the file is truncated"
            )
        starts.append(start)
        ends.append(end)
        tensors.append(info)

    _check_tiling(where, tensors, starts, ends, data_bytes)
    return size, length, tensors


def _check_tiling(
    where: str,
    tensors: list[TensorInfo],
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
        key, start, end = tensors[i].name, starts[i], ends[i]
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
    if dtype not in DTYPE_BITS:
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
