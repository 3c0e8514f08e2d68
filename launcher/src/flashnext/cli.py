"""The `flashnext` command line: parse, call, render. Logic lives in the modules.

Exit codes: 0 ok, 1 a check failed (the message says which and how to fix it),
2 usage error.
"""

from __future__ import annotations

import click

from flashnext import __version__
from flashnext.table.file_layout import DEFAULT_LAYOUT, LAYOUTS  # pure arithmetic, no I/O


class _Main(click.Group):
    """The root group: an error's fix names the command as it was invoked."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            exc.message = _name_command(exc.message)
            raise


def _prog() -> str:
    from flashnext.invocation import invoked_as

    return invoked_as()


def _name_command(text: str) -> str:
    from flashnext.invocation import name_command

    return name_command(text, _prog())


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


# Commands are added below, one block per area. Keep each block's logic in its module.


# ---- preflight / plan / serve (owner: lead)


def _plan_options(fn):
    """The options preflight, plan and serve share (defined once)."""
    options = [
        click.option(
            "--facts",
            "facts_file",
            envvar="FLASHNEXT_FACTS",
            show_envvar=True,
            type=click.Path(exists=True, dir_okay=False),
            help="Replay facts recorded with `flashnext facts --json` instead of "
            "probing this host.",
        ),
        click.option(
            "--model",
            "model_dir",
            envvar="FLASHNEXT_MODEL",
            show_envvar=True,
            type=click.Path(file_okay=False),
            help="Checkpoint directory (config.json, safetensors shards).",
        ),
        click.option(
            "--table",
            "table_path",
            envvar="FLASHNEXT_TABLE",
            show_envvar=True,
            type=click.Path(dir_okay=False),
            help="The PLE table flat file on NVMe (`flashnext table prepare`).",
        ),
        click.option(
            "--profile",
            "profile_name",
            envvar="FLASHNEXT_PROFILE",
            show_envvar=True,
            help="Hardware profile; default: the one matching the GPUs (test profiles are "
            "chosen by name only), else 3x3090.",
        ),
        click.option(
            "--host",
            default="127.0.0.1",
            show_default=True,
            envvar="FLASHNEXT_HOST",
            show_envvar=True,
            help="Address the API binds; loopback unless you mean to expose it.",
        ),
        click.option(
            "--port",
            default=8000,
            show_default=True,
            type=click.IntRange(1, 65535),
            envvar="FLASHNEXT_PORT",
            show_envvar=True,
            help="API port.",
        ),
        click.option(
            "--served-model-name",
            default="qwen3.8-flash-next",
            show_default=True,
            help="Model name clients send.",
        ),
        click.option(
            "--kv-cache-memory-bytes",
            type=click.IntRange(min=1),
            help="VRAM per card for the KV cache; default: derived for the "
            "tightest rank and the host pools.",
        ),
        click.option(
            "--max-model-len",
            type=click.IntRange(min=1),
            help="Context length; default: the profile's.",
        ),
        click.option(
            "--pp-layer-partition",
            envvar="VLLM_PP_LAYER_PARTITION",
            show_envvar=True,
            help="Layers per PP rank, e.g. 16,16,16 (vLLM's own variable).",
        ),
        click.option(
            "--generation-config",
            "generation_config_dir",
            type=click.Path(file_okay=False),
            help="Directory whose generation_config.json supplies sampling defaults.",
        ),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


_VLLM_ENV_OPTION = click.option(
    "--vllm-env",
    "vllm_env_dir",
    envvar="FLASHNEXT_VLLM_ENV",
    show_envvar=True,
    type=click.Path(file_okay=False),
    help="The vLLM env to judge and run: the dir `pins/build-env` prints (its venv/bin/vllm). "
    "Default: `vllm` on PATH, else this checkout's pinned env (serve builds it if missing).",
)


def _vllm_env_selection() -> str:
    """Where --vllm-env's value came from, as findings name it."""
    from click.core import ParameterSource

    source = click.get_current_context().get_parameter_source("vllm_env_dir")
    return "FLASHNEXT_VLLM_ENV" if source == ParameterSource.ENVIRONMENT else "--vllm-env"


def _build_env_command(checkout) -> str | None:
    """pins/build-env as the user can type it from here (relative inside the checkout)."""
    import os
    import shlex

    if checkout is None or checkout.build_env is None:
        return None
    rel = os.path.relpath(checkout.build_env)
    return shlex.quote(rel if not rel.startswith("..") else str(checkout.build_env))


