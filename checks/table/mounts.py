"""Small real filesystems for the tests that need a full disk or a read-only one.

A tmpfs of a few hundred KiB runs out of space for real (ENOSPC from the
kernel), and remounted read-only refuses writes for real (EROFS), even to
root, which `chmod 0555` does not stop. Mounting needs root (CI runs as root);
where it is not permitted the test is skipped, saying why.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], capture_output=True, text=True, check=False)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's syntax: 256k, 2m) at `path`, unmounted afterwards."""
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here")
    path.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, options: str) -> None:
    """Change a mount made by tmpfs(): "ro", "rw", "size=4m"."""
    done = _mount("-o", f"remount,{options}", str(path))
    assert done.returncode == 0, done.stderr
