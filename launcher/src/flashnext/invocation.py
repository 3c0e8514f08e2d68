"""How flashnext was invoked, so that every fix names a command the user can paste.

`./flashnext` exports FLASHNEXT_PROG: the path as it was typed (`./flashnext`,
`../flashnext`), or `flashnext` when PATH finds it. The Nix app, the image and
`pip install` put `flashnext` itself on PATH, which is the default.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

PROG_ENV = "FLASHNEXT_PROG"
DEFAULT_PROG = "flashnext"
SUBCOMMANDS = (
    "bench",
    "checkpoint",
    "facts",
    "plan",
    "preflight",
    "report",
    "serve",
    "skeleton",
    "table",
)
# `flashnext` as a command: followed by one of its subcommands, not part of a path.
_COMMAND_RE = re.compile(rf"(?<![\w./-]){DEFAULT_PROG}(?= (?:{'|'.join(SUBCOMMANDS)})\b)")


def invoked_as(environ: Mapping[str, str] | None = None) -> str:
    """The command the user ran: FLASHNEXT_PROG, else `flashnext`."""
    environ = os.environ if environ is None else environ
    return environ.get(PROG_ENV, "").strip() or DEFAULT_PROG


def name_command(text: str, prog: str) -> str:
    """`text` with each `flashnext <subcommand>` naming `prog` instead."""
    if prog == DEFAULT_PROG or not text:
        return text
    return _COMMAND_RE.sub(lambda _m: prog, text)