def _vllm_env_inputs(env_dir: str | None, selected_by: str) -> dict:
    """assess()'s vllm_env, patch_series and build_env: the env probed on this machine."""
    import os

    from flashnext.checkout import find_checkout, series_patches
    from flashnext.facts.vllm_env import probe_vllm_env

    checkout = find_checkout()
    series = None
    if checkout is not None:
        try:
            series = series_patches(checkout.series_dir)
        except OSError as exc:
            raise click.ClickException(
                f"cannot read this checkout's patch series ({exc}); restore patches/ "
                "(git checkout patches)"
            ) from exc
    return {
        "vllm_env": probe_vllm_env(env_dir, selected_by, os.environ, checkout),
        "patch_series": series,
        "build_env": _build_env_command(checkout),
    }


def _assess(kw: dict, model=None, env_inputs: dict | None = None):
    """Facts (probed or replayed), profile, plan, findings; with `env_inputs` the vLLM
    env is judged too (preflight, serve)."""
    from flashnext.assess import assess, load_facts
    from flashnext.facts.schema import FactsSchemaError
    from flashnext.plan.planner import PlanOptions
    from flashnext.profiles import ProfileError

    options = PlanOptions(
        model_dir=kw["model_dir"],
        table_path=kw["table_path"],
        host=kw["host"],
        port=kw["port"],
        served_model_name=kw["served_model_name"],
        kv_cache_memory_bytes=kw["kv_cache_memory_bytes"],
        max_model_len=kw["max_model_len"],
        pp_layer_partition=kw["pp_layer_partition"],
        generation_config_dir=kw["generation_config_dir"],
    )
    try:
        facts = load_facts(kw["facts_file"], options)
        return assess(
            facts,
            options,
            kw["profile_name"],
            model=model,
            facts_source=kw["facts_file"],
            **(env_inputs or {}),
        )
    except (FactsSchemaError, ProfileError) as exc:
        raise click.ClickException(str(exc)) from exc


def _preflight_doc(a) -> dict:
    import dataclasses

    from flashnext.checks import worst
    from flashnext.facts.schema import to_jsonable
    from flashnext.plan.command import plan_json

    findings = [dataclasses.replace(f, fix=_name_command(f.fix)) for f in a.findings]
    return {
        "profile": a.profile.name,
        "profile_reason": a.profile_reason,
        "result": worst(a.findings),
        "findings": to_jsonable(findings),
        "facts": to_jsonable(a.facts),
        "plan": plan_json(a.plan, a.command) if a.plan else None,
        "plan_error": a.plan_error,
    }


def _summary_line(findings) -> str:
    counts = {lvl: sum(1 for f in findings if f.level == lvl) for lvl in ("ok", "warn", "fail")}
    return f"preflight: {counts['fail']} failed, {counts['warn']} warnings, {counts['ok']} ok"


