"""Steady writeback for a long sequential write (Linux sync_file_range).

Left to itself the kernel lets dirty pages pile up (gigabytes) and then
writes them in bursts, and every fdatasync stalls the copy until the pile is
on disk. Starting each chunk's writeback right after it is written, and
waiting for the previous chunk before dropping it from the page cache, keeps
the disk busy all the time with at most two chunks dirty.
"""

from __future__ import annotations

import ctypes
import os

_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4

try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except AttributeError:  # not Linux/glibc: fdatasync alone still makes it durable
    _sync_file_range = None


def _range(fd: int, offset: int, length: int, flags: int) -> None:
    if _sync_file_range is not None and _sync_file_range(fd, offset, length, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


class Writeback:
    """Call written(offset, length) after each chunk; durability still needs fdatasync."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending: tuple[int, int] | None = None

    def written(self, offset: int, length: int) -> None:
        _range(self.fd, offset, length, _WRITE)
        if self._pending is not None:
            self._settle(*self._pending)
        self._pending = (offset, length)

    def finish(self) -> None:
        if self._pending is not None:
            self._settle(*self._pending)
            self._pending = None

    def _settle(self, offset: int, length: int) -> None:
        _range(self.fd, offset, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        # Written pages are not read again: keep the page cache for others.
        os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
