"""One way to read a small JSON file a user names (facts, plans, generation configs):
a regular file, at most `limit` bytes, UTF-8, JSON, an object. Anything else is a
JsonFileError whose message says which of those it is not, so callers add their fix.
Bounded, so a device or a huge file never fills memory."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_JSON_BYTES = 64 << 20  # a facts file is a few KB, a plan tens of KB


class JsonFileError(ValueError):
    """`path`: what is wrong with it (no fix: the caller knows which file it wanted)."""


def read_json_object(
    path: str | os.PathLike[str], what: str, limit: int = MAX_JSON_BYTES
) -> dict[str, Any]:
    """The JSON object in `path`; `what` names it in errors ("facts file")."""
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise JsonFileError(f"{path}: not a regular file, so not a {what}")
            raw = fh.read(limit + 1)
    except FileNotFoundError:
        raise JsonFileError(f"{path}: cannot read it (no such file)") from None
    except IsADirectoryError:
        raise JsonFileError(f"{path}: a directory, not a {what}") from None
    except OSError as exc:
        raise JsonFileError(f"{path}: cannot read it ({exc.strerror})") from None
    if len(raw) > limit:
        raise JsonFileError(f"{path}: over {limit >> 20} MiB, so not a {what}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonFileError(f"{path}: not UTF-8 text, so not a {what}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonFileError(f"{path}: not JSON ({exc}), so not a {what}") from None
    if not isinstance(doc, dict):
        raise JsonFileError(f"{path}: a JSON {type(doc).__name__}, not a {what} (an object)")
    return doc
