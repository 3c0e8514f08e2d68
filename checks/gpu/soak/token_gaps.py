#!/usr/bin/env python3
"""The median and mean gap between a stream's tokens, per concurrency, from a bench's
raw records (`flashnext bench --out DIR` writes DIR/raw.jsonl; warm-up runs left out):
whether a batch of four costs about one request's step (RESULTS.md, run h3).

    python3 checks/gpu/soak/token_gaps.py checks/gpu/results/soak-h3/bench/raw.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def gaps_by_concurrency(raw: Path) -> dict[int, list[float]]:
    gaps: dict[int, list[float]] = {}
    for line in raw.read_text().splitlines():
        r = json.loads(line)
        if r.get("phase") != "decode" or r.get("warmup"):
            continue
        times = [t for t, _ in r.get("arrivals") or []]
        pairs = zip(times, times[1:], strict=False)
        gaps.setdefault(r["concurrency"], []).extend(b - a for a, b in pairs)
    return gaps


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not Path(argv[1]).is_file():
        print("usage: token_gaps.py RAW.jsonl (a bench's raw records)", file=sys.stderr)
        return 2
    print("concurrency  gaps  median ms  mean ms")
    for c, g in sorted(gaps_by_concurrency(Path(argv[1])).items()):
        print(f"{c:>11}  {len(g):>4}  {statistics.median(g) * 1e3:>9.1f}  "
              f"{statistics.mean(g) * 1e3:>7.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
