"""`flashnext table prepare`: the PLE shards → one flat file, streaming, resumable, atomic.

Write order, so that a crash at any point leaves something a rerun can trust:
  data → fdatasync(OUT.partial) → journal OUT.partial.json {identity, committed_bytes}
  (temp + rename), ..., then manifest OUT.json, rename OUT.partial → OUT, fsync the dir.
A rerun truncates OUT.partial to the journal's committed_bytes (dropping unsynced
bytes), re-reads the last committed chunk and sampled rows against the shards, and
continues from there. Memory stays bounded: one chunk in flight at most, and synced
ranges are dropped from the page cache (95 GiB would otherwise evict everything else).
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic
from flashnext.table.errors import TableError
from flashnext.table.layout import TableLayout, read_layout
from flashnext.table.source import ShardReader
from flashnext.table.storage_policy import space_refusal, storage_refusal
from flashnext.table.writeback import Writeback

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_SYNC_BYTES = 1 << 30
RESUME_SAMPLE_ROWS = 64

Progress = Callable[[int, int], None]
"""on_progress(done_bytes, total_bytes)."""


@dataclass(frozen=True)
class PrepareResult:
    table: str
    manifest: str
    status: str
    """"written" (from scratch), "resumed", or "present" (already complete)."""
    total_bytes: int
    resumed_from_bytes: int
    copied_bytes: int
    seconds: float
    storage_warning: str | None
    """The refusal that --force overrode, if any."""

    @property
    def bytes_per_second(self) -> float:
        return self.copied_bytes / self.seconds if self.seconds > 0 else 0.0


def paths_for(out: Path) -> tuple[Path, Path, Path]:
    """(OUT.partial, OUT.partial.json journal, OUT.json manifest)."""
    return (
        out.with_name(out.name + ".partial"),
        out.with_name(out.name + ".partial.json"),
        out.with_name(out.name + ".json"),
    )


def write_json_atomic(path: Path, doc: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(doc, sort_keys=True, indent=2) + "\n")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def check_storage(out: Path, layout: TableLayout, force: bool) -> str | None:
    """Refuse a bad output filesystem (unless force) or too little space; return the warning."""
    from flashnext.facts.storage import probe_storage  # the one module that reads mounts

    facts = probe_storage(str(out.parent))
    needed = layout.total_bytes - (out.stat().st_size if out.exists() else 0)
    partial, _, _ = paths_for(out)
    if partial.exists():
        needed -= partial.stat().st_size
    short = space_refusal(facts, max(needed, 0))
    if short:
        raise TableError(short, fix="free space there or choose another --out")
    refusal = storage_refusal(facts)
    if refusal and not force:
        raise TableError(
            refusal,
            fix="put --out on a local NVMe (or SSD) filesystem, or pass --force to accept it",
        )
    return refusal


def _same_bytes(reader: ShardReader, fd: int, offset: int, length: int) -> bool:
    return os.pread(fd, length, offset) == reader.read(offset, length)


def _lock(fd: int, partial: Path) -> None:
    """One writer per output: a second prepare would interleave its bytes."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise TableError(
            f"another `flashnext table prepare` is writing {partial}",
            fix="wait for it to finish (or stop it; a rerun resumes its work)",
        ) from None


def _remove_stale_temps(out: Path) -> None:
    """Temp files of journal/manifest writes a killed run left (we hold the lock now)."""
    for pattern in (f".{out.name}.partial.json.*.tmp", f".{out.name}.json.*.tmp"):
        for stale in out.parent.glob(pattern):
            stale.unlink(missing_ok=True)


