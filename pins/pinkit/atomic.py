"""Write files so that readers see the old content or the new one, never half.

The new file gets the mode of the file it replaces, else what a plain open()
gives (0666 less the umask): mkstemp's 0600 would make a lock file unreadable
to the other users of a shared checkout, a fixed 0644 would override the umask.
"""

import os
import tempfile
from pathlib import Path


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` via a temp file in the same dir + rename."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777 if path.exists() else _default_mode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
