"""`flashnext facts`: what the probes see on this host, for people or as a facts file."""

from __future__ import annotations

import click

from flashnext.cli.root import FlashnextError, main
from flashnext.cli.settings import options


@main.command("facts")
@options("table_path", "model_dir", "host", "port", "as_json")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True, path_type=str),
    help="Also write the JSON facts to this file (atomically), for `--facts FILE` elsewhere.",
)
def facts_command(
    table_path: str | None,
    model_dir: str | None,
    host: str,
    port: int,
    as_json: bool,
    out: str | None,
) -> None:
    """Probe this host: memory and limits, GPUs (NVML), storage under the table and model, port.

    The storage under --table and --model is reported (neither need exist yet), and
    --host/--port are checked as the server will bind them.

    Probes never fail the command: what cannot be read (no NVML, no GPU) is
    reported as a fact. Exit 0 unless --out cannot be written.
    """
    import os

    from flashnext.atomic import write_text_atomic
    from flashnext.facts.collect import collect_host_facts, host_facts_tables
    from flashnext.facts.schema import dumps
    from flashnext.render import emit_json, render_table

    storage = {role: p for role, p in (("table", table_path), ("model", model_dir)) if p}
    facts = collect_host_facts(storage, [(host, port)])
    if out:
        _refuse_inputs(out, model_dir, table_path)
        _refuse_non_utf8(facts)
        directory = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(directory):
            raise click.BadParameter(
                f"directory {directory} does not exist; create it or choose another path",
                param_hint="--out",
            )
        try:
            write_text_atomic(out, dumps(facts))
        except OSError as exc:
            raise FlashnextError(f"cannot write {out}: {exc}") from exc
    if as_json:
        emit_json(facts)
        return
    for title, columns, rows in host_facts_tables(facts):
        render_table(title, columns, rows)
    if out:
        click.echo(f"facts written to {out}")


def _refuse_inputs(out: str, model_dir: str | None, table_path: str | None) -> None:
    from flashnext.input_files import OutputClash, refuse_input_paths

    try:
        refuse_input_paths(out, model_dir, table_path, "facts --out")
    except OutputClash as exc:
        raise FlashnextError(exc.message, exc.fix) from None


def _refuse_non_utf8(facts) -> None:
    """A facts file is JSON, which carries only Unicode: a path that is not valid UTF-8
    (kept by Python as lone surrogates) would be written, then refused by --facts."""
    import os

    from flashnext.facts.schema import to_jsonable

    stack = [to_jsonable(facts)]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                shown = os.fsencode(item).decode("utf-8", "backslashreplace")
                raise FlashnextError(
                    f"{shown} is not valid UTF-8, which a facts file (JSON) cannot carry: "
                    "nothing was written",
                    "give the directory a UTF-8 name, or point --model/--table at a symlink "
                    "with one (`ln -s OLD /models/flash-next`)",
                ) from None
