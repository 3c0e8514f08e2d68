"""Output for people (rich tables) and for programs (canonical JSON)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from flashnext.facts.schema import SCHEMA_VERSION, dumps

GIB = 1 << 30


def console(stderr: bool = False) -> Console:
    # soft_wrap keeps long fix commands pasteable; width fallback for pipes and CI logs.
    return Console(stderr=stderr, soft_wrap=False, width=None if sys.stdout.isatty() else 120)


def gib(n: int | None) -> str:
    """Bytes → "21.71 GiB"; None → "-"."""
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def render_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    table = Table(title=title, title_justify="left", show_lines=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*("-" if v is None else str(v) for v in row))
    console().print(table)


def emit_json(obj: Any) -> None:
    """Print canonical JSON (sorted keys) with a schema_version at the top level."""
    if isinstance(obj, dict) and "schema_version" not in obj:
        obj = {"schema_version": SCHEMA_VERSION, **obj}
    sys.stdout.write(dumps(obj))
