"""Where row r of the flat table file lies: the one place that knows the two layouts.

- packed: rows back to back, row r at r * row_bytes (the seed's format, the
  default). With 320-byte rows, 4 of every 64 rows straddle a 4 KiB page, so a
  random row costs 1 + 1/16 page reads on average.
- page-aligned: as many whole rows as fit in a page, then zero padding up to the
  page end (12 x 320 = 3840 bytes of rows + 256 bytes of padding). No row
  straddles a page: a random row costs exactly one page read.

The patched vLLM (patch 0010, ple_mmap.py) repeats this arithmetic; the
manifest's "layout" key tells it which one a file uses.

Pure arithmetic, no imports from the rest of flashnext (preflight and the
benchmarks use it too).
"""

from __future__ import annotations

PACKED = "packed"
PAGE_ALIGNED = "page-aligned"
LAYOUTS = (PACKED, PAGE_ALIGNED)
DEFAULT_LAYOUT = PACKED

# The page the kernel faults in on a miss: 4096 on x86_64, the only platform
# this kit serves on (vLLM's CUDA wheels). The file must not depend on the
# host that reads it, so this is a constant, not mmap.PAGESIZE.
PAGE_BYTES = 4096


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown table layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    return layout


def rows_per_page(row_bytes: int) -> int:
    """Whole rows in one page of the page-aligned layout (12 for 320-byte rows)."""
    if not 0 < row_bytes <= PAGE_BYTES:
        raise ValueError(
            f"a page-aligned table needs rows of 1..{PAGE_BYTES} bytes, not {row_bytes}"
        )
    return PAGE_BYTES // row_bytes


def table_bytes(rows: int, row_bytes: int, layout: str) -> int:
    """Exact size of a flat table file of `rows` rows in `layout`."""
    if check_layout(layout) == PACKED:
        return rows * row_bytes
    per = rows_per_page(row_bytes)
    return -(-rows // per) * PAGE_BYTES


def row_offset(row: int, row_bytes: int, layout: str) -> int:
    """Byte offset of row `row` in the file."""
    if check_layout(layout) == PACKED:
        return row * row_bytes
    per = rows_per_page(row_bytes)
    return (row // per) * PAGE_BYTES + (row % per) * row_bytes


def layouts_matching(size: int, rows: int, row_bytes: int) -> list[str]:
    """The layouts whose exact size is `size` (empty: a truncated or foreign file)."""
    return [name for name in LAYOUTS if table_bytes(rows, row_bytes, name) == size]


def both_sizes(rows: int, row_bytes: int) -> str:
    """Every layout's exact size, for messages about a table of the wrong size."""
    return ", ".join(f"{table_bytes(rows, row_bytes, name)} bytes {name}" for name in LAYOUTS)
