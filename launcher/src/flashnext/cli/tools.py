"""`flashnext bench`, `report` and `skeleton`: tools around a server, a bug report and a
checkpoint to plan before downloading."""

from __future__ import annotations

import click

from flashnext.cli.root import FlashnextError, main
from flashnext.cli.serving import assess_from_settings
from flashnext.cli.settings import PLAN_SETTINGS, options
from flashnext.cli.soak import soak_options
from flashnext.units import gib

# Bounds of bench's numbers: each sizes requests, prompts held in memory or run time.
MAX_CONCURRENCY = 1024
MAX_PROMPT_TOKENS = 1 << 24  # a prompt's ids are built in memory: 16M tokens, ~0.5 GB
MAX_RUNS = 1000
DEADLINE_S = 3600.0


def _csv_ints(most: int):
    def parse(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, ...]:
        try:
            out = tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise click.BadParameter(f"{value!r}: expected comma-separated integers") from None
        if any(not 1 <= v <= most for v in out):  # empty: that phase is skipped
            raise click.BadParameter(f"{value!r}: every value must be 1 to {most}")
        return out

    return parse


def _id_range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[int, int]:
    try:
        parts = tuple(int(v) for v in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 2 or not 0 <= parts[0] < parts[1] <= 1 << 31:
        raise click.BadParameter(f"{value!r}: expected LO,HI with 0 <= LO < HI <= 2^31")
    return parts


def _json_file(path: str | None, what: str, flag: str) -> dict | None:
    """A small UTF-8 JSON object a flag names, else a usage error naming the flag."""
    from flashnext.facts.jsonfile import JsonFileError, read_json_object

    if path is None:
        return None
    try:
        return read_json_object(path, what)
    except JsonFileError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{flag}'") from None


def _plan_file(path: str | None) -> dict | None:
    """--plan: `flashnext plan --json` output, its shape checked before the bench runs:
    what bench reads of it (the decode roofline, the MTP projection's acceptance rate)
    is a number where present, and one of them is."""
    plan = _json_file(path, "plan file", "--plan")
    if plan is None:
        return None
    read = {}
    for where in (("decode", "tokens_per_s"), ("mtp", "projection", "acceptance_rate")):
        node = plan
        for key in where:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            read[".".join(where)] = node
    bad = [k for k, v in read.items() if not _finite_number(v)]
    if not read or bad:
        what = f"{bad[0]} is not a number" if bad else "no decode.tokens_per_s"
        raise click.BadParameter(
            f"{path}: {what}, so not `flashnext plan --json` output; write one with "
            "`flashnext plan --json ... > plan.json`",
            param_hint="'--plan'",
        )
    return plan


def _finite_number(value: object) -> bool:
    import math

    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _writable_dir(path: str | None) -> None:
    """--out: a directory this user can create or write, checked before the bench runs
    (nothing is created until the results are)."""
    import os
    from pathlib import Path

    if path is None:
        return
    target = Path(path).absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())
    if not existing.is_dir():
        raise click.BadParameter(f"{existing} is not a directory", param_hint="'--out'")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise click.BadParameter(
            f"{existing} is not writable: pass --out a directory you can write",
            param_hint="'--out'",
        )


