"""The `flashnext` command line: parse, call, render. Logic lives in the modules.

Exit codes: 0 ok, 1 a check failed (the message says which and how to fix it),
2 usage error.
"""

from __future__ import annotations

import click

from flashnext import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="flashnext")
def main() -> None:
    """Serve Qwen3.8-Flash-Next on 3x RTX 3090 with a patched vLLM 0.33.0 (PP=3).

    Typical use: `flashnext preflight --model DIR --table FILE`, then
    `flashnext serve --model DIR --table FILE`.
    """


# Commands are added below, one block per area. Keep each block's logic in its module.
