"""`flashnext table prepare|verify`: the PLE n-gram table as one flat file (flashnext.table)."""

from __future__ import annotations

import click

from flashnext.cli.root import FlashnextError, main
from flashnext.cli.settings import options
from flashnext.table.file_layout import DEFAULT_LAYOUT, LAYOUTS  # pure arithmetic, no I/O
from flashnext.units import gib

# Buffer and fsync sizes: the copy buffer is allocated, so it is bounded.
_CHUNK = {"type": click.IntRange(4096, 1 << 30), "hidden": True}
_SYNC = {"type": click.IntRange(4096, 1 << 40), "hidden": True}


@main.group()
def table() -> None:
    """The 95 GiB PLE n-gram table as one flat file on NVMe (what the patched vLLM maps)."""


@table.command("prepare")
@options("model_dir", model_dir={"required": True})
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
@click.option(
    "--layout",
    "file_layout",
    type=click.Choice(LAYOUTS),
    default=DEFAULT_LAYOUT,
    show_default=True,
    help="packed: rows back to back (the seed's format). page-aligned: 12 rows per "
    "4 KiB page plus zero padding, so no row straddles a page: a token's 16 rows "
    "read at most 64 KiB from disk instead of ~68 KiB, for a 6.7% larger file "
    "(101.73 vs 95.37 GiB). Recorded in OUT.json; serve and verify read it there.",
)
@options("as_json")
@click.option("--chunk-bytes", default=64 << 20, **_CHUNK)
@click.option("--sync-bytes", default=1 << 30, **_SYNC)
def table_prepare(
    model_dir: str,
    out: str,
    force: bool,
    file_layout: str,
    as_json: bool,
    chunk_bytes: int,
    sync_bytes: int,
) -> None:
    """Copy the PLE shards into one flat file: streaming, resumable, fsync + atomic rename.

    Rerun the same command (same --layout) after an interruption: it checks what
    was written and continues. Progress goes to stderr.
    """
    from flashnext.render import console
    from flashnext.table.prepare import PrepareInterrupted, prepare_table
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
                file_layout=file_layout,
            )
    except PrepareInterrupted as exc:  # Ctrl-C mid-copy: say what is kept; 130 = SIGINT
        click.echo(str(exc), err=True)
        raise SystemExit(130) from None
    except KeyboardInterrupt:
        click.echo("interrupted before the copy started: nothing was written", err=True)
        raise SystemExit(130) from None
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
            ("layout", result.layout),
            ("status", result.status),
            ("size", f"{result.total_bytes} bytes ({gib(result.total_bytes)})"),
            ("resumed from", gib(result.resumed_from_bytes)),
            ("copied", gib(result.copied_bytes)),
            ("seconds", f"{result.seconds:.1f}"),
            ("rate", f"{result.bytes_per_second / 2**20:.0f} MiB/s"),
        ],
    )


@table.command("verify")
@options("model_dir", "table_path", model_dir={"required": True}, table_path={"required": True})
@click.option(
    "--samples",
    default=1024,
    show_default=True,
    type=click.IntRange(min=0),
    help="Random rows to compare byte for byte (first and last row included).",
)
@click.option("--seed", type=int, default=None, help="Seed for the row sample (printed).")
@click.option(
    "--rewrite-manifest",
    is_flag=True,
    help="Ignore a damaged TABLE.json, take the layout the size fits, and write the manifest "
    "anew once the sampled rows match (no recopy of the table).",
)
@options("as_json")
def table_verify(
    model_dir: str,
    table_path: str,
    samples: int,
    seed: int | None,
    rewrite_manifest: bool,
    as_json: bool,
) -> None:
    """Check the table's size and shape, then compare sampled rows with the shards.

    The layout (packed or page-aligned) is read from the manifest beside the
    table (TABLE.json); without one the table is taken as packed. Exit 1 names
    the first mismatching row.
    """
    from dataclasses import asdict

    from flashnext.table.verify import verify_table

    result = verify_table(
        model_dir, table_path, samples=samples, seed=seed, rewrite_manifest=rewrite_manifest
    )
    if rewrite_manifest and result.ok:
        click.echo(
            f"table verify: wrote {result.manifest} ({result.layout} layout) after "
            f"{result.samples} sampled rows matched",
            err=True,
        )
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
                ("layout", result.layout),
                ("size", f"{result.size_bytes} bytes ({gib(result.size_bytes)})"),
                ("manifest", result.manifest or "none (size and rows checked only)"),
                ("rows compared", f"{result.samples} (seed {result.seed})"),
                ("result", "ok" if result.ok else "MISMATCH"),
            ],
        )
    if not result.padding_ok:
        raise FlashnextError(
            f"{table_path}: page padding is not zero (not a page-aligned table as prepare "
            "writes it)",
            f"rerun `flashnext table prepare --model {model_dir} --out NEW --layout "
            "page-aligned` and replace the table",
        )
    m = result.mismatch
    if m is not None:
        raise FlashnextError(
            f"row {m.row} differs from the checkpoint ({m.shard_name} row {m.shard_row}, "
            f"table offset {m.table_offset_bytes})",
            f"rerun `flashnext table prepare --model {model_dir} --out NEW` and replace the table",
        )