def _reachable_host(host: str) -> str:
    """Where the supervisor probes a server bound to `host` (wildcards → loopback)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@main.command()
@_plan_options
@_VLLM_ENV_OPTION
def preflight(as_json: bool, vllm_env_dir: str | None, **kw) -> None:
    """Check this host (or a facts file), the model, the table and the vLLM env serve runs.

    Every failed check says what was measured, what is required and how to fix
    it. Exit 1 if any check fails.
    """
    from flashnext.render import emit_json

    a = _assess(kw, env_inputs=_vllm_env_inputs(vllm_env_dir, _vllm_env_selection()))
    if as_json:
        emit_json(_preflight_doc(a))
    else:
        _render_preflight(a.findings)
    if any(f.level == "fail" for f in a.findings):
        raise SystemExit(1)


def _render_preflight(findings) -> None:
    from flashnext.render import render_findings

    render_findings(findings, _prog())
    click.echo(_summary_line(findings))


@main.command("plan")
@_plan_options
def plan_cmd(as_json: bool, **kw) -> None:
    """Partition, per-rank VRAM, KV bytes, host pools, roofline and the vLLM command.

    Pure: reads facts (probed or --facts) and the checkpoint's headers, starts
    nothing. Exit 1 if no plan can be made.
    """
    from flashnext.plan.command import plan_json
    from flashnext.render import emit_json, render_plan

    a = _assess(kw)
    if a.plan is None:
        raise click.ClickException(f"no plan: {a.plan_error}")
    if kw["profile_name"] and a.facts.gpu.devices and not a.profile.matches(a.facts):
        seen = ", ".join(sorted({d.name for d in a.facts.gpu.devices}))
        raise click.ClickException(
            f"profile {a.profile.name} is for {a.profile.gpu.count}x {a.profile.gpu.name}, "
            f"the facts show {len(a.facts.gpu.devices)}x {seen}; drop --profile or pass "
            "--facts recorded on the serving host"
        )
    if as_json:
        emit_json(plan_json(a.plan, a.command))
    else:
        render_plan(a.plan, a.command)


@main.command()
@_plan_options
@_VLLM_ENV_OPTION
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the exact command and environment (shell-quoted) and exit; exit 1 (after "
    "the failures and the command) if a check fails.",
)
@click.option(
    "--startup-timeout",
    default=1800.0,
    show_default=True,
    type=float,
    help="Seconds to wait for /health (cold starts load 62 GiB).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the API key (else VLLM_API_KEY).",
)
def serve(
    as_json: bool,
    vllm_env_dir: str | None,
    dry_run: bool,
    startup_timeout: float,
    api_key_file: str | None,
    **kw,
) -> None:
    """Preflight, then run `vllm serve` with the plan's argv and env, supervised.

    The vLLM is --vllm-env's, else `vllm` on PATH, else this checkout's pinned,
    patched env; when there is none and every other check passes, serve builds it
    with pins/build-env first (it says the download and disk sizes before).
    Refuses to start (exit 1) on any failed check. Waits for /health, sends one
    smoke completion, reports ready; exits non-zero if the engine dies.
    """
    import os

    from flashnext.render import emit_json

    env_inputs = _vllm_env_inputs(vllm_env_dir, _vllm_env_selection())
    a = _assess(kw, env_inputs=env_inputs)
    if not dry_run and _only_the_env_is_missing(a.findings) and env_inputs["build_env"]:
        env_inputs = _build_pinned_env(env_inputs)
        a = _assess(kw, model=a.model, env_inputs=env_inputs)
    failed = [f for f in a.findings if f.level == "fail"]
    command = _command_line(a) if a.plan else None
    if as_json:
        emit_json({**_preflight_doc(a), "dry_run": dry_run, "command": command})
    elif failed or not dry_run:
        _render_preflight(a.findings)
    if dry_run:
        if not as_json:
            if command is not None:
                click.echo(command)
            else:
                click.echo(f"serve --dry-run: no command: {a.plan_error}", err=True)
        if failed:
            click.echo(
                f"serve --dry-run: {len(failed)} check(s) failed (above): serve refuses to "
                f"run this command until they pass (`{_prog()} preflight` re-checks)",
                err=True,
            )
            raise SystemExit(1)
        return
    if failed:
        click.echo(
            "serve: not starting vLLM: fix the failed checks above "
            f"(`{_prog()} preflight` re-checks)",
            err=True,
        )
        raise SystemExit(1)
    from flashnext.serve import ServeError, load_api_key, supervise

    try:
        api_key = load_api_key(os.environ, api_key_file)
    except ServeError as exc:
        raise click.ClickException(str(exc)) from exc
    vllm = a.vllm_env
    click.echo(f"flashnext: vLLM: {vllm.executable} ({vllm.selected_by})", err=True)
    env = {**os.environ, **a.command.env}
    base = f"http://{_reachable_host(kw['host'])}:{kw['port']}"
    raise SystemExit(
        supervise(
            list(a.command.argv),
            env,
            executable=vllm.executable,
            health_url=f"{base}/health",
            completion_url=f"{base}/v1/completions",
            model_name=kw["served_model_name"],
            api_key=api_key,
            startup_timeout_s=startup_timeout,
        )
    )


def _command_line(a) -> str:
    """The plan's command as serve runs it: argv[0] is the chosen env's `vllm` (the plan's
    own `vllm` when that is the one PATH finds, or when no env was found)."""
    from flashnext.plan.command import shell_line

    argv = list(a.command.argv)
    env = a.vllm_env
    if env is not None and env.executable and env.selected_by != "PATH":
        argv[0] = env.executable
    return shell_line(argv, a.command.env)


def _only_the_env_is_missing(findings) -> bool:
    failed = [f for f in findings if f.level == "fail"]
    return [f.id for f in failed] == ["vllm.env"] and failed[0].measured == "no vLLM found"


def _build_pinned_env(env_inputs: dict) -> dict:
    """Run pins/build-env (sizes first, its progress on stderr); the env it printed, probed."""
    import os

    from flashnext.checkout import find_checkout
    from flashnext.facts.vllm_env import probe_vllm_env
    from flashnext.serve import ServeError, build_vllm_env

    checkout = find_checkout()

    def say(msg: str) -> None:
        click.echo(f"flashnext: {msg}", err=True)

    try:
        env_dir = build_vllm_env(checkout.build_env, os.environ, say)
    except ServeError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        say("interrupted: nothing is started; rerun serve, pins/build-env resumes from its cache")
        raise SystemExit(130) from None
    return {**env_inputs, "vllm_env": probe_vllm_env(env_dir, "pins/build-env", os.environ, None)}


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
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--chunk-bytes", default=64 << 20, **_HIDDEN_INT)
@click.option("--sync-bytes", default=1 << 30, **_HIDDEN_INT)
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
    from flashnext.render import console, gib
    from flashnext.table import TableError
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
    except TableError as exc:
        raise click.ClickException(str(exc)) from exc
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

    The layout (packed or page-aligned) is read from the manifest beside the
    table (TABLE.json); without one the table is taken as packed. Exit 1 names
    the first mismatching row.
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
                ("layout", result.layout),
                ("size", f"{result.size_bytes} bytes ({gib(result.size_bytes)})"),
                ("manifest", result.manifest or "none (size and rows checked only)"),
                ("rows compared", f"{result.samples} (seed {result.seed})"),
                ("result", "ok" if result.ok else "MISMATCH"),
            ],
        )
    if not result.padding_ok:
        raise click.ClickException(
            f"{table_path}: page padding is not zero (not a page-aligned table as prepare "
            f"writes it)\n  fix: rerun `flashnext table prepare --model {model_dir} --out NEW "
            "--layout page-aligned` and replace the table"
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

    from flashnext.atomic import write_text_atomic
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
        try:
            write_text_atomic(out, dumps(facts))
        except OSError as exc:
            raise click.ClickException(f"cannot write {out}: {exc}") from exc
    if as_json:
        emit_json(facts)
        return
    for title, columns, rows in host_facts_tables(facts):
        render_table(title, columns, rows)
    if out:
        click.echo(f"facts written to {out}")


# ---- skeleton commands (owner: skeleton)


@main.command("skeleton")
@click.argument("out_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--tiny",
    is_flag=True,
    help="Write the 4-layer toy of the architecture (real bytes, ~5 MB) instead of the full model.",
)
@click.option(
    "--fixed-metadata",
    is_flag=True,
    help="Write the checkpoint as `checkpoint fix` leaves it: explicit config_groups targets "
    "and sampling keys in generation_config.json. Default: the shipped export defects.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as canonical JSON.")
def skeleton_command(out_dir: str, tiny: bool, fixed_metadata: bool, as_json: bool) -> None:
    """Write a Qwen3.8-Flash-Next INT4-mixed checkpoint skeleton to DIR (new or empty).

    The full skeleton has the true tensor inventory (names, dtypes, shapes,
    quantization config) with real safetensors headers and sparse data: about
    160 GB apparent, ~60 MB on disk. Plan and preflight against it before
    downloading: `flashnext plan --model DIR`.
    """
    import dataclasses

    from flashnext.render import emit_json, gib, render_table
    from flashnext.skeleton import SkeletonError, write_skeleton

    try:
        summary = write_skeleton(out_dir, "tiny" if tiny else "full", fixed_metadata=fixed_metadata)
    except (SkeletonError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        emit_json(dataclasses.asdict(summary))
        return
    render_table(
        "checkpoint skeleton",
        ("field", "value"),
        [
            ("path", summary.path),
            ("variant", summary.variant),
            ("metadata", "fixed" if summary.fixed_metadata else "as shipped (2 defects)"),
            ("files", summary.files),
            ("tensors", summary.tensors),
            ("tensor bytes", f"{summary.data_bytes} ({gib(summary.data_bytes)})"),
            ("header bytes", summary.header_bytes),
        ],
    )


# ---- checkpoint / bench / report commands (owner: operate)


def _model_facts_or_exit(model_dir: str):
    from flashnext.facts.model import ModelFactsError, read_model_facts

    try:
        return read_model_facts(model_dir)
    except ModelFactsError as exc:
        raise click.ClickException(str(exc)) from exc


_MODEL_OPTION = click.option(
    "--model",
    "model_dir",
    envvar="FLASHNEXT_MODEL",
    show_envvar=True,
    required=True,
    type=click.Path(file_okay=False),
    help="Checkpoint directory (config.json, generation_config.json, safetensors shards).",
)


@main.group("checkpoint")
def checkpoint_group() -> None:
    """Check and fix the checkpoint's metadata (quantization targets, sampling keys)."""


