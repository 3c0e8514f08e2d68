"""`flashnext checkpoint check|fix`: the checkpoint's metadata against its tensors."""

from __future__ import annotations

import click

from flashnext.cli.root import FlashnextError, main
from flashnext.cli.settings import options
from flashnext.invocation import invoked_as


@main.group("checkpoint")
def checkpoint_group() -> None:
    """Check and fix the checkpoint's metadata (quantization targets, sampling keys)."""


@checkpoint_group.command("check")
@options("model_dir", "as_json", model_dir={"required": True})
def checkpoint_check(model_dir: str, as_json: bool) -> None:
    """Resolve every module's scheme the way vLLM 0.33.0 will, against what its tensors store.

    Reports the shipped export defects (config_groups all targeting "Linear";
    generation_config.json without sampling keys), groups that match nothing,
    modules matched twice, and a PLE table missing from `ignore`. Exit 1 on any
    failed check.
    """
    from flashnext.checks.checkpoint_metadata import check
    from flashnext.facts.model import read_model_facts
    from flashnext.render import emit_json, render_table, write_fix_lines

    report = check(read_model_facts(model_dir))
    if as_json:
        emit_json(report.to_json())
    else:
        rows = [(f.status, f.id, f.message) for f in report.findings]
        render_table(f"checkpoint check: {model_dir}", ("status", "check", "finding"), rows)
        fixes = [(f.id, f.fix) for f in report.findings if f.status != "ok" and f.fix]
        write_fix_lines(fixes, invoked_as())
    if report.failed:
        raise SystemExit(1)


@checkpoint_group.command("fix")
@options("model_dir", model_dir={"required": True})
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
@options("as_json")
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

    from flashnext.checkpoint.fix import apply_fix, plan_fix
    from flashnext.checkpoint.sampling import parse_sampling, sampling_from_dir
    from flashnext.facts.model import read_model_facts
    from flashnext.render import emit_json

    if generation_source and sampling_pairs:
        raise click.UsageError("pass --generation-config-from or --sampling, not both")
    model = read_model_facts(model_dir)
    if generation_source:
        sampling = sampling_from_dir(Path(generation_source))
    else:
        sampling = parse_sampling(sampling_pairs) if sampling_pairs else None
    plan = plan_fix(model, sampling)
    try:
        backups = [] if dry_run else apply_fix(plan)
    except OSError as exc:  # each file is replaced whole: a rerun finishes the rest
        raise _fix_write_error(exc, model_dir, plan) from exc
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


def _fix_write_error(exc: OSError, model_dir: str, plan) -> FlashnextError:
    """checkpoint fix could not write into the checkpoint: say so, and what still works
    (serve --generation-config leaves the checkpoint as it is)."""
    import errno

    from flashnext.write_errors import write_failure

    message, fix = write_failure(exc, model_dir)
    if fix is None and exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        if set(plan.changes) == {"generation_config.json"}:
            fix = ("leave the checkpoint as it is: serve with `flashnext serve --generation-config "
                   "DIR`, DIR holding the published generation_config.json")  # fmt: skip
        else:
            fix = ("copy the checkpoint to a writable directory and run `flashnext checkpoint "
                   "fix` there, or make this one writable")  # fmt: skip
    return FlashnextError(message, fix)


@checkpoint_group.command("mtp-int4")
@options("model_dir", "vllm_env_dir", model_dir={"required": True})
def checkpoint_mtp_int4(model_dir: str, vllm_env_dir: str | None) -> None:
    """Write the MTP layer's routed experts as INT4 W4A16 g128 (MTP on 3x3090).

    The checkpoint ships them in BF16 (4.69 GiB); as INT4, the scheme of the
    model's other experts, they take about 1.2 GiB. The MTP layer goes into one
    new shard, mtp-int4.safetensors; the BF16 shards, the index and config.json
    as they were are kept as *.bf16-mtp. Runs in the vLLM env serve would use
    (torch and compressed-tensors' packer), on the CPU. A second run changes
    nothing; after an interruption it finishes the job.
    """
    import os
    import subprocess
    from pathlib import Path

    import flashnext
    from flashnext.checkout import find_checkout
    from flashnext.facts.vllm_env import probe_vllm_env

    selected_by = "--vllm-env"
    env = probe_vllm_env(vllm_env_dir, selected_by, os.environ, find_checkout())
    if env.python is None or env.error:
        raise FlashnextError(
            f"no vLLM env to run the quantizer in ({env.error or 'none found'})",
            fix="pins/build-env   # then rerun; or pass --vllm-env DIR",
        )
    src = str(Path(flashnext.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [env.python, "-m", "flashnext.checkpoint.mtp_int4", model_dir],
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    if proc.returncode:
        raise SystemExit(proc.returncode)
