"""`flashnext table verify`: size and shape, then random rows byte-compared with the shards."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from flashnext.table.errors import TableError
from flashnext.table.layout import TableLayout, read_layout
from flashnext.table.prepare import paths_for
from flashnext.table.source import ShardReader


@dataclass(frozen=True)
class RowMismatch:
    row: int
    shard: int
    shard_row: int
    shard_name: str
    table_offset_bytes: int


@dataclass(frozen=True)
class VerifyResult:
    table: str
    rows: int
    dim: int
    dtype: str
    total_bytes: int
    size_bytes: int
    manifest: str | None
    """Manifest path when one sits beside the table (checked), else None."""
    samples: int
    seed: int
    mismatch: RowMismatch | None

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def sample_rows(layout: TableLayout, samples: int, seed: int) -> list[int]:
    """First and last row (the ends catch off-by-one layouts), then random rows.

    Asking for at least as many samples as rows compares every row, in order.
    """
    if samples >= layout.rows:
        return list(range(layout.rows))
    rng = random.Random(seed)
    ends = [0, layout.rows - 1]
    return ends[: min(samples, 2)] + [rng.randrange(layout.rows) for _ in range(samples - 2)]


def _check_manifest(layout: TableLayout, manifest: Path) -> None:
    try:
        doc = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        raise TableError(
            f"{manifest}: unreadable ({exc})", fix="rerun `flashnext table prepare`"
        ) from exc
    want = layout.manifest()
    for key in ("dtype", "rows", "dim", "row_bytes", "total_bytes"):
        if doc.get(key) != want[key]:
            raise TableError(
                f"{manifest}: {key} is {doc.get(key)!r}, the checkpoint implies {want[key]!r}",
                fix="rerun `flashnext table prepare` for this checkpoint",
            )


def verify_table(
    model_dir: str | os.PathLike[str],
    table: str | os.PathLike[str],
    *,
    samples: int = 1024,
    seed: int | None = None,
) -> VerifyResult:
    if samples < 0:
        raise TableError(f"--samples must be >= 0, got {samples}")
    layout = read_layout(model_dir)
    path = Path(table)
    if not path.is_file():
        partial = paths_for(path.absolute())[0]
        hint = f" ({partial.name} exists: prepare was interrupted)" if partial.exists() else ""
        raise TableError(
            f"{path}: no such file{hint}",
            fix=f"flashnext table prepare --model {model_dir} --out {path}",
        )
    size = path.stat().st_size
    if size != layout.total_bytes:
        raise TableError(
            f"{path}: {size} bytes, expected {layout.total_bytes} "
            f"({layout.rows} rows x {layout.dim} x {layout.dtype})",
            fix=f"flashnext table prepare --model {model_dir} --out {path}",
        )
    manifest = paths_for(path.absolute())[2]
    if manifest.exists():
        _check_manifest(layout, manifest)
    seed = random.SystemRandom().randrange(1 << 32) if seed is None else seed
    mismatch = None
    rb = layout.row_bytes
    fd = os.open(path, os.O_RDONLY)
    try:
        with ShardReader(layout) as reader:
            for row in sample_rows(layout, samples, seed):
                if os.pread(fd, rb, row * rb) != reader.read_row(row):
                    shard, inner = layout.locate(row)
                    mismatch = RowMismatch(row, shard.index, inner, shard.name, row * rb)
                    break
    finally:
        os.close(fd)
    return VerifyResult(
        str(path), layout.rows, layout.dim, layout.dtype, layout.total_bytes, size,
        str(manifest) if manifest.exists() else None, samples, seed, mismatch,
    )  # fmt: skip
