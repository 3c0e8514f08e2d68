#!/usr/bin/env python3
"""`flashnext table prepare` throughput vs a plain sequential copy of the same bytes, same disk.

    python checks/bench/prepare_throughput.py [--dir DIR] [--size-gib 4] [--json]

Writes (once, reused) a synthetic checkpoint under DIR: 128 PLE shards of
random BF16 rows in 8 safetensors files, names and headers as in the real
export. Baselines: "plain_copy" copies those 8 files' bytes sequentially into
one file (read/write, 64 MiB buffers, then fsync: `cat files > out; sync`);
"cp" runs coreutils cp on them (copy_file_range) and fsyncs the copies. Then
prepare_table (with force: this disk may be one prepare refuses).
The page cache of the source files is dropped before each arm, both outputs are
fsynced and deleted. Prints the ratio prepare/copy from one run (goal >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

SHARDS = 128
FILES = 8
DIM = 160
ROW_BYTES = DIM * 2
PREFIX = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
CHUNK = 64 << 20


def write_checkpoint(root: Path, rows_per_shard: int) -> list[Path]:
    """Config + 8 safetensors files of random rows; reused when already complete."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = root / "complete.json"
    want = {"rows_per_shard": rows_per_shard, "shards": SHARDS, "files": FILES}
    files = [root / f"model-{i + 1:05d}-of-{FILES:05d}.safetensors" for i in range(FILES)]
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return files
    text_config = {"ple_embed_dim": DIM * 16, "ngram_size": 3, "heads_per_ngram": 8,
                   "split_ngram_parts": SHARDS}  # fmt: skip
    (root / "config.json").write_text(json.dumps({"text_config": text_config}))
    per_file = SHARDS // FILES
    nbytes = rows_per_shard * ROW_BYTES
    weight_map = {}
    for f_index, path in enumerate(files):
        header: dict[str, object] = {}
        for k in range(per_file):
            name = f"{PREFIX}.shard_{f_index * per_file + k}.weight"
            header[name] = {"dtype": "BF16", "shape": [rows_per_shard, DIM],
                            "data_offsets": [k * nbytes, (k + 1) * nbytes]}  # fmt: skip
            weight_map[name] = path.name
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with path.open("wb") as out:
            out.write(struct.pack("<Q", len(raw)) + raw)
            left = per_file * nbytes
            while left:
                n = min(CHUNK, left)
                out.write(os.urandom(n))
                left -= n
            out.flush()
            os.fsync(out.fileno())
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stamp.write_text(json.dumps(want))
    return files


def drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def plain_copy(files: list[Path], out: Path) -> int:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    with out.open("wb", buffering=0) as dst:
        for path in files:
            with path.open("rb", buffering=0) as src:
                while n := src.readinto(buf):
                    dst.write(view[:n])
                    total += n
        os.fsync(dst.fileno())
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/flashnext/bench")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from flashnext.table.prepare import paths_for, prepare_table
    from flashnext.table.verify import verify_table

    rows_per_shard = int(args.size_gib * (1 << 30)) // SHARDS // ROW_BYTES
    model = args.dir / "prepare-model"
    files = write_checkpoint(model, rows_per_shard)

    def copy_arm() -> tuple[int, float]:
        out = args.dir / "plain-copy.bin"
        drop_cache(files)
        t0 = time.perf_counter()
        n = plain_copy(files, out)
        seconds = time.perf_counter() - t0
        out.unlink()
        return n, seconds

    def cp_arm() -> tuple[int, float]:
        out = args.dir / "cp-copy"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        drop_cache(files)
        t0 = time.perf_counter()
        subprocess.run(["cp", *map(str, files), str(out)], check=True)
        for path in out.iterdir():
            fd = os.open(path, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        seconds = time.perf_counter() - t0
        n = sum(p.stat().st_size for p in out.iterdir())
        shutil.rmtree(out)
        return n, seconds

    def prepare_arm(file_layout: str = "packed") -> tuple[int, float]:
        table = args.dir / "ple-prepared.bin"
        for p in (table, *paths_for(table)):
            p.unlink(missing_ok=True)
        drop_cache(files)
        result = prepare_table(model, table, force=True, file_layout=file_layout)
        # A fast copy of the wrong bytes would be no result: sample rows.
        check = verify_table(model, table, samples=4096)
        if not check.ok:
            raise SystemExit(f"prepared table differs from the shards: {check.mismatch}")
        for p in (table, *paths_for(table)):
            p.unlink(missing_ok=True)
        # The checkpoint's bytes, not the file's: a page-aligned file also
        # holds padding, which must not count as throughput.
        return SHARDS * rows_per_shard * ROW_BYTES, result.seconds

    # Interleaved, twice each: the disk (and a VM host's cache below it) warms
    # up over a run; the faster of each arm's two tries is compared.
    # prepare_aligned writes 6.7% more bytes (page padding); every rate counts
    # the checkpoint's bytes.
    runs = {"plain_copy": [], "cp": [], "prepare": [], "prepare_aligned": []}
    for _ in range(2):
        runs["plain_copy"].append(copy_arm())
        runs["cp"].append(cp_arm())
        runs["prepare"].append(prepare_arm())
        runs["prepare_aligned"].append(prepare_arm("page-aligned"))
    best = {k: max(n / s for n, s in v) for k, v in runs.items()}
    doc = {
        arm: {"tries": [{"bytes": n, "seconds": s, "bytes_per_second": n / s} for n, s in v],
              "best_bytes_per_second": best[arm]}
        for arm, v in runs.items()
    }  # fmt: skip
    # Against the faster of the two copies: the bar the tool has to clear.
    baseline = max(best["plain_copy"], best["cp"])
    doc["prepare_over_copy"] = best["prepare"] / baseline
    doc["prepare_aligned_over_copy"] = best["prepare_aligned"] / baseline
    doc["goal"] = 0.8
    if args.json:
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        mib = 1 << 20
        for arm, tries in runs.items():
            rates = ", ".join(f"{n / s / mib:.0f}" for n, s in tries)
            print(f"{arm:>10}: {tries[0][0] / mib:.0f} MiB, MiB/s per try: {rates}")
        print(
            f"prepare / fastest plain copy = {doc['prepare_over_copy']:.2f}, "
            f"page-aligned prepare / fastest plain copy = {doc['prepare_aligned_over_copy']:.2f} "
            "(best of 2 tries each, interleaved)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
