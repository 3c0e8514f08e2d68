"""Write a checkpoint directory: configs, index and safetensors shards.

Shards have real headers. Data regions of the full variant are sparse (the file
is truncated up to its size after the header), so ~160 GB of checkpoint costs
only its headers on disk; the few tensors whose values are known
(`weight_shape`, the PLE hash buffers) are written for real, first in each
data region. The tiny variant writes every byte. The directory is built under a
temporary name beside the target and renamed into place, so a failure leaves
nothing half-written.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.facts.model import CONFIG_FILE, GENERATION_CONFIG_FILE, INDEX_FILE
from flashnext.facts.safetensors import tensor_nbytes
from flashnext.skeleton.inventory import Entry

# File groups in write order; each starts a new file, so the PLE table shards
# sit in files of their own that a loader can skip whole.
GROUP_ORDER = ("body", "ple", "visual", "mtp")


class SkeletonError(ValueError):
    """The skeleton cannot be written where asked; the message says why and what to do."""


@dataclass(frozen=True)
class ShardPlan:
    file: str
    entries: tuple[Entry, ...]
    offsets: tuple[tuple[int, int], ...]
    header: bytes
    """The 8-byte length prefix and the padded JSON header."""

    @property
    def data_bytes(self) -> int:
        return self.offsets[-1][1] if self.offsets else 0

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def _group_into_files(entries: Iterable[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    chunks: list[list[Entry]] = []
    by_group: dict[str, list[Entry]] = {g: [] for g in GROUP_ORDER}
    for e in entries:
        by_group[e.group].append(e)
    for group in GROUP_ORDER:
        current: list[Entry] = []
        used = 0
        for e in by_group[group]:
            n = tensor_nbytes(e.dtype, e.shape)
            if current and used + n > max_shard_bytes:
                chunks.append(current)
                current, used = [], 0
            current.append(e)
            used += n
        if current:
            chunks.append(current)
    return chunks


def _plan_shard(file: str, entries: list[Entry]) -> ShardPlan:
    # Known-value tensors first: they are then one small contiguous real extent.
    ordered = [e for e in entries if e.values is not None] + [
        e for e in entries if e.values is None
    ]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets = []
    cursor = 0
    for e in ordered:
        n = tensor_nbytes(e.dtype, e.shape)
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [cursor, cursor + n],
        }
        offsets.append((cursor, cursor + n))
        cursor += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Pad with spaces so the data region starts 8-byte aligned, as safetensors does.
    raw += b" " * (-(8 + len(raw)) % 8)
    return ShardPlan(file, tuple(ordered), tuple(offsets), struct.pack("<Q", len(raw)) + raw)


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[ShardPlan]:
    chunks = _group_into_files(entries, max_shard_bytes)
    total = len(chunks)
    return [
        _plan_shard(f"model-{i + 1:05d}-of-{total:05d}.safetensors", chunk)
        for i, chunk in enumerate(chunks)
    ]


def _value_bytes(e: Entry) -> bytes:
    assert e.values is not None and e.dtype == "I64"
    return struct.pack(f"<{len(e.values)}q", *e.values)


def _ple_row_pattern(e: Entry, start_row: int) -> bytes:
    """Tiny PLE shard rows filled with (global row % 256) as BF16, so a gather can be checked."""
    rows, cols = e.shape
    out = bytearray()
    for r in range(rows):
        bits = struct.unpack("<I", struct.pack("<f", float((start_row + r) % 256)))[0] >> 16
        out += struct.pack("<H", bits) * cols
    return bytes(out)


def _write_shard(path: Path, plan: ShardPlan, real_data: bool, ple_starts: dict[str, int]) -> None:
    with open(path, "wb") as fh:
        fh.write(plan.header)
        base = len(plan.header)
        for e, (start, end) in zip(plan.entries, plan.offsets, strict=True):
            if e.values is not None:
                fh.seek(base + start)
                fh.write(_value_bytes(e))
            elif real_data:
                fh.seek(base + start)
                if e.name in ple_starts:
                    fh.write(_ple_row_pattern(e, ple_starts[e.name]))
                else:
                    fh.write(bytes(end - start))
        # Extends the file to its full size; never-written ranges stay holes.
        fh.truncate(plan.size)


def write_checkpoint_dir(
    out_dir: Path,
    *,
    config: dict[str, Any],
    generation_config: dict[str, Any],
    entries: list[Entry],
    max_shard_bytes: int,
    real_data: bool,
) -> list[ShardPlan]:
    """Write the whole directory atomically; refuses a non-empty target."""
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise SkeletonError(
            f"{out_dir} exists and is not an empty directory; choose a new path or remove it first"
        )
    parent = out_dir.parent
    if not parent.is_dir():
        raise SkeletonError(f"{parent} does not exist; create it first (mkdir -p {parent})")
    plans = plan_shards(entries, max_shard_bytes)
    ple_starts = _ple_start_rows(entries)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=parent))
    except PermissionError as exc:
        raise SkeletonError(f"{parent} is not writable; choose a directory you can write") from exc
    try:
        for plan in plans:
            _write_shard(tmp / plan.file, plan, real_data, ple_starts)
        weight_map = {e.name: plan.file for plan in plans for e in plan.entries}
        total = sum(plan.data_bytes for plan in plans)
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / CONFIG_FILE, config)
        _write_json(tmp / GENERATION_CONFIG_FILE, generation_config)
        os.chmod(tmp, 0o755)
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above); rename needs the name free
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return plans


def _ple_start_rows(entries: list[Entry]) -> dict[str, int]:
    """Global table row of each PLE shard's first row (shards in index order)."""
    starts: dict[str, int] = {}
    row = 0
    for e in entries:
        if e.group == "ple":
            starts[e.name] = row
            row += e.shape[0]
    return starts


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
