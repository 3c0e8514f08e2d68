"""The one way the launcher replaces a file: a reader sees the old one or the whole new
one, never half (temp file in the same directory, fsync, rename over the path).

Modes: `mode` when given (the mode of the file it describes or backs up), else the
mode of the file it replaces, else what a plain open() would give (0666 less the
umask), so a new report or facts file is as readable as any file the user writes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> None:
    path = Path(path)
    if mode is None and path.exists():
        mode = path.stat().st_mode
    fd, tmp = _create_beside(path)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if mode is not None:
                os.fchmod(fh.fileno(), mode & 0o777)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike[str], text: str, mode: int | None = None) -> None:
    """write_atomic of `text` as UTF-8."""
    write_atomic(path, text.encode("utf-8"), mode)


def _create_beside(path: Path) -> tuple[int, str]:
    """A new hidden file next to `path`, created 0666 so the umask applies (mkstemp's
    fixed 0600 would not)."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
