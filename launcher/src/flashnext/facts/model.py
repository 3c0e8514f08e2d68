"""ModelFacts from a checkpoint directory, without reading a byte of tensor data.

What is read: config.json (with its quantization_config), generation_config.json
(optional), model.safetensors.index.json or a single model.safetensors, and the
header of every shard, through the one header reader (facts/safetensors.py),
as strict as the `safetensors` library that vLLM loads with.

Judging the model (arch is qwen4_exp, metadata defects, sizes) is not done
here: that is preflight's job over the facts this returns.
"""

from __future__ import annotations

import contextlib
import gc
import marshal
import operator
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

from flashnext.facts import header_cache
from flashnext.facts.config_check import check_sections
from flashnext.facts.jsonfile import (
    MAX_CONFIG_BYTES,
    MAX_JSON_BYTES,
    JsonFileError,
    parse_json,
    read_limited,
)
from flashnext.facts.safetensors import (
    ShardHeader,
    read_safetensors_header,
    read_shard_header,
    tensor_nbytes,
)
from flashnext.facts.schema import (
    LazyTensors,
    ModelFacts,
    ModelFactsError,
    ShardInfo,
    TensorInfo,
    bytes_by_class,
)
from flashnext.read_errors import not_a_file, unreadable

# Names other code imports from here (checks/gpu/tiny/tiny_model.py: tensor_nbytes).
__all__ = ["ModelFactsError", "read_model_facts", "read_safetensors_header", "tensor_nbytes"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


# ---------------------------------------------------------------- the model directory


def _read_json(path: Path, what: str, fix: str, limit: int = MAX_CONFIG_BYTES) -> dict[str, Any]:
    """A checkpoint's JSON file, read bounded (`limit`): a device, a FIFO or a 150 MB
    file is an error, not gigabytes of memory or a hang; so is hostile JSON."""
    try:
        raw = read_limited(path, what, limit)
    except FileNotFoundError as exc:
        raise ModelFactsError(f"{path}: missing {what}; {fix}") from exc
    except JsonFileError as exc:
        raise ModelFactsError(f"{exc}; {fix}") from None
    except OSError as exc:
        denied = unreadable(path, exc)
        if denied:  # the file is there: access, not a download, is what is missing
            raise ModelFactsError(f"{denied[0]}; {denied[1]}", fix=denied[1]) from exc
        raise ModelFactsError(f"{path}: cannot read {what} ({exc.strerror}); {fix}") from exc
    try:
        doc = parse_json(raw, str(path), what)
    except JsonFileError as exc:
        raise ModelFactsError(f"{exc}; {fix}") from None
    if not isinstance(doc, dict):
        raise ModelFactsError(f"{path}: {what} must be a JSON object; {fix}")
    return doc


def _patterns_problem(where: str, patterns: Any) -> str | None:
    """Why `patterns` (a group's targets, the ignore list) is no list of module names and
    `re:` patterns that compile, as compressed-tensors reads them; None if it is one."""
    if not isinstance(patterns, list):
        return f"{where} is {type(patterns).__name__} {patterns!r:.60}, not a list of names"
    for p in patterns:
        if not isinstance(p, str) or not p:
            return f"{where} holds {p!r}, not a module name or re: pattern"
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except (re.error, RecursionError, OverflowError) as exc:
                return f"{where} holds {p!r}, whose pattern does not compile ({exc})"
    return None


def _check_quant_structure(quant: dict[str, Any], path: Path) -> None:
    """quantization_config's shape before anything resolves schemes from it: groups an
    object of objects with target lists, ignore a list, patterns that compile."""
    groups = quant.get("config_groups")
    problem = None
    if groups is not None and not isinstance(groups, dict):
        problem = (f"quantization_config.config_groups is a {type(groups).__name__}, not an "
                   "object of group name -> {targets, weights}")  # fmt: skip
    for name, group in (groups or {}).items() if isinstance(groups, dict) else ():
        if problem:
            break
        if not isinstance(group, dict):
            problem = f"quantization_config.config_groups.{name} is not an object"
        else:
            problem = _patterns_problem(f"quantization_config.config_groups.{name}.targets",
                                        group.get("targets", []))  # fmt: skip
    if not problem and quant.get("ignore") is not None:
        problem = _patterns_problem("quantization_config.ignore", quant["ignore"])
    method = quant.get("quant_method")
    if not problem and method is not None and not isinstance(method, str):
        problem = f"quantization_config.quant_method is {method!r}, not a name"
    if problem:
        raise ModelFactsError(
            f"{path}: {problem}; vLLM cannot read it either: restore config.json from the "
            "published checkpoint (then `flashnext checkpoint fix` if preflight asks for it)"
        )


def not_a_file_in_the_directory(file: object) -> bool:
    """An index entry that names no file of the model directory itself (`../x`, `/etc/x`,
    `sub/x`, `.`, empty, not a string): never followed, by any tool."""
    return not isinstance(file, str) or not file or "/" in file or file in (".", "..")


def _shard_files(model_dir: Path) -> tuple[tuple[str, ...], dict[str, str] | None]:
    """Shard file names in index order, and the index's weight_map (None without an index)."""
    index_path = model_dir / INDEX_FILE
    fix = "re-download the checkpoint's index file"
    if index_path.exists():
        index = _read_json(index_path, "safetensors index", fix, MAX_JSON_BYTES)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFactsError(f"{index_path}: no weight_map (tensor name -> file); {fix}")

        bad = not_a_file_in_the_directory
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
        broken = not_a_file(root)  # a symlink loop or a link to nothing: say which
        if broken:
            raise ModelFactsError(f"{broken}; point --model at the checkpoint directory")
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
    if quant is not None:
        _check_quant_structure(quant, root / CONFIG_FILE)
    check_sections(config, root / CONFIG_FILE)
    generation = None
    if (root / GENERATION_CONFIG_FILE).exists():
        generation = _read_json(
            root / GENERATION_CONFIG_FILE,
            "generation config",
            "restore generation_config.json from the published checkpoint or delete it",
        )

    index = root / INDEX_FILE if (root / INDEX_FILE).exists() else None
    cached = header_cache.load(root, index)
    if cached is not None:  # every file as when it was last read and checked
        shard_docs = cached["shards"]
        files = tuple(d["file"] for d in shard_docs)
        classes: dict[str, int] = {}
        for d in shard_docs:
            for cls, n in d["classes"].items():
                classes[cls] = classes.get(cls, 0) + n
        count = sum(d["tensors"] for d in shard_docs)
        shards = tuple(
            ShardInfo(d["file"], d["key"][1], d["header_bytes"], d["tensors"]) for d in shard_docs
        )

        def reread() -> list[TensorInfo]:
            return [t for f in files for t in read_shard_header(root / f).tensors()]

        tensors = LazyTensors(count, reread)
    else:
        files, shards, tensors, classes = _read_shards(root, index, config)

    return ModelFacts(
        path=str(root),
        config=config,
        quantization_config=quant,
        generation_config=generation,
        index_files=files,
        shards=shards,
        tensors=tensors,
        byte_classes=classes,
    )


def _check_implied_tensors(root: Path, config: dict[str, Any], weight_map: dict) -> None:
    """The index must name every tensor the config implies, whatever the shards are
    called: a shard deleted with its index entries leaves a consistent index."""
    from flashnext.facts.implied import missing_tensors
    from flashnext.facts.model_derived import ConfigValueError

    try:
        missing = missing_tensors(config, weight_map)
    except ConfigValueError:
        return  # the config's own error is named where the plan reads it
    if missing:
        raise ModelFactsError(
            f"{root / INDEX_FILE}: names no tensor of {'; '.join(missing)}, which "
            f"{CONFIG_FILE} implies: a shard is missing together with its index entries; "
            "download the checkpoint again (its index and every shard)"
        )


def _read_shards(
    root: Path, index: Path | None, config: dict[str, Any]
) -> tuple[tuple[str, ...], tuple[ShardInfo, ...], LazyTensors, dict[str, int]]:
    """Every header read and checked (and the index against them); the result cached."""
    files, weight_map = _shard_files(root)
    if weight_map is not None:
        _check_implied_tensors(root, config, weight_map)
    for file in files:
        if not (root / file).is_file():
            why = not_a_file(root / file)  # a link loop or a FIFO is no missing download
            if why:
                raise ModelFactsError(
                    f"{why}; it is a shard named by {INDEX_FILE}: replace it with the shard "
                    "itself (re-download it)"
                )
            raise ModelFactsError(
                f"{root / file}: missing shard named by {INDEX_FILE}; the download is "
                "incomplete: fetch the missing file(s) again"
            )
    summaries = _summaries(root, files, weight_map)
    # With an index, each shard's names all map to that shard and their count is the
    # index's: no tensor missing, none extra, none in two shards. Without one there is
    # one file (_shard_files), whose JSON keys are unique.
    if weight_map is not None and not (
        all(s.names_in_index for s in summaries)
        and sum(s.tensors for s in summaries) == len(weight_map)
    ):
        headers = [read_shard_header(root / f) for f in files]
        _explain_names(root, weight_map, headers)  # raises, naming the tensor

    header_cache.store(root, index, [
        {"file": s.file, "key": header_cache.file_key(root / s.file), "header_bytes":
         s.header_bytes, "tensors": s.tensors, "classes": s.classes} for s in summaries
    ])  # fmt: skip
    classes: dict[str, int] = {}
    for summary in summaries:
        for cls, n in summary.classes.items():
            classes[cls] = classes.get(cls, 0) + n
    shards = tuple(ShardInfo(s.file, s.size_bytes, s.header_bytes, s.tensors) for s in summaries)
    count = sum(s.tensors for s in summaries)

    def read_tensors() -> list[TensorInfo]:
        # Planning needs only the class totals; the TensorInfos are read when asked for.
        return [t for f in files for t in read_shard_header(root / f).tensors()]

    return files, shards, LazyTensors(count, read_tensors), classes


class _Summary(NamedTuple):
    """What the facts keep of one checked header (and what the cache stores)."""

    file: str
    size_bytes: int
    header_bytes: int
    tensors: int
    names_in_index: bool
    """Every name maps to this file in the index (True without an index)."""
    classes: dict[str, int]


def _summarize(
    root: Path, files: Sequence[str], weight_map: dict[str, str] | None
) -> list[_Summary]:
    out = []
    for file in files:
        h = read_shard_header(root / file)
        # operator.eq, not file.__eq__: that answers NotImplemented (truthy) for None.
        in_index = weight_map is None or all(
            map(operator.eq, repeat(file), map(weight_map.get, h.names))
        )
        out.append(_Summary(file, h.size_bytes, h.header_bytes, len(h.names), in_index,
                            bytes_by_class(h.names, h.nbytes)))  # fmt: skip
    return out


# Below this many shards one process is as fast as two.
PARALLEL_MIN_SHARDS = 8


def _summaries(
    root: Path, files: Sequence[str], weight_map: dict[str, str] | None
) -> list[_Summary]:
    """Every shard summarized; with two CPUs a forked child takes every other shard
    (JSON parsing holds the GIL, so threads would not help). Whatever goes wrong in
    the child, the parent reads those shards itself, so an error names the file as
    it would in one process."""
    half = list(files[1::2])
    if not _can_fork(len(files)):
        return _summarize(root, files, weight_map)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its half as marshal bytes, then exit without cleanup
        code = 1
        try:
            os.close(read_fd)
            data = marshal.dumps([tuple(s) for s in _summarize(root, half, weight_map)])
            with os.fdopen(write_fd, "wb") as out:
                out.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    try:
        mine = _summarize(root, files[0::2], weight_map)
    finally:
        with os.fdopen(read_fd, "rb") as pipe:
            data = pipe.read()
        _, status = os.waitpid(pid, 0)
    theirs = None
    if os.waitstatus_to_exitcode(status) == 0:
        with contextlib.suppress(ValueError, EOFError, TypeError):
            theirs = [_Summary(*s) for s in marshal.loads(data)]
    if theirs is None or [s.file for s in theirs] != half:
        theirs = _summarize(root, half, weight_map)
    merged: list[_Summary] = []
    for pair in zip(mine, [*theirs, None], strict=False):
        merged.extend(s for s in pair if s is not None)
    return merged


def _can_fork(shards: int) -> bool:
    import threading

    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return (
        shards >= PARALLEL_MIN_SHARDS
        and cpus >= 2
        and hasattr(os, "fork")
        and threading.active_count() == 1  # forking a threaded process is unsafe
    )


def _explain_names(root: Path, weight_map: dict[str, str] | None, headers: list[ShardHeader]):
    """Raise the first problem with the tensor names, shard by shard."""
    seen: dict[str, str] = {}
    for h in headers:
        before = len(seen)
        seen.update(zip(h.names, repeat(h.file)))
        if len(seen) != before + len(h.names):  # a name was there already
            firsts = {n: f for g in headers[: headers.index(h)] for n, f in
                      zip(g.names, repeat(g.file))}  # fmt: skip
            dup = next(n for n in h.names if n in firsts)
            raise ModelFactsError(
                f"{root / h.file}: tensor {dup!r} is also in {firsts[dup]}; the checkpoint "
                "mixes files from two exports: download it again into an empty directory"
            )
    if weight_map is not None:
        _check_index_matches(root / INDEX_FILE, weight_map, seen)
    raise AssertionError("unreachable: the names were found wrong, then right")


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
