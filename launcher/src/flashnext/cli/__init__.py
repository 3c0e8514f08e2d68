"""The `flashnext` command line: Click only. One module per command group (serving:
preflight, plan, serve; table; facts; checkpoint; tools: bench, report, skeleton);
the options they share are declared once (settings.py); the logic lives below."""

from flashnext.cli import checkpoint, facts, serving, table, tools  # noqa: F401 (their commands)
from flashnext.cli.root import FlashnextError, main

__all__ = ["FlashnextError", "main"]
