"""`flashnext table prepare`: the PLE shards → one flat file, streaming, resumable, atomic.

The file is packed (rows back to back, the default) or page-aligned (whole rows
per 4 KiB page, zero padding; see file_layout.py); the manifest records which.
Write order, so that a crash at any point leaves something a rerun can trust:
  data → fdatasync(OUT.partial) → journal OUT.partial.json {identity, layout,
  committed_bytes} (temp + rename), ..., then manifest OUT.json, rename
  OUT.partial → OUT, fsync the dir.
A rerun truncates OUT.partial to the journal's committed_bytes (dropping unsynced
bytes), re-reads the last committed chunk and sampled rows against the shards, and
continues from there. Memory stays bounded: one chunk in flight at most, and synced
ranges are dropped from the page cache (95 GiB would otherwise evict everything else).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from glob import escape as glob_escape
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic
from flashnext.table.errors import TableError
from flashnext.table.file_layout import (
    DEFAULT_LAYOUT,
    PACKED,
    PAGE_BYTES,
    check_layout,
    row_offset,
    rows_per_page,
)
from flashnext.table.layout import PleShard, TableLayout, read_layout
from flashnext.table.source import ShardReader, shard_ended
from flashnext.table.storage_policy import space_refusal, storage_refusal
from flashnext.table.writeback import Writeback
from flashnext.units import size

DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_SYNC_BYTES = 1 << 30
RESUME_SAMPLE_ROWS = 64

Progress = Callable[[int, int], None]
"""on_progress(done_bytes, total_bytes)."""


class PrepareInterrupted(Exception):
    """Ctrl-C (SIGINT) during the copy: what is kept for the rerun, as one line."""

    def __init__(self, partial: Path, committed: int, total: int) -> None:
        super().__init__(
            f"interrupted: {committed} of {total} bytes are committed in {partial}; "
            "rerun the same command to resume from there"
        )


@dataclass(frozen=True)
class PrepareResult:
    table: str
    manifest: str
    layout: str
    """"packed" or "page-aligned"."""
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


def paths_for_journal(journal: Path) -> Path:
    """OUT.partial, from its journal OUT.partial.json."""
    return journal.with_name(journal.name.removesuffix(".json"))


def write_json_atomic(path: Path, doc: dict[str, Any], mode: int | None = None) -> None:
    write_text_atomic(path, json.dumps(doc, sort_keys=True, indent=2) + "\n", mode)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path: Path) -> dict[str, Any] | None:
    from flashnext.facts.jsonfile import JsonFileError, read_json_object
    from flashnext.facts.manifest import MAX_MANIFEST_BYTES

    try:  # our own journal or manifest: bounded all the same (a user can put anything there)
        return read_json_object(path, "table journal", MAX_MANIFEST_BYTES)
    except JsonFileError:
        return None


def check_storage(out: Path, layout: TableLayout, file_layout: str, force: bool) -> str | None:
    """Refuse a bad output filesystem (unless force) or too little space; return the warning."""
    from flashnext.facts.storage import probe_storage  # the one module that reads mounts

    facts = probe_storage(str(out.parent))
    needed = layout.file_bytes(file_layout) - (out.stat().st_size if out.exists() else 0)
    partial, journal, _ = paths_for(out)
    if partial.exists():  # only what the journal committed is kept (the rest is cut off),
        st = partial.stat()  # and a sparse file holds fewer bytes than its size
        needed -= min(st.st_size, st.st_blocks * 512, _committed(journal))
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


def _same_row(reader: ShardReader, fd: int, row: int, file_layout: str) -> bool:
    rb = reader.layout.row_bytes
    return os.pread(fd, rb, row_offset(row, rb, file_layout)) == reader.read_row(row)


def _write_unit(file_layout: str) -> int:
    """Page-aligned files are built page by page: chunks and commits fall on page ends."""
    return 1 if file_layout == PACKED else PAGE_BYTES


def chunk_step(chunk_bytes: int, file_layout: str) -> int:
    """Bytes per write: chunk_bytes, rounded down to whole pages for page-aligned files."""
    unit = _write_unit(file_layout)
    return max(chunk_bytes // unit, 1) * unit


def rows_in_prefix(layout: TableLayout, file_layout: str, nbytes: int) -> int:
    """Rows wholly inside the first `nbytes` of the file."""
    if file_layout == PACKED:
        return nbytes // layout.row_bytes
    return min(layout.rows, nbytes // PAGE_BYTES * rows_per_page(layout.row_bytes))


@contextmanager
def _path_lock(out: Path, error: Callable[[OSError], TableError]) -> Iterator[None]:
    """One prepare per output path for the whole run. The lock is a file beside OUT,
    not OUT.partial: removing the partial mid-run must not let a second run in. A lock
    is kept only while the path still names the locked file, so the file can be removed
    at the end (under the lock) without a window."""
    lock = out.with_name(f".{out.name}.lock")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # a read-only or full directory: named like any write
            raise error(exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise TableError(
                f"another `flashnext table prepare` is writing {out}",
                fix="wait for it to finish (or stop it; a rerun resumes its work)",
            ) from None
        if _same_file(lock, fd):
            break
        os.close(fd)  # a finishing run removed it: lock the new one
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _still_ours(partial: Path, fd: int, journal: Path) -> None:
    """OUT.partial is still the file this run writes: if it was removed (or replaced)
    mid-run, nothing is committed or moved into place, and its journal, which would
    describe bytes no file holds, goes too."""
    if _same_file(partial, fd):
        return
    journal.unlink(missing_ok=True)
    raise TableError(
        f"{partial} was removed or replaced while this run wrote it: nothing was moved to "
        f"{partial.with_name(partial.name.removesuffix('.partial'))}",
        fix="rerun the same command (it starts the copy again)",
    )


# Temp names of journal and manifest writes: atomic.py's .NAME.<12 hex digits>, and
# .NAME.<anything>.tmp of earlier flashnext versions.
_TEMP_SUFFIX = re.compile(r"[0-9a-f]{12}|.+\.tmp")


def _remove_stale_temps(out: Path) -> None:
    """Temp files of journal/manifest writes a killed run left (we hold the lock now)."""
    for name in (f".{out.name}.partial.json.", f".{out.name}.json."):
        for stale in out.parent.glob(f"{glob_escape(name)}*"):
            if _TEMP_SUFFIX.fullmatch(stale.name[len(name) :]):
                stale.unlink(missing_ok=True)


def refuse_other_layout(
    doc: dict[str, Any] | None, identity: str, file_layout: str, partial: Path
) -> None:
    """A resumable partial file of the other layout is never extended: its bytes sit elsewhere.

    Not silently restarted either (hours of copying): the user picks.
    """
    if not doc or doc.get("identity") != identity:
        return  # not resumable anyway (another checkpoint): it starts over
    if not partial.exists() or partial.stat().st_size == 0:
        return
    written = _journal_layout(doc)
    if written != file_layout and doc.get("committed_bytes"):
        raise TableError(
            f"{partial} was written with --layout {written}, this run asks for "
            f"--layout {file_layout}; its bytes cannot be continued in the other layout",
            fix=f"rerun with --layout {written} to resume it, or remove {partial} "
            f"(and {partial.name}.json) to start over in {file_layout}",
        )


def _journal_layout(doc: dict[str, Any]) -> str:
    return doc.get("layout", PACKED)  # journals from before layouts existed: packed


def committed_prefix(
    layout: TableLayout,
    file_layout: str,
    partial: Path,
    journal: Path,
    identity: str,
    chunk_bytes: int,
) -> int:
    """How many bytes of OUT.partial a rerun may keep: journal-backed and re-checked."""
    doc = _read_json(journal)
    if not doc or doc.get("identity") != identity or not partial.exists():
        return 0
    if _journal_layout(doc) != file_layout:
        return 0  # prepare_table refused before; an empty partial starts over
    committed = doc.get("committed_bytes")
    total = layout.file_bytes(file_layout)
    if not isinstance(committed, int) or not 0 < committed <= total:
        return 0
    if partial.stat().st_size < committed:
        return 0
    unit = _write_unit(file_layout)
    if committed % unit:
        return 0  # an aligned file is only ever committed at page ends
    fd = os.open(partial, os.O_RDONLY)
    try:
        with ShardReader(layout) as reader:
            start = committed - min(chunk_step(chunk_bytes, file_layout), committed)
            want = reader.file_range(file_layout, start, committed - start)
            if os.pread(fd, committed - start, start) != want:
                return 0
            rng = random.Random(committed)
            rows = rows_in_prefix(layout, file_layout, committed)
            for _ in range(min(RESUME_SAMPLE_ROWS, rows)):
                if not _same_row(reader, fd, rng.randrange(rows), file_layout):
                    return 0
    finally:
        os.close(fd)
    return committed


def _copy_range(
    shard: PleShard, src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int
) -> None:
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
                raise shard_ended(shard, src_off + done)
            got = os.pwrite(dst_fd, data, dst_off + done)
        done += got


def _copy_packed(reader: ShardReader, dst_fd: int, pos: int, n: int, wb: Writeback) -> None:
    """File bytes = checkpoint bytes: copy shard spans kernel-side."""
    start = pos
    for shard, inner, length in reader.spans(pos, n):
        _copy_range(
            shard, reader.fd_for(shard), shard.data_offset_bytes + inner, dst_fd, pos, length
        )
        wb.written(pos, length)
        pos += length
    reader.drop_cache(start, n)


def _write_aligned(reader: ShardReader, dst_fd: int, pos: int, n: int, wb: Writeback) -> None:
    """Whole pages: the rows that fall in them, then each page's zero padding.

    Vectored writes straight from the mapped shards (ShardReader.page_views),
    so Python copies nothing.
    """
    _pwritev_all(dst_fd, reader.page_views(pos, n), pos)  # the views die with the call
    first_row, rows = reader.page_rows(pos, n)
    rb = reader.layout.row_bytes
    reader.drop_cache(first_row * rb, rows * rb)
    wb.written(pos, n)


def _pwritev_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    """Write `pieces` back to back at `offset`: pwritev in batches of at most
    IOV_MAX buffers, resuming after a short write."""
    iov_max = os.sysconf("SC_IOV_MAX")
    pending = [p for p in pieces if len(p)]
    i = 0
    while i < len(pending):
        done = os.pwritev(fd, pending[i : i + iov_max], offset)
        offset += done
        while i < len(pending) and done >= len(pending[i]):
            done -= len(pending[i])
            i += 1
        if done:  # a buffer written in part: write its rest next
            pending[i] = pending[i][done:]


def _stream(
    layout: TableLayout,
    file_layout: str,
    dst_fd: int,
    start: int,
    journal: Path,
    identity: str,
    chunk_bytes: int,
    sync_bytes: int,
    on_progress: Progress | None,
) -> None:
    total = layout.file_bytes(file_layout)
    step = chunk_step(chunk_bytes, file_layout)
    write = _copy_packed if file_layout == PACKED else _write_aligned
    since_sync = 0
    writeback = Writeback(dst_fd)
    with ShardReader(layout) as reader:
        pos = start
        while pos < total:
            n = min(step, total - pos)
            write(reader, dst_fd, pos, n, writeback)
            pos += n
            since_sync += n
            if since_sync >= sync_bytes or pos == total:
                writeback.finish()
                os.fdatasync(dst_fd)
                _still_ours(paths_for_journal(journal), dst_fd, journal)
                _commit(journal, identity, file_layout, pos)
                since_sync = 0
            if on_progress:
                on_progress(pos, total)


def _commit(journal: Path, identity: str, file_layout: str, committed: int) -> None:
    doc = {"identity": identity, "layout": file_layout, "committed_bytes": committed}
    write_json_atomic(journal, doc)


def _refuse_checkpoint_files(model_dir: str | os.PathLike[str], outputs: list[Path]) -> None:
    """The table, its manifest and journal never replace a file of the checkpoint
    (`--out MODEL/config` would write its manifest over MODEL/config.json)."""
    from flashnext.input_files import OutputClash, checkpoint_files, refuse_clobbering

    try:
        refuse_clobbering(outputs, checkpoint_files(model_dir), "table prepare",
                          "pass --out a path outside the checkpoint, e.g. on the NVMe drive: "
                          "--out /nvme/flashnext/ple-table.bin")  # fmt: skip
    except OutputClash as exc:
        raise TableError(exc.message, fix=exc.fix) from None


def prepare_table(
    model_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    force: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    sync_bytes: int = DEFAULT_SYNC_BYTES,
    on_progress: Progress | None = None,
    file_layout: str = DEFAULT_LAYOUT,
) -> PrepareResult:
    """Write the flat table in `file_layout` ("packed" or "page-aligned")."""
    t0 = time.monotonic()
    try:
        check_layout(file_layout)
    except ValueError as exc:
        raise TableError(str(exc), fix="pass --layout packed or --layout page-aligned") from exc
    layout = read_layout(model_dir)
    given = Path(out).absolute()
    out = _follow_link(given)
    if not out.parent.is_dir():
        raise TableError(f"{out.parent}: directory does not exist", fix=f"mkdir -p {out.parent}")
    if out.is_dir():
        raise TableError(f"{out} is a directory", fix="pass --out a file path, e.g. DIR/ple.bin")
    partial, journal, manifest_path = paths_for(out)
    # vLLM reads PATH.json beside the path it is given: a link gets one beside it too.
    link_manifest = paths_for(given)[2] if given != out else None
    identity = layout.identity()
    manifest = layout.manifest(file_layout)
    total = layout.file_bytes(file_layout)
    shown = str(link_manifest or manifest_path)
    _refuse_checkpoint_files(
        model_dir, [given, out, partial, journal, manifest_path, *filter(None, [link_manifest])]
    )

    if out.exists():
        if _is_present(out, manifest_path, identity, file_layout, total):
            if link_manifest and _read_json(link_manifest) != manifest:
                try:
                    write_json_atomic(link_manifest, manifest, _mode(out))
                except OSError as exc:
                    raise _write_error(exc, out, journal, total, opened=True) from exc
            return PrepareResult(
                str(given), shown, file_layout, "present", total, total, 0,
                time.monotonic() - t0, None,
            )  # fmt: skip
        raise _existing_out_error(out, manifest_path, identity, file_layout, model_dir)

    refuse_other_layout(_read_json(journal), identity, file_layout, partial)
    warning = check_storage(out, layout, file_layout, force)

    def lock_error(exc: OSError) -> TableError:  # named as the partial's write would be
        return _write_error(OSError(exc.errno, exc.strerror, str(partial)), out, journal, total,
                            opened=False)  # fmt: skip

    with _path_lock(out, lock_error):
        return _copy_locked(
            layout, file_layout, given, out, manifest, total, shown, warning, t0,
            chunk_bytes, sync_bytes, on_progress,
        )  # fmt: skip


def _copy_locked(
    layout: TableLayout, file_layout: str, given: Path, out: Path, manifest: dict[str, Any],
    total: int, shown: str, warning: str | None, t0: float, chunk_bytes: int,
    sync_bytes: int, on_progress: Progress | None,
) -> PrepareResult:  # fmt: skip
    """The copy into OUT.partial and its move into place, under _path_lock."""
    partial, journal, manifest_path = paths_for(out)
    link_manifest = paths_for(given)[2] if given != out else None
    identity = layout.identity()
    if out.exists():  # another run finished it while this one waited for the lock
        raise TableError(
            f"{out} was written meanwhile by another `flashnext table prepare`",
            fix="rerun the same command: it checks the table and leaves it",
        )
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise _write_error(exc, out, journal, total, opened=False) from exc
    try:
        _remove_stale_temps(out)
        refuse_other_layout(_read_json(journal), identity, file_layout, partial)  # locked now
        resume = committed_prefix(layout, file_layout, partial, journal, identity, chunk_bytes)
        mode = os.fstat(fd).st_mode & 0o777  # the manifest is as readable as the table
        os.ftruncate(fd, resume)  # drop whatever was written after the last sync
        if resume == 0:
            _commit(journal, identity, file_layout, 0)
        if on_progress:
            on_progress(resume, total)
        _stream(layout, file_layout, fd, resume, journal, identity, chunk_bytes, sync_bytes,
                on_progress)  # fmt: skip
        os.fsync(fd)
        _still_ours(partial, fd, journal)  # only the partial this run wrote is moved
        write_json_atomic(manifest_path, manifest, mode)
        if link_manifest:
            write_json_atomic(link_manifest, manifest, mode)
        os.replace(partial, out)
        fsync_dir(out.parent)
        journal.unlink(missing_ok=True)
    except OSError as exc:
        raise _write_error(exc, out, journal, total, opened=True) from exc
    except KeyboardInterrupt:
        raise PrepareInterrupted(partial, _committed(journal), total) from None
    finally:
        os.close(fd)
    return PrepareResult(
        str(given),
        shown,
        file_layout,
        "resumed" if resume else "written",
        total,
        resume,
        total - resume,
        time.monotonic() - t0,
        warning,
    )


def _follow_link(path: Path) -> Path:
    """Where the bytes of `path` go: a symlink is followed (and kept), not replaced."""
    if not path.is_symlink():
        return path
    try:
        return path.resolve()
    except (OSError, RuntimeError) as exc:  # a loop
        raise TableError(
            f"{path} is a symlink that cannot be followed ({exc})",
            fix="point --out at a regular file path (or fix the link)",
        ) from exc


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _committed(journal: Path) -> int:
    committed = (_read_json(journal) or {}).get("committed_bytes")
    return committed if isinstance(committed, int) and committed > 0 else 0


def _write_error(exc: OSError, out: Path, journal: Path, total: int, opened: bool) -> TableError:
    """What a failed write means for the user: what happened, what is needed, what is kept."""
    where = out.parent
    target = exc.filename or paths_for(out)[0]  # what could not be written
    committed = _committed(journal)
    resume = (
        f"rerun the same command: it resumes from byte {committed}"
        if committed
        else "rerun the same command"
    )
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        need = max(total - committed, PAGE_BYTES)  # the manifest needs room too
        what = "no space left on the device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        return TableError(
            f"{where}: {what} after {committed} of the table's {total} bytes were committed; "
            f"it needs {need} bytes ({size(need)}) more there",
            fix=f"free at least {size(need)} on {where} (or pass another --out), then {resume}",
        )
    if exc.errno == errno.EROFS and not opened:
        return TableError(
            f"{where} is on a read-only filesystem: cannot write {target} (nothing was written)",
            fix="pass --out a path on a writable filesystem (or remount it read-write)",
        )
    if exc.errno in (errno.EACCES, errno.EPERM) and not opened:
        return TableError(
            f"{where}: permission denied: cannot write {target} (nothing was written)",
            fix=f"pass --out a directory you can write to, or fix its permissions (ls -ld {where})",
        )
    on = f" ({exc.filename})" if exc.filename else ""
    return TableError(
        f"preparing {out} failed: {exc.strerror or exc}{on}; {committed} of the table's "
        f"{total} bytes were committed and are kept",
        fix=f"fix the cause (a read-only remount or I/O errors: see dmesg), then {resume}",
    )


def _is_present(
    out: Path, manifest_path: Path, identity: str, file_layout: str, total: int
) -> bool:
    """OUT is already this checkpoint's table in this layout (a finished earlier run)."""
    present = _read_json(manifest_path)
    return bool(
        present
        and present.get("source_identity") == identity
        and present.get("layout", PACKED) == file_layout
        and out.stat().st_size == total
    )


def _existing_out_error(
    out: Path, manifest_path: Path, identity: str, file_layout: str, model_dir: object
) -> TableError:
    """Why an existing OUT is left alone, and what to do."""
    present = _read_json(manifest_path) or {}
    written = present.get("layout", PACKED)
    if present.get("source_identity") == identity and written != file_layout:
        return TableError(
            f"{out} is this checkpoint's table in the {written} layout, not {file_layout}",
            fix=f"keep it (serve reads the layout from {manifest_path.name}), or remove "
            f"{out} and {manifest_path.name} and rerun prepare with --layout {file_layout}",
        )
    return TableError(
        f"{out} exists but is not this checkpoint's table (no matching {manifest_path.name})",
        fix=f"check it with `flashnext table verify --model {model_dir} --table {out}`, "
        "or remove it and rerun prepare",
    )
