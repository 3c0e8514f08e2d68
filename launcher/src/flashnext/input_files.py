"""Outputs never land on inputs: a file the launcher writes (a table, its manifest and
journal, a facts file, a report) is refused when it would replace a file of the
checkpoint or the PLE table.

`table prepare --out MODEL/config` once wrote its manifest as MODEL/config.json,
the checkpoint's own config. A clash is judged by what the paths resolve to
(symlinks followed) and, for files that exist, by device and inode (hard links),
so neither a relative path nor a link gets around it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


class OutputClash(ValueError):
    """An output would replace an input: `message` names both, `fix` what to pass."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(f"{message}; {fix}")
        self.message = message
        self.fix = fix


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino)


def checkpoint_files(model_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The files directly in the checkpoint directory (configs, index, shards, tokenizer):
    what vLLM reads. Empty when there is no such directory."""
    if not model_dir:
        return []
    try:
        with os.scandir(model_dir) as entries:
            return [Path(e.path) for e in entries if e.is_file()]
    except OSError:
        return []


def table_files(table_path: str | os.PathLike[str] | None) -> list[Path]:
    """The table and its manifest (TABLE.json), where they exist."""
    if not table_path:
        return []
    table = Path(table_path)
    return [p for p in (table, table.with_name(table.name + ".json")) if p.is_file()]


def refuse_clobbering(
    outputs: Iterable[str | os.PathLike[str]],
    inputs: Iterable[Path],
    what: str,
    fix: str,
) -> None:
    """Raise OutputClash if any of `outputs` is one of `inputs` (same resolved path, or
    the same file under another name); `what` names the outputs' writer."""
    by_path: dict[str, Path] = {}
    by_inode: dict[tuple[int, int], Path] = {}
    for p in inputs:
        by_path[os.path.realpath(p)] = p
        ident = _identity(p)
        if ident is not None:
            by_inode[ident] = p
    for out in outputs:
        hit = by_path.get(os.path.realpath(out)) or by_inode.get(_identity(Path(out)) or (-1, -1))
        if hit is not None:
            raise OutputClash(
                f"{what} would write {out}, which is {hit}, an input it must not replace", fix
            )


def refuse_input_paths(
    out: str | os.PathLike[str],
    model_dir: str | os.PathLike[str] | None,
    table_path: str | os.PathLike[str] | None,
    what: str,
) -> None:
    """A facts file or report (`what`) at `out` never replaces the checkpoint's files or
    the table and its manifest."""
    refuse_clobbering([out], [*checkpoint_files(model_dir), *table_files(table_path)], what,
                      "pass --out a new file outside the checkpoint and beside no table, "
                      "e.g. --out ./flashnext-out.json")  # fmt: skip
