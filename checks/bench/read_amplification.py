#!/usr/bin/env python3
"""Bytes read from storage per token for PLE gathers through an mmap: readahead vs MADV_RANDOM.

    python checks/bench/read_amplification.py [--dir DIR] [--size-gib 4] [--tokens 2000] [--json]

A synthetic table (random bytes, 320-byte rows like the real one) is written
once under DIR and reused. Before each arm the file's page cache is dropped
(posix_fadvise DONTNEED, checked with mincore). Each arm maps the file read-only,
optionally madvise(MADV_RANDOM)s it, and copies 16 random rows per token, as the
patched vLLM's host gather does. Bytes read from storage are this process's
/proc/self/io read_bytes delta; mincore counts the pages that became resident.

One run, one ratio: this is a measurement to record, not a timed test.
The floor for 320-byte rows: 16 rows x (1 + P(row straddles a page)) pages per token.
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


def ensure_table(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    tmp = path.with_name(path.name + ".tmp")
    chunk = 64 << 20
    with tmp.open("wb") as f:
        left = size
        while left:
            n = min(chunk, left)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def drop_cache(fd: int) -> None:
    os.fdatasync(fd)  # DONTNEED skips dirty pages
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def run_arm(path: Path, advice: str, tokens: int, seed: int) -> dict[str, float]:
    size = path.stat().st_size
    rows = size // ROW_BYTES
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
            staging = bytearray(ROW_BYTES * ROWS_PER_TOKEN)
            io0, t0 = read_bytes(), time.perf_counter()
            for t in range(tokens):
                for k in range(ROWS_PER_TOKEN):
                    off = ids[t * ROWS_PER_TOKEN + k] * ROW_BYTES
                    row = ctypes.string_at(addr + off, ROW_BYTES)
                    staging[k * ROW_BYTES : (k + 1) * ROW_BYTES] = row
            seconds = time.perf_counter() - t0
            io = read_bytes() - io0
            after_pages = resident_pages(addr, size)
        finally:
            libc_call("munmap", ctypes.c_void_p(addr), ctypes.c_size_t(size))
        first_page = [r * ROW_BYTES // PAGE for r in ids]
        last_page = [(r * ROW_BYTES + ROW_BYTES - 1) // PAGE for r in ids]
        straddle = sum(a != b for a, b in zip(first_page, last_page, strict=True))
        return {
            "advice": advice,
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
    size = int(args.size_gib * (1 << 30)) // ROW_BYTES * ROW_BYTES
    path = args.dir / "ple-synthetic.bin"
    ensure_table(path, size)
    arms = [run_arm(path, a, args.tokens, args.seed) for a in ("default", "random")]
    ratio = arms[0]["read_bytes_per_token"] / max(arms[1]["read_bytes_per_token"], 1.0)
    dev = os.stat(path).st_dev
    result = {
        "table_bytes": size,
        "tokens": args.tokens,
        "rows_per_token": ROWS_PER_TOKEN,
        "page_bytes": PAGE,
        "device": f"{os.major(dev)}:{os.minor(dev)}",
        "arms": arms,
        "readahead_over_random": ratio,
        "goal_random_kib_per_token": 64,
        "goal_ratio": 14,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        for arm in arms:
            print(
                f"{arm['advice']:>8}: {arm['read_bytes_per_token'] / 1024:8.1f} KiB/token read "
                f"({arm['resident_bytes_per_token'] / 1024:.1f} KiB/token newly resident, "
                f"floor {arm['floor_bytes_per_token'] / 1024:.1f}), "
                f"{arm['ms_per_token']:.3f} ms/token"
            )
        print(f"readahead / MADV_RANDOM = {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
