#!/usr/bin/env python3
"""Cold and warm host gathers of one prefill chunk (8,192 rows) vs the number of threads.

    python checks/bench/gather_threads.py [--dir DIR]      # needs torch (CPU is enough)

A 2 GiB table of random 320-byte rows is written once under DIR and mapped
as the patched vLLM maps it (private, MADV_RANDOM). For each pool size the
page cache is dropped, 8,192 random rows are gathered with torch.index_select
split over that many threads (1 = one plain index_select, which itself uses
torch's intra-op threads), then the same gather is timed warm (mean of 20).
This is what chose the patch's rule: a pool of 8 only where torch has fewer
than 8 intra-op threads.
"""

from __future__ import annotations

import argparse
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROWS = (2 << 30) // 320
GATHER_ROWS = 8192


def ensure_table(path: Path) -> None:
    if path.exists() and path.stat().st_size == ROWS * 320:
        return
    with path.open("wb") as f:
        left = ROWS * 320
        while left:
            n = min(64 << 20, left)
            f.write(os.urandom(n))
            left -= n
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/flashnext/bench")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "gather-threads.bin"
    ensure_table(path)
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap.mmap(fd, ROWS * 320, access=mmap.ACCESS_COPY)
    mapping.madvise(mmap.MADV_RANDOM)
    table = torch.frombuffer(mapping, dtype=torch.bfloat16, count=ROWS * 160).view(ROWS, 160)
    out = torch.empty(GATHER_ROWS, 160, dtype=torch.bfloat16)
    print(f"torch intra-op threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    for threads in (1, 4, 8, 16, 32):
        pool = ThreadPoolExecutor(threads)

        def gather(ids: torch.Tensor, threads: int = threads, pool=pool) -> None:
            if threads == 1:
                torch.index_select(table, 0, ids, out=out)
                return
            step = -(-len(ids) // threads)
            jobs = [
                pool.submit(torch.index_select, table, 0, ids[i : i + step], out=out[i : i + step])
                for i in range(0, len(ids), step)
            ]
            for job in jobs:
                job.result()

        ids = torch.randint(0, ROWS, (GATHER_ROWS,))
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        gather(ids)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(20):
            gather(ids)
        warm = (time.perf_counter() - t0) / 20
        print(f"threads {threads:2d}: cold {cold * 1e3:7.1f} ms  warm {warm * 1e3:6.2f} ms")
        pool.shutdown()


if __name__ == "__main__":
    main()
