"""ModelFacts from a checkpoint directory, without reading a byte of tensor data.

What is read: config.json (with its quantization_config), generation_config.json
(optional), model.safetensors.index.json or a single model.safetensors, and the
header of every shard, through the one header reader (facts/safetensors.py),
as strict as the `safetensors` library that vLLM loads with.

Judging the model (arch is qwen4_exp, metadata defects, sizes) is not done
here: that is preflight's job over the facts this returns.
"""

from __future__ import annotations

import gc
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flashnext.facts.safetensors import read_safetensors_header, tensor_nbytes
from flashnext.facts.schema import ModelFacts, ModelFactsError, ShardInfo, TensorInfo

# Names other code imports from here (checks/gpu/tiny_model.py: tensor_nbytes).
__all__ = ["ModelFactsError", "read_model_facts", "read_safetensors_header", "tensor_nbytes"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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