@checkpoint_group.command("check")
@_MODEL_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print the findings as canonical JSON.")
def checkpoint_check(model_dir: str, as_json: bool) -> None:
    """Resolve every module's scheme the way vLLM 0.33.0 will, against what its tensors store.

    Reports the shipped export defects (config_groups all targeting "Linear";
    generation_config.json without sampling keys), groups that match nothing,
    modules matched twice, and a PLE table missing from `ignore`. Exit 1 on any
    failed check.
    """
    from flashnext.checkpoint import check
    from flashnext.render import emit_json, render_table, write_fix_lines

    report = check(_model_facts_or_exit(model_dir))
    if as_json:
        emit_json(report.to_json())
    else:
        rows = [(f.status, f.id, f.message) for f in report.findings]
        render_table(f"checkpoint check: {model_dir}", ("status", "check", "finding"), rows)
        fixes = [(f.id, f.fix) for f in report.findings if f.status != "ok" and f.fix]
        write_fix_lines(fixes, _prog())
    if report.failed:
        raise SystemExit(1)


@checkpoint_group.command("fix")
@_MODEL_OPTION
@click.option(
    "--generation-config-from",
    "generation_source",
    type=click.Path(exists=True),
    help="Directory (or file) whose generation_config.json supplies the sampling keys, "
    "e.g. the published checkpoint's.",
)
@click.option(
    "--sampling",
    "sampling_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="A sampling key vLLM reads, e.g. --sampling temperature=0.7 (repeatable; values "
    "from the model card: flashnext never invents them).",
)
@click.option("--dry-run", is_flag=True, help="Show the diff; write nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as canonical JSON.")
def checkpoint_fix(
    model_dir: str,
    generation_source: str | None,
    sampling_pairs: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
) -> None:
    """Rewrite config_groups targets to exact `re:` patterns derived from the tensors.

    Each group's targets then match exactly the modules whose stored tensors
    (dtype, packed shape, group size) carry its scheme; the PLE table is added
    to `ignore`. Sampling keys are restored only from --generation-config-from
    or --sampling. Originals are kept as FILE.orig (first run only); writes are
    atomic; a second run changes nothing. Exit 1 if a defect remains.
    """
    from pathlib import Path

    from flashnext.checkpoint import (
        CheckpointError,
        apply_fix,
        parse_sampling,
        plan_fix,
        sampling_from_dir,
    )
    from flashnext.render import emit_json

    if generation_source and sampling_pairs:
        raise click.UsageError("pass --generation-config-from or --sampling, not both")
    model = _model_facts_or_exit(model_dir)
    try:
        if generation_source:
            sampling = sampling_from_dir(Path(generation_source))
        else:
            sampling = parse_sampling(sampling_pairs) if sampling_pairs else None
        plan = plan_fix(model, sampling)
        backups = [] if dry_run else apply_fix(plan)
    except (CheckpointError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        emit_json(
            {
                "model_dir": model_dir,
                "dry_run": dry_run,
                "changed": sorted(plan.changes),
                "diff": plan.diff(),
                "notes": plan.notes,
                "backups": [str(b) for b in backups],
                "remaining": plan.remaining,
            }
        )
    else:
        if dry_run:
            click.echo(plan.diff(), nl=False)
        for note in plan.notes:
            click.echo(f"{'would fix' if dry_run else 'fixed'}: {note}")
        for backup in backups:
            click.echo(f"original kept as {backup}")
        if not plan.changes:
            click.echo("nothing to change")
        for left in plan.remaining:
            click.echo(f"not fixed: {left}", err=True)
    if plan.remaining:
        raise SystemExit(1)


def _csv_ints(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers") from None
    if any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: every value must be >= 1")
    return out


def _id_range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        parts = tuple(int(v) for v in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 2 or not 0 <= parts[0] < parts[1]:
        raise click.BadParameter(f"{value!r}: expected LO,HI with 0 <= LO < HI")
    return parts


def _json_file(path: str | None, what: str) -> dict | None:
    import json
    from pathlib import Path

    if path is None:
        return None
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"{path}: cannot read {what} JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise click.BadParameter(f"{path}: {what} must be a JSON object")
    return doc


@main.command()
@click.option(
    "--url",
    required=True,
    envvar="FLASHNEXT_BENCH_URL",
    show_envvar=True,
    help="Server base URL, e.g. http://127.0.0.1:8000.",
)
@click.option(
    "--served-model-name",
    default="qwen3.8-flash-next",
    show_default=True,
    help="Model name to request (as `flashnext serve` registered it).",
)
@click.option(
    "--api-key-file",
    type=click.Path(exists=True, dir_okay=False),
    help="File holding the API key (else VLLM_API_KEY).",
)
@click.option(
    "--concurrency",
    default="1,4",
    show_default=True,
    callback=_csv_ints,
    help="Decode concurrencies to measure.",
)
@click.option(
    "--decode-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(2),
    help="Tokens generated per decode request (ignore_eos).",
)
@click.option(
    "--prompt-lengths",
    default="4096",
    show_default=True,
    callback=_csv_ints,
    help="Prompt lengths (tokens) for prefill; 247823 is the seed's.",
)
@click.option(
    "--prefill-concurrency",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Prompts prefilled at once (the seed's figure used 4).",
)
@click.option(
    "--warmup",
    default=1,
    show_default=True,
    type=click.IntRange(0),
    help="Unmeasured runs before each measurement (graphs, caches, page faults).",
)
@click.option(
    "--runs",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    help="Measured runs per measurement; the summary reports their median.",
)
@click.option(
    "--token-id-range",
    default="1000,100000",
    show_default=True,
    callback=_id_range,
    metavar="LO,HI",
    help="Prompt token ids are drawn from [LO, HI): inside the model's vocabulary, clear "
    "of its special tokens.",
)
@click.option(
    "--facts",
    "facts_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Facts for the fingerprint (`flashnext facts --json`); default: probe.",
)
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False),
    help="`flashnext plan --json` output: fingerprint and decode roofline.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Write raw.jsonl and summary.json here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as canonical JSON.")
def bench(
    url: str,
    served_model_name: str,
    api_key_file: str | None,
    concurrency: tuple[int, ...],
    decode_tokens: int,
    prompt_lengths: tuple[int, ...],
    prefill_concurrency: int,
    warmup: int,
    runs: int,
    token_id_range: tuple[int, int],
    facts_file: str | None,
    plan_file: str | None,
    out_dir: str | None,
    as_json: bool,
) -> None:
    """Decode tok/s (c=1, c=4), TTFT and prefill tok/s against a running server.

    Streams completions with exact token counts; any incomplete stream is
    rejected and makes the run fail (exit 1). Compares the medians with the
    seed's figures (80 tok/s at c=1, 152-155 at c=4, 4x247,823 tokens prefilled
    in 368 s) and the plan's decode roofline.
    """
    import os
    from pathlib import Path

    from flashnext import bench as b
    from flashnext.facts.schema import to_jsonable
    from flashnext.render import emit_json, render_table
    from flashnext.report import redactor_for_this_host, versions
    from flashnext.serve import ServeError, load_api_key

    try:
        api_key = load_api_key(os.environ, api_key_file)
    except ServeError as exc:
        raise click.ClickException(str(exc)) from exc
    facts = _json_file(facts_file, "facts")
    if facts is None:
        from flashnext.facts.collect import collect_host_facts

        facts = to_jsonable(collect_host_facts())
    cfg = b.BenchConfig(
        url=url,
        model=served_model_name,
        api_key=api_key,
        concurrency=concurrency,
        decode_tokens=decode_tokens,
        prompt_lengths=prompt_lengths,
        prefill_concurrency=prefill_concurrency,
        warmup=warmup,
        runs=runs,
        token_id_range=token_id_range,
    )
    try:
        records = b.run_bench(cfg, progress=lambda m: click.echo(f"bench: {m}", err=True))
    except b.BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    # Results get shared: the fingerprint is redacted like `flashnext report`.
    redact = redactor_for_this_host(facts)
    plan = _json_file(plan_file, "plan")
    fingerprint = b.fingerprint(redact.value(facts), redact.value(plan), versions())
    result = b.build_result(cfg, records, fingerprint)
    if out_dir:
        b.write_results(Path(out_dir), records, result)
    if as_json:
        emit_json(result)
    else:
        rows = []
        for d in result["summary"]["decode"]:
            agg, ttft = d["aggregate_tok_s"], d["ttft_s"]
            rows.append(
                (
                    f"decode c={d['concurrency']}",
                    f"{agg['median']:.2f}" if agg else "-",
                    f"{ttft['median'] * 1000:.0f} ms",
                    agg["n"] if agg else 0,
                )
            )
        for p in result["summary"]["prefill"]:
            rate, ttft = p["prefill_tok_s"], p["ttft_s"]
            rows.append(
                (
                    f"prefill {p['concurrency']}x{p['prompt_tokens']}",
                    f"{rate['median']:.1f}",
                    f"{ttft['median']:.2f} s",
                    rate["n"],
                )
            )
        render_table("bench (medians)", ("measure", "tok/s", "TTFT", "runs"), rows)
        render_table(
            "against the seed report and the roofline",
            ("metric", "measured", "reference", "ratio", "note"),
            [
                (c["metric"], c["measured"], c["reference"], c["ratio"], c["note"])
                for c in result["comparison"]
            ],
        )
        if out_dir:
            click.echo(f"raw measurements and summary written to {out_dir}")
    for r in result["rejected"]:
        click.echo(
            f"bench: rejected {r['phase']} c={r['concurrency']} run {r['run']}: {r['why']}",
            err=True,
        )
    if result["rejected"]:
        raise SystemExit(1)


@main.command("report")
@_plan_options
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False),
    help="Write the report here (atomically) instead of to stdout.",
)
@click.option(
    "--vllm-python",
    envvar="FLASHNEXT_VLLM_PY",
    show_envvar=True,
    help="Python of the vLLM env that serves (ENV/venv/bin/python): its patch stamp is "
    "reported and checked against this checkout's series.",
)
def report_cmd(as_json: bool, out_file: str | None, vllm_python: str | None, **kw) -> None:
    """Facts, plan, preflight, versions and patch hashes as one redacted JSON file.

    Hostname, user name, serials/UUIDs, MAC and non-loopback IP addresses,
    secrets and paths under $HOME are redacted; attach the file to a bug
    report. A part that cannot be collected is recorded as unavailable.
    """
    import json
    from pathlib import Path

    from flashnext import report as r
    from flashnext.facts.schema import to_jsonable
    from flashnext.plan.command import plan_json
    from flashnext.render import emit_json

    facts = plan = preflight = None
    try:
        a = _assess(kw)
        facts = to_jsonable(a.facts)
        plan = plan_json(a.plan, a.command) if a.plan else {"unavailable": a.plan_error}
        preflight = {"profile": a.profile.name, "findings": to_jsonable(a.findings)}
    except (click.ClickException, OSError, ValueError) as exc:
        preflight = {"unavailable": str(getattr(exc, "message", exc))}
    series = r.patch_series(r.default_series_dir())
    vllm_dir = r.vllm_package_dir(vllm_python) if vllm_python else None
    doc = r.build_report(
        facts=facts,
        plan=plan,
        preflight=preflight,
        versions={**r.versions(), "vllm_env": r.env_versions(vllm_python)}
        if vllm_python
        else r.versions(),
        patches=series,
        redactor=r.redactor_for_this_host(facts),
        applied=r.applied_patches(vllm_dir, series),
    )
    if out_file is None:
        emit_json(doc)
        return
    try:
        r.write_report(Path(out_file), json.dumps(doc, sort_keys=True, indent=2) + "\n")
    except OSError as exc:
        raise click.ClickException(
            f"cannot write {out_file}: {exc.strerror or exc}\n"
            "  fix: pass --out a path on a writable filesystem, or drop --out to print the report"
        ) from exc
    if as_json:
        emit_json({"out": out_file, "redactions": doc["redactions"]})
    else:
        counts = ", ".join(f"{k} {v}" for k, v in doc["redactions"].items()) or "nothing"
        click.echo(f"report written to {out_file} (redacted: {counts})")
