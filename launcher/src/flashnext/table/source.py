"""Read byte ranges of the flat table straight from the shards' data regions (no torch)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from flashnext.table.errors import TableError
from flashnext.table.file_layout import PACKED, PAGE_BYTES, rows_per_page
from flashnext.table.layout import PleShard, TableLayout

_ZEROS = memoryview(bytes(PAGE_BYTES))


def shard_ended(shard: PleShard, offset: int) -> TableError:
    """A shard file ended early although read_layout checked its size: it shrank since."""
    return TableError(
        f"{shard.file} ends at byte {offset}, inside {shard.name}: the file changed while "
        "it was being read (a download still running, or a disk error)",
        fix=f"re-download {shard.file}, then rerun the same command (an interrupted prepare "
        "resumes where it stopped)",
    )


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
                raise shard_ended(shard, shard.data_offset_bytes + inner + len(data))
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
            view = memoryview(self._map(shard))[start : start + n]
            if len(view) != n:
                raise shard_ended(shard, start + len(view))
            out.append(view)
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

    def file_range(self, file_layout: str, offset: int, length: int) -> bytes:
        """What bytes [offset, offset + length) of the flat file in `file_layout` must hold."""
        if file_layout == PACKED:
            return self.read(offset, length)
        return b"".join(self.page_views(offset, length))

    def page_rows(self, offset: int, length: int) -> tuple[int, int]:
        """(first row, row count) of the page-aligned file's whole pages in the range."""
        if offset % PAGE_BYTES or length % PAGE_BYTES:
            raise ValueError(f"page-aligned range {offset}+{length} is not whole pages")
        per = rows_per_page(self.layout.row_bytes)
        first = offset // PAGE_BYTES * per
        return first, max(0, min(self.layout.rows - first, length // PAGE_BYTES * per))

    def page_views(self, offset: int, length: int) -> list[memoryview]:
        """Bytes [offset, offset + length) of the page-aligned file as zero-copy pieces:
        per page, views of its rows in the mapped shards, then its zero padding.

        The range covers whole pages (the file's last page is whole too: rows,
        then zeros). Drop the views before close().
        """
        rb = self.layout.row_bytes
        per = rows_per_page(rb)
        first, rows = self.page_rows(offset, length)
        views = iter(self.views(first * rb, rows * rb))
        current = next(views, None)
        pieces: list[memoryview] = []
        for _ in range(length // PAGE_BYTES):
            need = per * rb
            while need and current is not None:
                take = current[:need]
                pieces.append(take)
                need -= len(take)
                current = current[len(take) :]
                if not len(current):
                    current = next(views, None)
            pieces.append(_ZEROS[: PAGE_BYTES - (per * rb - need)])
        return pieces

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