@main.command()
@click.option(
    "--url",
    required=True,
    envvar="FLASHNEXT_BENCH_URL",
    show_envvar=True,
    help="Server base URL, e.g. http://127.0.0.1:8000.",
)
@options("served_model_name", "api_key_file")
@click.option(
    "--concurrency",
    default="1,4",
    show_default=True,
    callback=_csv_ints(MAX_CONCURRENCY),
    help="Decode concurrencies to measure.",
)
@click.option(
    "--decode-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(2, MAX_PROMPT_TOKENS),
    help="Tokens generated per decode request (ignore_eos).",
)
@click.option(
    "--prompt-lengths",
    default="4096",
    show_default=True,
    callback=_csv_ints(MAX_PROMPT_TOKENS),
    help="Prompt lengths (tokens) for prefill; 247823 is the seed's.",
)
@click.option(
    "--prefill-concurrency",
    default=1,
    show_default=True,
    type=click.IntRange(1, MAX_CONCURRENCY),
    help="Prompts prefilled at once (the seed's figure used 4).",
)
@click.option(
    "--warmup",
    default=1,
    show_default=True,
    type=click.IntRange(0, MAX_RUNS),
    help="Unmeasured runs before each measurement (graphs, caches, page faults).",
)
@click.option(
    "--runs",
    default=3,
    show_default=True,
    type=click.IntRange(1, MAX_RUNS),
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
    "--deadline",
    "deadline_s",
    default=DEADLINE_S,
    show_default=True,
    type=click.FloatRange(1.0, 7 * 24 * 3600.0),
    help="Seconds the whole bench may take: a request still open then is rejected, "
    "whatever the server keeps sending, and the phases left are not run.",
)
@options("facts_file")
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
@soak_options
@options("as_json")
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
    deadline_s: float,
    facts_file: str | None,
    plan_file: str | None,
    out_dir: str | None,
    as_json: bool,
    soak_s: float | None,
    **soak_kw,
) -> None:
    """Decode tok/s (c=1, c=4), TTFT and prefill tok/s against a running server;
    with --soak DURATION, a mixed workload held that long instead (docs/soak.md).

    Streams completions with exact token counts; any incomplete stream is
    rejected and makes the run fail (exit 1). Compares the medians with the
    seed's figures (80 tok/s at c=1, 152-155 at c=4, 4x247,823 tokens prefilled
    in 368 s) and the plan's decode roofline.
    """
    import os
    from pathlib import Path

    from flashnext.facts.schema import to_jsonable
    from flashnext.render import emit_json, render_table
    from flashnext.serve import load_api_key
    from flashnext.tools import bench as b
    from flashnext.tools.report import redactor_for_this_host, versions

    # Every input is read and checked before the first request: a bad one must not
    # throw a finished benchmark away.
    longest = max(prompt_lengths, default=0)
    if prefill_concurrency * longest > b.MAX_BATCH_PROMPT_TOKENS:
        raise click.UsageError(
            f"--prefill-concurrency {prefill_concurrency} x --prompt-lengths {longest} = "
            f"{prefill_concurrency * longest} prompt tokens held at once, more than "
            f"{b.MAX_BATCH_PROMPT_TOKENS}: lower one of them"
        )
    api_key = load_api_key(os.environ, api_key_file)
    if soak_s is not None:
        from flashnext.cli.soak import run as run_soak

        _writable_dir(out_dir)
        run_soak(url=url, model=served_model_name, api_key=api_key,
                 token_id_range=token_id_range, out_dir=out_dir, as_json=as_json,
                 soak_s=soak_s, **soak_kw)  # fmt: skip
        return
    facts = _json_file(facts_file, "facts file", "--facts")
    plan = _plan_file(plan_file)
    _writable_dir(out_dir)
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
        deadline_s=deadline_s,
    )
    drafted_before = b.read_spec_decode(cfg)  # MTP's counters, when the server drafts
    records = b.run_bench(cfg, progress=lambda m: click.echo(f"bench: {m}", err=True))
    spec_decode = b.spec_decode_window(drafted_before, b.read_spec_decode(cfg))
    # Results get shared: the fingerprint is redacted like `flashnext report`.
    redact = redactor_for_this_host(facts)
    fingerprint = b.fingerprint(redact.value(facts), redact.value(plan), versions())
    result = b.build_result(cfg, records, fingerprint, spec_decode)
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
        spec = result["spec_decode"]
        if spec and spec["acceptance_rate"] is not None:
            click.echo(
                f"MTP: {spec['accepted_tokens']} of {spec['draft_tokens']} draft tokens accepted "
                f"(rate {spec['acceptance_rate']:.3f}, mean acceptance length "
                f"{spec['mean_acceptance_length']:.2f}), from the server's /metrics"
            )
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
@options(*PLAN_SETTINGS)
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

    from flashnext.facts.schema import to_jsonable
    from flashnext.plan.command import plan_json
    from flashnext.render import emit_json
    from flashnext.tools import report as r

    facts = plan = preflight = None
    try:
        a = assess_from_settings(kw)
        facts = to_jsonable(a.facts)
        plan = plan_json(a.plan, a.command) if a.plan else {"unavailable": a.plan_error}
        preflight = {"profile": a.profile.name, "findings": to_jsonable(a.findings)}
    except (click.ClickException, OSError, ValueError) as exc:
        # Nothing was assessed: each part says why (a bad --facts file, say).
        facts = plan = preflight = {"unavailable": str(getattr(exc, "message", exc))}
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
    from flashnext.input_files import OutputClash, refuse_input_paths

    try:
        refuse_input_paths(out_file, kw["model_dir"], kw["table_path"], "report --out")
    except OutputClash as exc:
        raise FlashnextError(exc.message, exc.fix) from None
    try:
        r.write_report(Path(out_file), json.dumps(doc, sort_keys=True, indent=2) + "\n")
    except OSError as exc:
        raise FlashnextError(
            f"cannot write {out_file}: {exc.strerror or exc}",
            "pass --out a path on a writable filesystem, or drop --out to print the report",
        ) from exc
    if as_json:
        emit_json({"out": out_file, "redactions": doc["redactions"]})
    else:
        counts = ", ".join(f"{k} {v}" for k, v in doc["redactions"].items()) or "nothing"
        click.echo(f"report written to {out_file} (redacted: {counts})")


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
    help="Write the checkpoint as `checkpoint fix --sampling ...` leaves it (its own code "
    "derives the metadata): explicit config_groups targets, the PLE table in `ignore`, and "
    "sampling keys in generation_config.json. Default: the shipped export defects.",
)
@options("as_json")
def skeleton_command(out_dir: str, tiny: bool, fixed_metadata: bool, as_json: bool) -> None:
    """Write a Qwen3.8-Flash-Next INT4-mixed checkpoint skeleton to DIR (new or empty).

    The full skeleton has the true tensor inventory (names, dtypes, shapes,
    quantization config) with real safetensors headers and sparse data: about
    160 GB apparent, ~60 MB on disk. Plan and preflight against it before
    downloading: `flashnext plan --model DIR`.
    """
    import dataclasses

    from flashnext.render import emit_json, render_table
    from flashnext.skeleton import write_skeleton

    try:
        summary = write_skeleton(out_dir, "tiny" if tiny else "full", fixed_metadata=fixed_metadata)
    except OSError as exc:
        from flashnext.write_errors import write_failure

        message, fix = write_failure(exc, out_dir)
        raise FlashnextError(
            message, fix or "pass a DIR on a writable filesystem with ~60 MB free"
        ) from exc
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
