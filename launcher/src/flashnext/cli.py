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


# ---- table commands (owner: table)
# The PLE n-gram table: checkpoint shards → one flat file (flashnext.table).

_HIDDEN_INT = {"type": click.IntRange(min=4096), "hidden": True}


@main.group()
def table() -> None:
    """The 95 GiB PLE n-gram table as one flat file on NVMe (what the patched vLLM maps)."""


@table.command("prepare")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory (config.json, *.safetensors).",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Flat table file to write; OUT.json (manifest) is written beside it.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Accept a rotational, network, tmpfs or overlay output filesystem.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--chunk-bytes", default=64 << 20, **_HIDDEN_INT)
@click.option("--sync-bytes", default=1 << 30, **_HIDDEN_INT)
def table_prepare(
    model_dir: str, out: str, force: bool, as_json: bool, chunk_bytes: int, sync_bytes: int
) -> None:
    """Copy the PLE shards into one flat file: streaming, resumable, fsync + atomic rename.

    Rerun the same command after an interruption: it checks what was written and
    continues. Progress goes to stderr.
    """
    from flashnext.render import console, gib
    from flashnext.table import TableError
    from flashnext.table.prepare import prepare_table
    from flashnext.table.progress import byte_progress

    try:
        with byte_progress("PLE table", console(stderr=True)) as on_progress:
            result = prepare_table(
                model_dir,
                out,
                force=force,
                chunk_bytes=chunk_bytes,
                sync_bytes=sync_bytes,
                on_progress=on_progress,
            )
    except TableError as exc:
        raise click.ClickException(str(exc)) from exc
    if result.storage_warning:
        click.echo(f"warning (--force): {result.storage_warning}", err=True)
    if as_json:
        from dataclasses import asdict

        from flashnext.render import emit_json

        emit_json({**asdict(result), "bytes_per_second": result.bytes_per_second})
        return
    from flashnext.render import render_table

    render_table(
        "PLE table prepare",
        ["field", "value"],
        [
            ("table", result.table),
            ("manifest", result.manifest),
            ("status", result.status),
            ("size", gib(result.total_bytes)),
            ("resumed from", gib(result.resumed_from_bytes)),
            ("copied", gib(result.copied_bytes)),
            ("seconds", f"{result.seconds:.1f}"),
            ("rate", f"{result.bytes_per_second / 2**20:.0f} MiB/s"),
        ],
    )


@table.command("verify")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory the table was prepared from.",
)
@click.option(
    "--table",
    "table_path",
    required=True,
    type=click.Path(dir_okay=False),
    help="The flat table file.",
)
@click.option(
    "--samples",
    default=1024,
    show_default=True,
    type=click.IntRange(min=0),
    help="Random rows to compare byte for byte (first and last row included).",
)
@click.option("--seed", type=int, default=None, help="Seed for the row sample (printed).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def table_verify(
    model_dir: str, table_path: str, samples: int, seed: int | None, as_json: bool
) -> None:
    """Check the table's size and shape, then compare sampled rows with the shards.

    Exit 1 names the first mismatching row.
    """
    from dataclasses import asdict

    from flashnext.render import gib
    from flashnext.table import TableError
    from flashnext.table.verify import verify_table

    try:
        result = verify_table(model_dir, table_path, samples=samples, seed=seed)
    except TableError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        from flashnext.render import emit_json

        emit_json({**asdict(result), "ok": result.ok})
    else:
        from flashnext.render import render_table

        render_table(
            "PLE table verify",
            ["field", "value"],
            [
                ("table", result.table),
                ("shape", f"[{result.rows}, {result.dim}] {result.dtype}"),
                ("size", f"{result.size_bytes} bytes ({gib(result.size_bytes)})"),
                ("manifest", result.manifest or "none (size and rows checked only)"),
                ("rows compared", f"{result.samples} (seed {result.seed})"),
                ("result", "ok" if result.ok else "MISMATCH"),
            ],
        )
    m = result.mismatch
    if m is not None:
        raise click.ClickException(
            f"row {m.row} differs from the checkpoint ({m.shard_name} row {m.shard_row}, "
            f"table offset {m.table_offset_bytes})\n  fix: rerun "
            f"`flashnext table prepare --model {model_dir} --out NEW` and replace the table"
        )


# ---- facts commands (owner: facts)


@main.command("facts")
@click.option(
    "--table",
    "table_path",
    type=click.Path(dir_okay=False, path_type=str),
    help="The PLE table file: report the storage under it (it need not exist yet).",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=str),
    help="The checkpoint directory: report the storage under it.",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address the server will bind; checked together with --port.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
    help="TCP port the server will bind; reported free or busy.",
)
@click.option("--json", "as_json", is_flag=True, help="Print canonical JSON instead of tables.")
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

    Probes never fail the command: what cannot be read (no NVML, no GPU) is
    reported as a fact. Exit 0 unless --out cannot be written.
    """
    import os
    import tempfile

    from flashnext.facts.collect import collect_host_facts, host_facts_tables
    from flashnext.facts.schema import dumps
    from flashnext.render import emit_json, render_table

    storage = {role: p for role, p in (("table", table_path), ("model", model_dir)) if p}
    facts = collect_host_facts(storage, [(host, port)])
    if out:
        directory = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(directory):
            raise click.BadParameter(
                f"directory {directory} does not exist; create it or choose another path",
                param_hint="--out",
            )
        # Temp file in the same directory + rename: a reader never sees half a file.
        fd, tmp = tempfile.mkstemp(prefix=".facts-", suffix=".json", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(dumps(facts))
            os.replace(tmp, out)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise click.ClickException(f"cannot write {out}: {exc}") from exc
    if as_json:
        emit_json(facts)
        return
    for title, columns, rows in host_facts_tables(facts):
        render_table(title, columns, rows)
    if out:
        click.echo(f"facts written to {out}")
