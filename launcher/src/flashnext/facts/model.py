"""ModelFacts from a checkpoint directory, without reading a byte of tensor data.

What is read: config.json (with its quantization_config), generation_config.json
(optional), model.safetensors.index.json or a single model.safetensors, and the
header of every shard. A safetensors file is an 8-byte little-endian header
length N, N bytes of JSON, then the data region; each tensor's `data_offsets`
are relative to the start of that region. The header reader below is our own
and as strict as the `safetensors` library that vLLM loads with: a file that
library would refuse is refused here, with the file named and the fix said.

Judging the model (arch is qwen4_exp, metadata defects, sizes) is not done
here: that is preflight's job over the facts this returns.
"""

from __future__ import annotations

import gc
import json
import os
import re
import struct
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from operator import itemgetter
from pathlib import Path
from typing import Any

from flashnext.facts.schema import ModelFacts, ShardInfo, TensorInfo

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

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


class ModelFactsError(ValueError):
    """A model directory this launcher cannot read; the message names the file and the fix."""

    def __init__(self, message: str, missing_dir: bool = False) -> None:
        super().__init__(message)
        self.missing_dir = missing_dir
        """The directory itself does not exist (a wrong path, or not downloaded yet)."""


# ---------------------------------------------------------------- safetensors headers


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """Bytes a tensor of this dtype and shape occupies in a safetensors data region."""
    count = 1
    for dim in shape:
        count *= dim
    bits = DTYPE_BITS[dtype] * count
    if bits % 8:
        raise ValueError(f"{count} elements of {dtype} are not a whole number of bytes")
    return bits // 8


