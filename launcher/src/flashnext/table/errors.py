"""One error type for the table tools: what is wrong, and how to fix it."""

from __future__ import annotations


class TableError(Exception):
    """A table problem the user can fix; `fix` is a command or action to paste."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return self.message if not self.fix else f"{self.message}\n  fix: {self.fix}"
