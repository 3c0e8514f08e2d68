"""The root `flashnext` group and the one error type commands raise.

Exit codes: 0 ok, 1 a check failed or the input cannot be used (the message says
which and how to fix it), 2 usage error (Click's own: a bad flag or value).
"""

from __future__ import annotations

import click

from flashnext import __version__
from flashnext.invocation import invoked_as, name_command


class FlashnextError(click.ClickException):
    """What went wrong and, on a line of its own, the fix to paste. Exit status 1."""

    def __init__(self, message: str, fix: str | None = None) -> None:
        super().__init__(message if not fix else f"{message}\n  fix: {fix}")
        self.fix = fix


def _user_errors() -> tuple[type[Exception], ...]:
    """The launcher's own error types: each message names the input and says the fix.
    Imported when one is raised, so a command imports only what it uses."""
    from flashnext.checkpoint.errors import CheckpointError
    from flashnext.facts.schema import FactsSchemaError, ModelFactsError
    from flashnext.profiles import ProfileError
    from flashnext.serve import ServeError
    from flashnext.skeleton.writer import SkeletonError
    from flashnext.table.errors import TableError
    from flashnext.tools.bench import BenchError

    return (BenchError, CheckpointError, FactsSchemaError, ModelFactsError, ProfileError,
            ServeError, SkeletonError, TableError)  # fmt: skip


class _Main(click.Group):
    """The root group: the launcher's errors become FlashnextError (exit 1, no
    traceback), and an error's fix names the command as it was invoked."""

    def invoke(self, ctx: click.Context):
        try:
            try:
                return super().invoke(ctx)
            except click.ClickException:
                raise
            except Exception as exc:
                if isinstance(exc, _user_errors()):
                    raise FlashnextError(str(exc)) from exc
                raise
        except click.ClickException as exc:
            exc.message = name_command(exc.message, invoked_as())
            raise


@click.group(
    cls=_Main,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="flashnext")
def main() -> None:
    """Serve Qwen3.8-Flash-Next on 3x RTX 3090 with a patched vLLM 0.33.0 (PP=3).

    Typical use: `flashnext preflight --model DIR --table FILE`, then
    `flashnext serve --model DIR --table FILE`.
    """
