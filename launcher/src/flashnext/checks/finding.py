"""The one finding type: preflight's checks and `checkpoint check` both return these."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "warn", "fail"]
LEVELS: tuple[Level, ...] = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """One check's verdict: `id` (`host.memlock`, `stored-scheme`), its level, what was
    measured against what is required, a message citing the fact, and a fix to paste."""

    id: str
    level: Level
    measured: str = ""
    required: str = ""
    message: str = ""
    fix: str = ""
    measured_bytes: int | None = None
    """The size `measured` shows, in bytes, for programs (--json); None: not a size."""
    required_bytes: int | None = None
    """The size `required` names (the bound), in bytes; None: not a size."""

    @property
    def status(self) -> Level:
        """`checkpoint check`'s word for the level (its --json key)."""
        return self.level


def worst(findings: Iterable[Finding]) -> Level:
    return max((f.level for f in findings), key=LEVELS.index, default="ok")
