"""A cache of what the checkpoint's headers said, so a second `flashnext plan` reads no
header: keyed by each file's path, size, mtime, ctime and inode (the index and every
shard). mtime alone can be put back after a rewrite in place (`touch -d`, `cp -p`,
os.utime); ctime cannot be set from user space, and a file replaced by rename is
another inode, so neither rewrite is vouched for by an old entry.

Stored under $XDG_CACHE_HOME/flashnext/model-headers/ (default ~/.cache), one JSON
file per checkpoint directory: per shard its header length, tensor count and the
bytes per tensor class (what the plan places). Only a read that passed every check
is stored, so an entry whose files all still match needs no check again. The cache is
an optimisation: one that cannot be read or written is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic

# Bump when the reader's checks or tensor_class change: older entries are then ignored.
CACHE_VERSION = 2  # 2: keys hold ctime and inode
# A file modified this recently may change again within the filesystem's timestamp
# granularity without its mtime moving (git's "racily clean" case): not cached.
RACY_NS = 2_000_000_000
KEEP_ENTRIES = 16  # checkpoint directories remembered; the oldest go first


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashnext" / "model-headers"


def file_key(path: Path) -> list[Any] | None:
    """[path, size, mtime_ns, ctime_ns, inode], or None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _entry_path(root: Path) -> Path:
    # fsencode: a directory name that is not UTF-8 is bytes to hash, not an error
    digest = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def load(root: Path, index: Path | None) -> dict[str, Any] | None:
    """The stored entry when the index (or its absence) and every shard still match."""
    from flashnext.facts.jsonfile import JsonFileError, read_json_object

    try:
        doc = read_json_object(_entry_path(root), "header cache entry")
    except JsonFileError:
        return None
    if not isinstance(doc, dict) or doc.get("version") != CACHE_VERSION:
        return None
    if doc.get("root") != str(root) or doc.get("index") != (index and file_key(index)):
        return None
    shards = doc.get("shards")
    if not isinstance(shards, list) or not shards:
        return None
    for shard in shards:
        if file_key(root / shard["file"]) != shard["key"]:
            return None
        # chmod leaves size and mtime alone: a shard this user may no longer
        # read is read again, so the refusal is named (read_errors), not hidden.
        if not os.access(root / shard["file"], os.R_OK):
            return None
    return doc


def store(root: Path, index: Path | None, shards: list[dict[str, Any]]) -> None:
    """Record a read that passed every check (errors ignored: it is only a cache)."""
    doc = {"version": CACHE_VERSION, "root": str(root),
           "index": index and file_key(index), "shards": shards}  # fmt: skip
    keys = [s["key"] for s in shards] + ([doc["index"]] if index else [])
    if any(k is None or k[2] > time.time_ns() - RACY_NS for k in keys):
        return
    path = _entry_path(root)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
        _prune(path.parent)


def _prune(directory: Path) -> None:
    entries = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for old in entries[:-KEEP_ENTRIES]:
        old.unlink(missing_ok=True)
