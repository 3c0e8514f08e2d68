"""`flashnext table verify`: size and shape, then random rows byte-compared with the shards.

The file's layout (packed or page-aligned) comes from its manifest; a table
without one is taken as packed (the seed's format).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from flashnext.facts.jsonfile import JsonFileError, read_json_object
from flashnext.facts.manifest import MAX_MANIFEST_BYTES
from flashnext.read_errors import not_a_file
from flashnext.table.errors import TableError
from flashnext.table.file_layout import (
    LAYOUTS,
    PACKED,
    PAGE_BYTES,
    both_sizes,
    layouts_matching,
    row_offset,
    rows_per_page,
)
from flashnext.table.layout import TableLayout, read_layout
from flashnext.table.path_kind import (
    interrupted_prepare_output,
    non_file_kind,
    partial_message,
    rewrite_fix,
)
from flashnext.table.prepare import paths_for, write_json_atomic
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
    layout: str
    """"packed" or "page-aligned" (from the manifest; packed without one)."""
    total_bytes: int
    size_bytes: int
    manifest: str | None
    """Manifest path when one sits beside the table (checked), else None."""
    samples: int
    seed: int
    mismatch: RowMismatch | None
    padding_ok: bool = True
    """Page-aligned: the padding of the first and last page is zero."""

    @property
    def ok(self) -> bool:
        return self.mismatch is None and self.padding_ok


def sample_rows(layout: TableLayout, samples: int, seed: int) -> Iterator[int]:
    """First and last row (the ends catch off-by-one layouts), then random rows.

    Asking for at least as many samples as rows compares every row, in order.
    Streamed, one row at a time: --samples is the user's number, and a list of it
    (or of the table's 320M rows) would not fit in memory.
    """
    if samples >= layout.rows:
        yield from range(layout.rows)
        return
    rng = random.Random(seed)
    yield from (0, layout.rows - 1)[: min(samples, 2)]
    for _ in range(samples - 2):
        yield rng.randrange(layout.rows)


def _read_manifest(manifest: Path, fix: str) -> dict:
    try:
        doc = read_json_object(manifest, "table manifest", MAX_MANIFEST_BYTES)
    except JsonFileError as exc:
        raise TableError(f"{manifest}: unreadable ({exc})", fix=fix) from exc
    if not isinstance(doc, dict):
        raise TableError(f"{manifest}: not a JSON object", fix=fix)
    return doc


def manifest_layout(doc: dict, manifest: Path, fix: str) -> str:
    """The file layout a manifest records; manifests from before layouts existed: packed."""
    file_layout = doc.get("layout", PACKED)
    if file_layout not in LAYOUTS:
        raise TableError(
            f"{manifest}: layout is {file_layout!r}, expected one of {', '.join(LAYOUTS)}",
            fix=fix,
        )
    return file_layout


def _check_manifest(
    layout: TableLayout, doc: dict, manifest: Path, file_layout: str, fix: str
) -> None:
    want = layout.manifest(file_layout)
    for key in ("dtype", "rows", "dim", "row_bytes", "total_bytes"):
        if doc.get(key) != want[key]:
            raise TableError(
                f"{manifest}: {key} is {doc.get(key)!r}, the checkpoint implies {want[key]!r}",
                fix=fix,
            )


def _size_error(
    path: Path, size: int, layout: TableLayout, file_layout: str, has_manifest: bool
) -> TableError:
    """The size is wrong for the layout: name both layouts' sizes, and the one it fits."""
    source = "per its manifest" if has_manifest else "assumed: no manifest beside it"
    fits = layouts_matching(size, layout.rows, layout.row_bytes)
    hint = f"; the size is the {fits[0]} one: its manifest is missing or stale" if fits else ""
    return TableError(
        f"{path}: {size} bytes, expected {layout.file_bytes(file_layout)} "
        f"({layout.rows} rows x {layout.dim} x {layout.dtype}, {file_layout} layout, {source}); "
        f"the table is {both_sizes(layout.rows, layout.row_bytes)}{hint}",
        fix=f"remove it and rerun `flashnext table prepare --model {layout.model_dir} "
        f"--out {path}` (add --layout page-aligned for the page-aligned layout)",
    )


def _zero_padding(fd: int, layout: TableLayout, size: int) -> bool:
    """Page-aligned: the bytes after the rows of the first and last page are zero."""
    per = rows_per_page(layout.row_bytes)
    for page in sorted({0, size // PAGE_BYTES - 1}):
        rows_here = min(per, layout.rows - page * per)
        start = page * PAGE_BYTES + rows_here * layout.row_bytes
        length = (page + 1) * PAGE_BYTES - start
        if os.pread(fd, length, start) != bytes(length):
            return False
    return True


def _check_table_path(path: Path, model_dir: str | os.PathLike[str]) -> None:
    """The path is a table file: not a prepare's partial work, not a directory, FIFO or
    device (each named, with its own fix), and present."""
    final = interrupted_prepare_output(path)
    if final is not None:
        raise TableError(
            partial_message(path, final, str(model_dir)),
            fix=f"flashnext table prepare --model {model_dir} --out {final}",
        )
    kind = non_file_kind(path)
    if kind is not None:
        inside = f" (e.g. {path / 'ple-table.bin'})" if kind == "a directory" else ""
        raise TableError(
            f"{path}: {kind}, not a table file",
            fix=f"pass --table the file `flashnext table prepare --out` wrote{inside}",
        )
    broken = not_a_file(path)  # a symlink loop or a link to nothing is no missing table
    if broken and not path.exists():
        raise TableError(broken, fix="point --table at the file `flashnext table prepare` wrote")
    if not path.is_file():
        partial = paths_for(path.absolute())[0]
        hint = f" ({partial.name} exists: prepare was interrupted)" if partial.exists() else ""
        raise TableError(
            f"{path}: no such file{hint}",
            fix=f"flashnext table prepare --model {model_dir} --out {path}",
        )


def verify_table(
    model_dir: str | os.PathLike[str],
    table: str | os.PathLike[str],
    *,
    samples: int = 1024,
    seed: int | None = None,
    rewrite_manifest: bool = False,
) -> VerifyResult:
    """`rewrite_manifest`: ignore the manifest beside the table, take the layout its
    size fits, and write the manifest anew when the sampled rows match."""
    if samples < 0:
        raise TableError(f"--samples must be >= 0, got {samples}")
    layout = read_layout(model_dir)
    path = Path(table)
    _check_table_path(path, model_dir)
    manifest = paths_for(path.absolute())[2]
    size = path.stat().st_size
    if rewrite_manifest:  # the manifest is not read: the size says the layout
        fits = layouts_matching(size, layout.rows, layout.row_bytes)
        if not fits:
            raise _size_error(path, size, layout, PACKED, False)
        doc, file_layout = None, fits[0]
    else:
        fix = rewrite_fix(model_dir, path)
        doc = _read_manifest(manifest, fix) if manifest.exists() else None
        file_layout = manifest_layout(doc, manifest, fix) if doc is not None else PACKED
        if size != layout.file_bytes(file_layout):
            raise _size_error(path, size, layout, file_layout, doc is not None)
        if doc is not None:
            _check_manifest(layout, doc, manifest, file_layout, fix)
    seed = random.SystemRandom().randrange(1 << 32) if seed is None else seed
    fd = os.open(path, os.O_RDONLY)
    try:
        mismatch = _first_mismatch(fd, layout, file_layout, sample_rows(layout, samples, seed))
        padding_ok = file_layout == PACKED or _zero_padding(fd, layout, size)
    finally:
        os.close(fd)
    result = VerifyResult(
        str(path), layout.rows, layout.dim, layout.dtype, file_layout,
        layout.file_bytes(file_layout), size,
        str(manifest) if doc is not None or rewrite_manifest else None,
        samples, seed, mismatch, padding_ok,
    )  # fmt: skip
    if rewrite_manifest and result.ok:  # only once the rows have matched
        write_json_atomic(manifest, layout.manifest(file_layout), path.stat().st_mode & 0o777)
    return result


def _first_mismatch(
    fd: int, layout: TableLayout, file_layout: str, rows: Iterable[int]
) -> RowMismatch | None:
    rb = layout.row_bytes
    with ShardReader(layout) as reader:
        for row in rows:
            offset = row_offset(row, rb, file_layout)
            if os.pread(fd, rb, offset) != reader.read_row(row):
                shard, inner = layout.locate(row)
                return RowMismatch(row, shard.index, inner, shard.name, offset)
    return None
