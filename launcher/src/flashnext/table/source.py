"""Read byte ranges of the flat table straight from the shards' data regions (no torch)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from flashnext.table.file_layout import PACKED, PAGE_BYTES, rows_per_page
from flashnext.table.layout import PleShard, TableLayout


class ShardReader:
    """Random access to the table as it lies in the checkpoint; one fd per shard file."""

    def __init__(self, layout: TableLayout) -> None:
        self.layout = layout
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        starts, offset = [], 0
        for shard in layout.shards:
            starts.append(offset)
            offset += shard.nbytes
        self._starts = starts

    def _fd(self, shard: PleShard) -> int:
        fd = self._fds.get(shard.file)
        if fd is None:
            fd = os.open(Path(self.layout.model_dir) / shard.file, os.O_RDONLY)
            self._fds[shard.file] = fd
        return fd

    def spans(self, offset: int, length: int) -> list[tuple[PleShard, int, int]]:
        """[(shard, offset within the shard's data, length)] covering a flat byte range."""
        out = []
        end = offset + length
        for shard, start in zip(self.layout.shards, self._starts, strict=True):
            lo, hi = max(offset, start), min(end, start + shard.nbytes)
            if lo < hi:
                out.append((shard, lo - start, hi - lo))
        return out

    def read(self, offset: int, length: int) -> bytes:
        parts = []
        for shard, inner, n in self.spans(offset, length):
            data = os.pread(self._fd(shard), n, shard.data_offset_bytes + inner)
            if len(data) != n:
                raise OSError(f"{shard.file}: short read at {shard.data_offset_bytes + inner}")
            parts.append(data)
        return b"".join(parts)

    def views(self, offset: int, length: int) -> list[memoryview]:
        """The flat byte range as zero-copy views of the shard files (mapped read-only).

        A write from these views copies page cache to page cache once; read()
        copies into a buffer first. Drop the views before close().
        """
        out = []
        for shard, inner, n in self.spans(offset, length):
            start = shard.data_offset_bytes + inner
            out.append(memoryview(self._map(shard))[start : start + n])
        return out

    def _map(self, shard: PleShard) -> mmap.mmap:
        mapping = self._maps.get(shard.file)
        if mapping is None:
            mapping = mmap.mmap(self._fd(shard), 0, access=mmap.ACCESS_READ)
            mapping.madvise(mmap.MADV_SEQUENTIAL)  # read once, front to back
            self._maps[shard.file] = mapping
        return mapping

    def read_row(self, row: int) -> bytes:
        rb = self.layout.row_bytes
        return self.read(row * rb, rb)

    def drop_cache(self, offset: int, length: int) -> None:
        """The shards are read once; keep them from crowding the page cache."""
        for shard, inner, n in self.spans(offset, length):
            os.posix_fadvise(self._fd(shard), shard.data_offset_bytes + inner, n,
                             os.POSIX_FADV_DONTNEED)  # fmt: skip

    def file_range(self, file_layout: str, offset: int, length: int) -> bytes | bytearray:
        """What bytes [offset, offset + length) of the flat file in `file_layout` must hold.

        Page-aligned ranges start on a page and cover whole pages (the last
        page of the file is whole too: rows, then zeros).
        """
        if file_layout == PACKED:
            return self.read(offset, length)
        if offset % PAGE_BYTES or length % PAGE_BYTES:
            raise ValueError(f"page-aligned range {offset}+{length} is not whole pages")
        rb = self.layout.row_bytes
        per = rows_per_page(rb)
        first = offset // PAGE_BYTES * per
        last = min(self.layout.rows, first + length // PAGE_BYTES * per)
        rows = memoryview(self.read(first * rb, max(last - first, 0) * rb))
        out = bytearray(length)  # zeros: the padding, and pages past the last row
        filled = per * rb
        for page, src in enumerate(range(0, len(rows), filled)):
            piece = rows[src : src + filled]
            out[page * PAGE_BYTES : page * PAGE_BYTES + len(piece)] = piece
        return out

    def fd_for(self, shard: PleShard) -> int:
        return self._fd(shard)

    def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