def read_safetensors_header(path: Path) -> tuple[int, int, list[TensorInfo]]:
    """Parse and validate one shard's header: (file size, header length, tensors).

    Tensors come back in header order; `TensorInfo.file` is the file's name.
    """
    where = str(path)
    fix = "re-download this shard (a partial or corrupt download is the usual cause)"
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ModelFactsError(
                    f"{where}: truncated: {size} bytes, too short for the 8-byte header "
                    f"length; {fix}"
                )
            (length,) = struct.unpack("<Q", prefix)
            if length == 0 or length > MAX_HEADER_BYTES:
                raise ModelFactsError(
                    f"{where}: header length {length} is not a plausible safetensors header "
                    f"(1..{MAX_HEADER_BYTES} bytes); not a safetensors file or corrupt; {fix}"
                )
            if 8 + length > size:
                raise ModelFactsError(
                    f"{where}: truncated: header says {length} bytes of JSON but the file has "
                    f"{size - 8} after the length prefix; {fix}"
                )
            raw = fh.read(length)
    except OSError as exc:
        raise ModelFactsError(
            f"{where}: cannot read ({exc.strerror}); check the path and its permissions"
        ) from exc
    try:
        floats: list[str] = []  # float literals seen (parse_float keeps the C scanner)
        header = json.loads(raw, parse_float=lambda text: floats.append(text) or float(text))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFactsError(f"{where}: header is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(header, dict):
        raise ModelFactsError(f"{where}: header is JSON but not an object; {fix}")

    data_bytes = size - 8 - length
    meta = header.pop("__metadata__", None)
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise ModelFactsError(f"{where}: __metadata__ must map strings to strings; {fix}")

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
                    info = TensorInfo(key, dtype, shape, nbytes, name)
            except (TypeError, KeyError, ValueError):
                pass
        if info is None:
            info = _tensor_entry(where, name, key, entry, fix)  # raises when invalid
            known[(info.dtype, info.shape)] = info.nbytes
            start, end = entry["data_offsets"]
        if end > data_bytes:
            raise ModelFactsError(
                f"{where}: tensor {key!r} ends at byte {end} of the data region, which holds "
                f"only {data_bytes} bytes: the file is truncated; {fix}"
            )
        starts.append(start)
        ends.append(end)
        tensors.append(info)

    _check_tiling(where, fix, tensors, starts, ends, data_bytes)
    return size, length, tensors


def _check_tiling(
    where: str,
    fix: str,
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
            raise ModelFactsError(
                f"{where}: tensor {key!r} at data offsets [{start}, {end}) overlaps the previous "
                f"tensor (which ends at {cursor}); {fix}"
            )
        if start > cursor:
            raise ModelFactsError(
                f"{where}: {start - cursor} unused bytes before tensor {key!r} at offset {start}; "
                f"the safetensors library refuses holes in the data region; {fix}"
            )
        cursor = end
    raise ModelFactsError(
        f"{where}: tensors cover {cursor} bytes but the data region holds {data_bytes}: "
        f"{'trailing bytes' if cursor < data_bytes else 'truncated'}; {fix}"
    )


def _tensor_entry(where: str, file: str, key: str, entry: Any, fix: str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise ModelFactsError(f"{where}: entry for tensor {key!r} is not an object; {fix}")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise ModelFactsError(
            f"{where}: tensor {key!r} has unknown dtype {dtype!r} "
            f"(known: {', '.join(sorted(DTYPE_BITS))}); {fix}"
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ModelFactsError(f"{where}: tensor {key!r} has an invalid shape {shape!r}; {fix}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ModelFactsError(
            f"{where}: tensor {key!r} has invalid data_offsets {offsets!r}; {fix}"
        )
    try:
        nbytes = tensor_nbytes(dtype, shape)
    except ValueError as exc:
        raise ModelFactsError(f"{where}: tensor {key!r}: {exc}; {fix}") from exc
    if offsets[1] - offsets[0] != nbytes:
        raise ModelFactsError(
            f"{where}: tensor {key!r} is {dtype} {shape} = {nbytes} bytes but its data_offsets "
            f"{offsets} span {offsets[1] - offsets[0]}; {fix}"
        )
    return TensorInfo(name=key, dtype=dtype, shape=tuple(shape), nbytes=nbytes, file=file)


# ---------------------------------------------------------------- the model directory


def _read_json(path: Path, what: str, fix: str) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ModelFactsError(f"{path}: missing {what}; {fix}") from exc
    except OSError as exc:
        raise ModelFactsError(f"{path}: cannot read {what} ({exc.strerror}); {fix}") from exc
    except UnicodeDecodeError as exc:
        raise ModelFactsError(f"{path}: {what} is not UTF-8 text; {fix}") from exc
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelFactsError(f"{path}: {what} is not valid JSON ({exc}); {fix}") from exc
    if not isinstance(doc, dict):
        raise ModelFactsError(f"{path}: {what} must be a JSON object; {fix}")
    return doc


def _shard_files(model_dir: Path) -> tuple[tuple[str, ...], dict[str, str] | None]:
    """Shard file names in index order, and the index's weight_map (None without an index)."""
    index_path = model_dir / INDEX_FILE
    fix = "re-download the checkpoint's index file"
    if index_path.exists():
        index = _read_json(index_path, "safetensors index", fix)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFactsError(f"{index_path}: no weight_map (tensor name -> file); {fix}")

        def bad(file: object) -> bool:
            return not isinstance(file, str) or not file or "/" in file or file in (".", "..")

        try:  # distinct files first (C speed over ~225k entries), then check those few
            files = tuple(dict.fromkeys(weight_map.values()))
        except TypeError:  # an unhashable value: found below
            files = ()
        if not files or any(bad(f) for f in files):
            tensor, file = next((t, f) for t, f in weight_map.items() if bad(f))
            raise ModelFactsError(
                f"{index_path}: weight_map entry {tensor!r} names {file!r}, not a file "
                f"in the model directory; {fix}"
            )
        _check_index_names_every_file(index_path, model_dir, files)
        return files, weight_map
    if (model_dir / SINGLE_FILE).exists():
        return (SINGLE_FILE,), None
    raise ModelFactsError(
        f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found; point --model at the "
        "checkpoint directory (the one holding config.json and the .safetensors files) and "
        "finish the download"
    )


# Sharded exports name their files PREFIX-00001-of-00039.safetensors: the count is in the name.
_NUMBERED_SHARD = re.compile(r"(?P<stem>.+)-(?P<i>\d+)-of-(?P<n>\d+)\.safetensors")


def _check_index_names_every_file(
    index_path: Path, model_dir: Path, files: tuple[str, ...]
) -> None:
    """vLLM loads by the index: a shard file it maps no tensor to is never read, so its
    tensors would be missing. The shard names say how many files the export has."""
    numbered = [m for m in map(_NUMBERED_SHARD.fullmatch, files) if m]
    kinds = {(m["stem"], len(m["i"]), m["n"]) for m in numbered}
    if len(numbered) != len(files) or len(kinds) != 1:
        return  # not one numbered series: nothing to count against
    stem, width, count = kinds.pop()
    listed = set(files)
    for i in range(1, int(count) + 1):
        name = f"{stem}-{i:0{width}d}-of-{count}.safetensors"
        if name in listed:
            continue
        where = f"shard {i} of {int(count)}"
        if (model_dir / name).exists():
            raise ModelFactsError(
                f"{index_path}: maps no tensor to {name}, which is in the directory ({where}); "
                "vLLM loads by the index, so its tensors would be missing: download "
                f"{INDEX_FILE} again (it must come from the same export as the shards)"
            )
        raise ModelFactsError(
            f"{index_path}: maps no tensor to {name}, which is not in the directory either "
            f"({where}): the download is incomplete; fetch the checkpoint again "
            "(`hf download` resumes)"
        )


def read_generation_config_dir(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """generation_config.json of a --generation-config DIR. Raises ModelFactsError."""
    root = Path(directory)
    if not root.is_dir():
        raise ModelFactsError(
            f"{root}: not a directory; pass --generation-config the directory that holds "
            f"{GENERATION_CONFIG_FILE}"
        )
    return _read_json(
        root / GENERATION_CONFIG_FILE,
        "generation config",
        "copy the published checkpoint's generation_config.json there",
    )


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector: a full checkpoint's headers are ~1M
    small acyclic objects (dicts, lists, tuples), and the collector rescanning
    the growing heap while they are built costs ~40% of the read time."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_model_facts(model_dir: str | os.PathLike[str]) -> ModelFacts:
    """Read a checkpoint directory's configs and every shard header. Raises ModelFactsError."""
    with _no_cyclic_gc():
        return _read_model_facts(Path(model_dir))


def _read_model_facts(root: Path) -> ModelFacts:
    if not root.exists():
        raise ModelFactsError(f"{root}: no such directory", missing_dir=True)
    if not root.is_dir():
        raise ModelFactsError(
            f"{root}: not a directory; pass the checkpoint directory (holding config.json)"
        )
    config = _read_json(
        root / CONFIG_FILE,
        "model config",
        "point --model at the checkpoint directory and make sure the download is complete",
    )
    quant = config.get("quantization_config")
    if quant is None and isinstance(config.get("text_config"), dict):
        quant = config["text_config"].get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelFactsError(
            f"{root / CONFIG_FILE}: quantization_config is {type(quant).__name__}, not an "
            "object; restore config.json from the published checkpoint"
        )
    generation = None
    if (root / GENERATION_CONFIG_FILE).exists():
        generation = _read_json(
            root / GENERATION_CONFIG_FILE,
            "generation config",
            "restore generation_config.json from the published checkpoint or delete it",
        )

    files, weight_map = _shard_files(root)
    shards: list[ShardInfo] = []
    tensors: list[TensorInfo] = []
    seen: dict[str, str] = {}
    for file in files:
        path = root / file
        if not path.is_file():
            raise ModelFactsError(
                f"{path}: missing shard named by {INDEX_FILE}; the download is incomplete: "
                "fetch the missing file(s) again"
            )
        size, header_len, shard_tensors = read_safetensors_header(path)
        names = dict.fromkeys([info.name for info in shard_tensors], file)
        if not seen.keys().isdisjoint(names):
            dup = next(n for n in names if n in seen)
            raise ModelFactsError(
                f"{path}: tensor {dup!r} is also in {seen[dup]}; the checkpoint mixes "
                "files from two exports: download it again into an empty directory"
            )
        seen.update(names)
        shards.append(ShardInfo(file, size, header_len, len(shard_tensors)))
        tensors.extend(shard_tensors)

    if weight_map is not None:
        _check_index_matches(root / INDEX_FILE, weight_map, seen)

    return ModelFacts(
        path=str(root),
        config=config,
        quantization_config=quant,
        generation_config=generation,
        index_files=files,
        shards=tuple(shards),
        tensors=tuple(tensors),
    )


def _check_index_matches(
    index_path: Path, weight_map: dict[str, str], seen: dict[str, str]
) -> None:
    """Every indexed tensor is in the file the index names, and every stored tensor is indexed."""
    fix = "the index and the shards come from different exports: download both again"
    if len(weight_map) == len(seen) and weight_map == seen:
        return
    for tensor, file in weight_map.items():
        actual = seen.get(tensor)
        if actual is None:
            raise ModelFactsError(
                f"{index_path}: tensor {tensor!r} is mapped to {file} but no shard holds it; {fix}"
            )
        if actual != file:
            raise ModelFactsError(
                f"{index_path}: tensor {tensor!r} is mapped to {file} but stored in {actual}; {fix}"
            )
    extra = sorted(set(seen) - set(weight_map))
    raise ModelFactsError(
        f"{index_path}: {len(extra)} tensor(s) stored in shards but missing from weight_map, "
        f"e.g. {extra[0]!r} in {seen[extra[0]]}; {fix}"
    )