def committed_prefix(
    layout: TableLayout, partial: Path, journal: Path, identity: str, chunk_bytes: int
) -> int:
    """How many bytes of OUT.partial a rerun may keep: journal-backed and re-checked."""
    doc = _read_json(journal)
    if not doc or doc.get("identity") != identity or not partial.exists():
        return 0
    committed = doc.get("committed_bytes")
    if not isinstance(committed, int) or not 0 <= committed <= layout.total_bytes:
        return 0
    if partial.stat().st_size < committed:
        return 0
    if committed == 0:
        return 0
    fd = os.open(partial, os.O_RDONLY)
    try:
        with ShardReader(layout) as reader:
            tail = min(chunk_bytes, committed)
            if not _same_bytes(reader, fd, committed - tail, tail):
                return 0
            rng = random.Random(committed)
            rows = committed // layout.row_bytes
            for _ in range(min(RESUME_SAMPLE_ROWS, rows)):
                off = rng.randrange(rows) * layout.row_bytes
                if not _same_bytes(reader, fd, off, layout.row_bytes):
                    return 0
    finally:
        os.close(fd)
    return committed


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    """Kernel-side copy where the filesystem allows it; pread/pwrite otherwise."""
    done = 0
    while done < n:
        try:
            got = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
        except OSError:
            got = 0
        if got <= 0:
            data = os.pread(src_fd, n - done, src_off + done)
            if not data:
                raise OSError(f"unexpected end of shard file at {src_off + done}")
            got = os.pwrite(dst_fd, data, dst_off + done)
        done += got


def _stream(
    layout: TableLayout,
    dst_fd: int,
    start: int,
    journal: Path,
    identity: str,
    chunk_bytes: int,
    sync_bytes: int,
    on_progress: Progress | None,
) -> None:
    total = layout.total_bytes
    since_sync = 0
    writeback = Writeback(dst_fd)
    with ShardReader(layout) as reader:
        pos = start
        while pos < total:
            n = min(chunk_bytes, total - pos)
            for shard, inner, length in reader.spans(pos, n):
                src = reader.fd_for(shard)
                src_off = shard.data_offset_bytes + inner
                _copy_range(src, src_off, dst_fd, pos, length)
                # The shards are read once; keep them from crowding the page cache.
                os.posix_fadvise(src, src_off, length, os.POSIX_FADV_DONTNEED)
                writeback.written(pos, length)
                pos += length
            since_sync += n
            if since_sync >= sync_bytes or pos == total:
                writeback.finish()
                os.fdatasync(dst_fd)
                write_json_atomic(journal, {"identity": identity, "committed_bytes": pos})
                since_sync = 0
            if on_progress:
                on_progress(pos, total)


def prepare_table(
    model_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    sync_bytes: int = DEFAULT_SYNC_BYTES,
    on_progress: Progress | None = None,
) -> PrepareResult:
    t0 = time.monotonic()
    layout = read_layout(model_dir)
    out = Path(out).absolute()
    if not out.parent.is_dir():
        raise TableError(f"{out.parent}: directory does not exist", fix=f"mkdir -p {out.parent}")
    if out.is_dir():
        raise TableError(f"{out} is a directory", fix="pass --out a file path, e.g. DIR/ple.bin")
    partial, journal, manifest_path = paths_for(out)
    identity = layout.identity()
    manifest = layout.manifest()

    if out.exists():
        present = _read_json(manifest_path)
        if (
            present
            and present.get("source_identity") == identity
            and out.stat().st_size == layout.total_bytes
        ):
            return PrepareResult(
                str(out), str(manifest_path), "present", layout.total_bytes,
                layout.total_bytes, 0, time.monotonic() - t0, None,
            )  # fmt: skip
        raise TableError(
            f"{out} exists but is not this checkpoint's table (no matching {manifest_path.name})",
            fix=f"check it with `flashnext table verify --model {model_dir} --table {out}`, "
            "or remove it and rerun prepare",
        )

    warning = check_storage(out, layout, force)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        _lock(fd, partial)
        _remove_stale_temps(out)
        resume = committed_prefix(layout, partial, journal, identity, chunk_bytes)
        os.ftruncate(fd, resume)  # drop whatever was written after the last sync
        if resume == 0:
            write_json_atomic(journal, {"identity": identity, "committed_bytes": 0})
        if on_progress:
            on_progress(resume, layout.total_bytes)
        _stream(layout, fd, resume, journal, identity, chunk_bytes, sync_bytes, on_progress)
        os.fsync(fd)
        write_json_atomic(manifest_path, manifest)
        os.replace(partial, out)
        fsync_dir(out.parent)
        journal.unlink(missing_ok=True)
    finally:
        os.close(fd)
    return PrepareResult(
        str(out),
        str(manifest_path),
        "resumed" if resume else "written",
        layout.total_bytes,
        resume,
        layout.total_bytes - resume,
        time.monotonic() - t0,
        warning,
    )
