"""What a --table path is, named before it is read as a table: a directory, a FIFO or
a device is none, and OUT.partial (or its journal) is an interrupted prepare's work,
which a rerun of prepare resumes (removing it would throw the copy away)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
# paths_for's names: OUT.partial (the copy) and OUT.partial.json (its journal).
_PARTIAL_SUFFIXES = (".partial", ".partial.json")


def non_file_kind(path: str | os.PathLike[str]) -> str | None:
    """ "a directory", "a FIFO", ...; None for a regular file or a missing path."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def interrupted_prepare_output(path: str | os.PathLike[str]) -> Path | None:
    """The table an interrupted prepare was writing, when `path` is its partial copy or
    journal; None otherwise."""
    p = Path(path)
    for suffix in _PARTIAL_SUFFIXES:
        if p.name.endswith(suffix) and len(p.name) > len(suffix):
            return p.with_name(p.name[: -len(suffix)])
    return None


def partial_message(path: str | os.PathLike[str], final: Path, model_dir: str | None) -> str:
    return (
        f"{path} is the unfinished work of an interrupted `flashnext table prepare` of "
        f"{final}, not a table: rerun `flashnext table prepare --model {model_dir or 'DIR'} "
        f"--out {final}` (it resumes from it), then pass --table {final}"
    )


def rewrite_fix(model_dir: str | os.PathLike[str], table: str | os.PathLike[str]) -> str:
    """A damaged manifest beside a good table: rewrite just the manifest, not 95 GiB."""
    return (
        "if the table's rows are right, rewrite just the manifest: `flashnext table verify "
        f"--model {model_dir} --table {table} --rewrite-manifest`; else rerun "
        "`flashnext table prepare`"
    )
