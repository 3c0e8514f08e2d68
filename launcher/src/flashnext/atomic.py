"""Write a file so that a reader sees the old one or the whole new one, never half."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """Temp file in the same directory, fsync, rename over `path`.

    The file gets `mode` when given (e.g. the mode of the file it describes or
    backs up), else the mode of the file it replaces, else mkstemp's 0600.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode & 0o777)
        elif path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
