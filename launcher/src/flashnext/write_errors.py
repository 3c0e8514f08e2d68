"""A failed write, said for people: which file or directory, what happened, no temp
name (atomic.py's .NAME.<hex> is ours, not theirs), and the fix for the common causes."""

from __future__ import annotations

import errno
import os


def write_failure(exc: OSError, where: str | os.PathLike[str]) -> tuple[str, str | None]:
    """(message, fix) for `exc`, raised while writing into the directory `where`."""
    if exc.errno == errno.EROFS:
        return f"cannot write in {where}: it is on a read-only filesystem", None
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write in {where}: permission denied", None
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = "no space left on the device" if exc.errno == errno.ENOSPC else "quota exceeded"
        return f"cannot write in {where}: {what}", f"free space on {where}, then rerun"
    return f"cannot write in {where}: {exc.strerror or exc}", None
