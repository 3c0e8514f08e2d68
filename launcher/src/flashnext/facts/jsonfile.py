"""One way to read a small file a user names (facts, plans, configs, indexes, key
files): a regular file (a pipe only where asked for, with a deadline), at most
`limit` bytes; for JSON also UTF-8, JSON and an object. Anything else is a
JsonFileError whose message says which of those it is not, so callers add their
fix. Bounded, so a device, a FIFO without a writer or a huge file never fills
memory or blocks, and hostile JSON (nesting thousands deep, integers of
thousands of digits) is an error, not a traceback."""

from __future__ import annotations

import json
import os
import select
import stat
import time
from typing import Any

MAX_JSON_BYTES = 64 << 20  # a facts file is a few KB, a plan tens of KB
MAX_CONFIG_BYTES = 4 << 20  # config.json / generation_config.json: tens of KB
PIPE_DEADLINE_S = 10.0  # `--api-key-file <(pass show key)`: the writer answers at once


class JsonFileError(ValueError):
    """`path`: what is wrong with it (no fix: the caller knows which file it wanted)."""


def _size_text(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"


def _read_pipe(fd: int, limit: int, deadline_s: float) -> bytes:
    """Up to limit + 1 bytes of a pipe, until its writer closes it or the deadline."""
    chunks: list[bytes] = []
    size = 0
    end = time.monotonic() + deadline_s
    while size <= limit:
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        try:
            chunk = os.read(fd, limit + 1 - size)
        except BlockingIOError:
            continue
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def read_limited(
    path: str | os.PathLike[str],
    what: str,
    limit: int,
    *,
    pipe_deadline_s: float | None = None,
) -> bytes:
    """At most `limit` bytes of the regular file `path`; with `pipe_deadline_s`, a pipe
    or FIFO too, read until its writer closes it, within that many seconds. OSError
    (no such file, permission) passes through for callers that name it their way;
    a directory, device, silent pipe or oversized file is a JsonFileError."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise JsonFileError(f"{path}: a directory, not a {what}")
        if stat.S_ISFIFO(mode) and pipe_deadline_s is not None:
            raw = _read_pipe(fd, limit, pipe_deadline_s)
        elif not stat.S_ISREG(mode):
            raise JsonFileError(f"{path}: not a regular file, so not a {what}")
        else:
            with open(fd, "rb", closefd=False) as fh:
                raw = fh.read(limit + 1)
    except TimeoutError:
        raise JsonFileError(
            f"{path}: a pipe that wrote nothing to its end within {pipe_deadline_s:g} s"
        ) from None
    finally:
        os.close(fd)
    if len(raw) > limit:
        raise JsonFileError(f"{path}: over {_size_text(limit)}, so not a {what}")
    return raw


def read_bounded(
    path: str | os.PathLike[str],
    what: str,
    limit: int,
    *,
    pipe_deadline_s: float | None = None,
) -> bytes:
    """read_limited, with every OSError a JsonFileError too."""
    try:
        return read_limited(path, what, limit, pipe_deadline_s=pipe_deadline_s)
    except FileNotFoundError:
        raise JsonFileError(f"{path}: cannot read it (no such file)") from None
    except IsADirectoryError:
        raise JsonFileError(f"{path}: a directory, not a {what}") from None
    except OSError as exc:
        raise JsonFileError(f"{path}: cannot read it ({exc.strerror})") from None


def parse_json(raw: bytes | str, source: str, what: str) -> Any:
    """The JSON value in `raw`; `source` names where it came from in errors."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        raise JsonFileError(f"{source}: not UTF-8 text, so not a {what}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonFileError(f"{source}: not JSON ({exc}), so not a {what}") from None
    except RecursionError:
        raise JsonFileError(f"{source}: JSON nested too deeply, so not a {what}") from None
    except ValueError as exc:  # Python's cap on integer digits (sys.int_info)
        raise JsonFileError(f"{source}: not usable JSON ({exc}), so not a {what}") from None


def read_json_object(
    path: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """The JSON object in `path`; `what` names it in errors ("facts file")."""
    doc = parse_json(read_bounded(path, what, limit), str(path), what)
    if not isinstance(doc, dict):
        raise JsonFileError(f"{path}: a JSON {type(doc).__name__}, not a {what} (an object)")
    return doc
