#!/usr/bin/env python3
"""Bytes read from storage per token for PLE gathers through an mmap, three ways.

    python checks/bench/read_amplification.py [--dir DIR] [--size-gib 4] [--tokens 2000] [--json]

Two synthetic tables of the same rows count (random bytes, 320-byte rows like
the real one) are written once under DIR and reused: packed (rows back to
back) and page-aligned (12 rows per 4 KiB page, then padding; `flashnext table
prepare --layout page-aligned`). Arms, in one run, over the same random row ids:
readahead (packed, no advice), MADV_RANDOM packed, MADV_RANDOM page-aligned.
Before each arm the file's page cache is dropped (posix_fadvise DONTNEED,
checked with mincore). Each arm maps its file read-only and copies 16 random
rows per token, as the patched vLLM's host gather does. Bytes read from
storage are this process's /proc/self/io read_bytes delta; mincore counts the
pages that became resident.

One run, its ratios: this is a measurement to record, not a timed test.
The floor: 16 rows x (1 + P(row straddles a page)) pages per token; for the
page-aligned file nothing straddles, so 16 pages = 64 KiB.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import sys
import time
from pathlib import Path

# The layout arithmetic is the launcher's own (pure, no dependencies).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launcher" / "src"))
from flashnext.table.file_layout import (  # noqa: E402
    PACKED,
    PAGE_ALIGNED,
    row_offset,
    rows_per_page,
    table_bytes,
)

ROW_BYTES = 320  # 160 BF16 values
ROWS_PER_TOKEN = 16
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes (kernel without task IO accounting)")


def libc_mmap(fd: int, length: int) -> int:
    """mmap(PROT_READ, MAP_PRIVATE) like the patched vLLM; the address as an int."""
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, ctypes.c_long]  # fmt: skip
    addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return addr


def libc_call(name: str, *args: object) -> None:
    if getattr(_libc, name)(*args) != 0:
        raise OSError(ctypes.get_errno(), f"{name} failed")


def resident_pages(addr: int, length: int) -> int:
    """Pages of the mapping in the page cache (mincore)."""
    pages = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc_call("mincore", ctypes.c_void_p(addr), ctypes.c_size_t(length), vec)
    return sum(b & 1 for b in bytes(vec))


def _chunk(layout: str, n: int) -> bytes:
    """n bytes of file content: random rows, and zero padding at page ends if aligned."""
    if layout == PACKED:
        return os.urandom(n)
    per = rows_per_page(ROW_BYTES)
    page = per * ROW_BYTES
    pad = bytes(table_bytes(per, ROW_BYTES, PAGE_ALIGNED) - page)
    pages = [os.urandom(page) + pad for _ in range(-(-n // (page + len(pad))))]
    return b"".join(pages)[:n]


def ensure_table(path: Path, rows: int, layout: str) -> None:
    size = table_bytes(rows, ROW_BYTES, layout)
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(path.name + ".tmp")
    chunk = 64 << 20  # a whole number of pages: the aligned pattern stays in step
    with tmp.open("wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(_chunk(layout, n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def drop_cache(fd: int) -> None:
    os.fdatasync(fd)  # DONTNEED skips dirty pages
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def run_arm(
    path: Path, layout: str, advice: str, rows: int, tokens: int, seed: int
) -> dict[str, float | str]:
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        drop_cache(fd)
        addr = libc_mmap(fd, size)
        try:
            if advice == "random":
                libc_call("madvise", ctypes.c_void_p(addr), ctypes.c_size_t(size),
                          mmap.MADV_RANDOM)  # fmt: skip
            before_pages = resident_pages(addr, size)
            rng = random.Random(seed)
            ids = [rng.randrange(rows) for _ in range(tokens * ROWS_PER_TOKEN)]
            offsets = [row_offset(r, ROW_BYTES, layout) for r in ids]
            staging = bytearray(ROW_BYTES * ROWS_PER_TOKEN)
            io0, t0 = read_bytes(), time.perf_counter()
            for t in range(tokens):
                for k in range(ROWS_PER_TOKEN):
                    off = offsets[t * ROWS_PER_TOKEN + k]
                    row = ctypes.string_at(addr + off, ROW_BYTES)
                    staging[k * ROW_BYTES : (k + 1) * ROW_BYTES] = row
            seconds = time.perf_counter() - t0
            io = read_bytes() - io0
            after_pages = resident_pages(addr, size)
        finally:
            libc_call("munmap", ctypes.c_void_p(addr), ctypes.c_size_t(size))
        first_page = [off // PAGE for off in offsets]
        last_page = [(off + ROW_BYTES - 1) // PAGE for off in offsets]
        straddle = sum(a != b for a, b in zip(first_page, last_page, strict=True))
        return {
            "layout": layout,
            "advice": advice,
            "file_bytes": size,
            "resident_pages_before": before_pages,
            "read_bytes_per_token": io / tokens,
            "resident_bytes_per_token": (after_pages - before_pages) * PAGE / tokens,
            "floor_bytes_per_token": (len(ids) + straddle) * PAGE / tokens,
            "ms_per_token": seconds * 1e3 / tokens,
        }
    finally:
        drop_cache(fd)
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/flashnext/bench")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    if PAGE != 4096:
        print(f"this host's page is {PAGE} bytes; the aligned layout assumes 4096", file=sys.stderr)
        return 2
    rows = int(args.size_gib * (1 << 30)) // ROW_BYTES
    paths = {
        PACKED: args.dir / "ple-synthetic.bin",
        PAGE_ALIGNED: args.dir / "ple-synthetic-aligned.bin",
    }
    for layout, path in paths.items():
        ensure_table(path, rows, layout)
    plan = [(PACKED, "default"), (PACKED, "random"), (PAGE_ALIGNED, "random")]
    arms = [run_arm(paths[lay], lay, adv, rows, args.tokens, args.seed) for lay, adv in plan]
    readahead, packed, aligned = (max(a["read_bytes_per_token"], 1.0) for a in arms)
    dev = os.stat(paths[PACKED]).st_dev
    result = {
        "table_rows": rows,
        "table_bytes": table_bytes(rows, ROW_BYTES, PACKED),
        "aligned_table_bytes": table_bytes(rows, ROW_BYTES, PAGE_ALIGNED),
        "tokens": args.tokens,
        "rows_per_token": ROWS_PER_TOKEN,
        "page_bytes": PAGE,
        "device": f"{os.major(dev)}:{os.minor(dev)}",
        "arms": arms,
        "readahead_over_random": readahead / packed,
        "readahead_over_aligned": readahead / aligned,
        "packed_over_aligned": packed / aligned,
        "goal_random_kib_per_token": 64,
        "goal_ratio": 14,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        print_table(result)
    return 0


def print_table(result: dict) -> None:
    for arm in result["arms"]:
        name = f"{arm['layout']} {'readahead' if arm['advice'] == 'default' else 'MADV_RANDOM'}"
        print(
            f"{name:>25}: {arm['read_bytes_per_token'] / 1024:8.1f} KiB/token read "
            f"({arm['resident_bytes_per_token'] / 1024:.1f} KiB/token newly resident, "
            f"floor {arm['floor_bytes_per_token'] / 1024:.1f}), "
            f"{arm['ms_per_token']:.3f} ms/token"
        )
    print(f"readahead / MADV_RANDOM packed       = {result['readahead_over_random']:.1f}x")
    print(f"readahead / MADV_RANDOM page-aligned = {result['readahead_over_aligned']:.1f}x")
    print(f"packed / page-aligned (MADV_RANDOM)  = {result['packed_over_aligned']:.3f}x")
    grow = result["aligned_table_bytes"] / result["table_bytes"]
    print(f"page-aligned file / packed file      = {grow:.4f}x")


if __name__ == "__main__":
    sys.exit(main())
