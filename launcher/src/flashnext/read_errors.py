"""A read refused by permissions, said for people: the file is there and may be whole, but
this user may not read it. Downloading it again does not help; access does."""

from __future__ import annotations

import errno
import os
import pwd
import shlex
import stat
from pathlib import Path


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid {uid}"


def unreadable(path: str | os.PathLike[str], exc: OSError) -> tuple[str, str] | None:
    """(message, fix) when `exc` is this user being refused read access to `path`
    (EACCES, EPERM); None for any other failure, whose own message stands."""
    if exc.errno not in (errno.EACCES, errno.EPERM):
        return None
    user = _user_name(os.geteuid())
    quoted = shlex.quote(str(path))
    try:
        st = os.stat(path)
    except OSError:
        # stat needs no read permission, only search (x) on every directory of the path.
        parent = shlex.quote(str(Path(path).parent))
        return (
            f"{path}: not readable by this user ({user}): permission denied on a directory "
            "of its path",
            f"let {user} into the checkpoint (`chmod a+x` on each directory of the path, "
            f"`chmod -R a+rX {parent}`), or run flashnext as the checkpoint's owner",
        )
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if st.st_uid == os.geteuid():
        return (
            f"{path}: not readable by this user ({user}), its owner: permission denied ({mode})",
            f"give its owner read permission: `chmod u+r {quoted}`",
        )
    owner = _user_name(st.st_uid)
    return (
        f"{path}: not readable by this user ({user}): permission denied (owner {owner}, {mode})",
        f"make it readable for {user} (`chmod a+r {quoted}`, or `chown {user} {quoted}`), or "
        f"run flashnext as its owner ({owner})",
    )


def not_a_file(path: str | os.PathLike[str]) -> str | None:
    """Why `path` is no regular file, in words a person can act on: a symlink loop, a
    link to nothing, a FIFO, device or directory; None when it does not exist at all
    (the caller's "missing" message stands) or is a regular file."""
    if not os.path.lexists(path):
        return None
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            quoted = shlex.quote(str(path))
            return f"{path}: a symlink loop (it never reaches a file): `ls -l {quoted}`"
        if exc.errno == errno.ENOENT:
            return f"{path}: a symlink to {os.readlink(path)!r}, which does not exist"
        return f"{path}: cannot be examined ({exc.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a device or socket")  # fmt: skip
    return f"{path}: {kind}, not a regular file"
