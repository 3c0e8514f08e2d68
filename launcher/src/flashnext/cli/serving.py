"""`flashnext preflight`, `plan` and `serve`: facts → plan → findings → `vllm serve`."""

from __future__ import annotations

import click

from flashnext import __version__
from flashnext.cli.root import FlashnextError, main
from flashnext.cli.settings import PLAN_SETTINGS, options, plan_options
from flashnext.invocation import invoked_as, name_command


def name_command_here(text: str) -> str:
    """`text` with `flashnext <subcommand>` naming the command as it was invoked."""
    return name_command(text, invoked_as())


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
            raise FlashnextError(
                f"cannot read this checkout's patch series ({exc}); restore patches/ "
                "(git checkout patches)"
            ) from exc
    return {
        "vllm_env": probe_vllm_env(env_dir, selected_by, os.environ, checkout),
        "patch_series": series,
        "build_env": _build_env_command(checkout),
    }


def assess_from_settings(
    kw: dict, model=None, env_inputs: dict | None = None, api_key_set: bool | None = None
):
    """Facts (probed or replayed), profile, plan, findings; with `env_inputs` the vLLM
    env is judged too (preflight, serve); `api_key_set`: whether the server will demand
    a key (None: not asked, `plan`)."""
    from flashnext.assess import assess, load_facts

    options = plan_options(kw)
    facts = load_facts(kw["facts_file"], options)
    return assess(
        facts,
        options,
        kw["profile_name"],
        model=model,
        facts_source=kw["facts_file"],
        api_key_set=api_key_set,
        **(env_inputs or {}),
    )


def _api_key(api_key_file: str | None) -> str | None:
    """The key serve will hand vLLM: --api-key-file's, else VLLM_API_KEY's; a bad file
    is an error (exit 1) before anything is probed or started."""
    import os

    from flashnext.serve import load_api_key

    return load_api_key(os.environ, api_key_file)


def _preflight_doc(a) -> dict:
    import dataclasses

    from flashnext.checks import worst
    from flashnext.facts.schema import to_jsonable
    from flashnext.plan.command import plan_json

    findings = [dataclasses.replace(f, fix=name_command_here(f.fix)) for f in a.findings]
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
@options(*PLAN_SETTINGS, "vllm_env_dir", "api_key_file")
def preflight(as_json: bool, vllm_env_dir: str | None, api_key_file: str | None, **kw) -> None:
    """Check this host (or a facts file), the model, the table and the vLLM env serve runs.

    Every failed check says what was measured, what is required and how to fix
    it. Exit 1 if any check fails.
    """
    from flashnext.render import emit_json

    a = assess_from_settings(
        kw,
        env_inputs=_vllm_env_inputs(vllm_env_dir, _vllm_env_selection()),
        api_key_set=_api_key(api_key_file) is not None,
    )
    if as_json:
        emit_json(_preflight_doc(a))
    else:
        _render_preflight(a.findings)
    if any(f.level == "fail" for f in a.findings):
        raise SystemExit(1)


def _render_preflight(findings) -> None:
    from flashnext.render import render_findings

    render_findings(findings, invoked_as())
    click.echo(_summary_line(findings))


@main.command("plan")
@options(*PLAN_SETTINGS)
def plan_cmd(as_json: bool, **kw) -> None:
    """Partition, per-rank VRAM, KV bytes, host pools, roofline and the vLLM command.

    Pure: reads facts (probed or --facts) and the checkpoint's headers, starts
    nothing. Exit 1 if no plan can be made.
    """
    from flashnext.plan.command import plan_json
    from flashnext.render import emit_json, render_plan

    a = assess_from_settings(kw)
    if a.plan is None:
        raise FlashnextError(f"no plan: {a.plan_error}")
    if kw["profile_name"] and a.facts.gpu.devices and not a.profile.matches(a.facts):
        seen = ", ".join(sorted({d.name for d in a.facts.gpu.devices}))
        raise FlashnextError(
            f"profile {a.profile.name} is for {a.profile.gpu.count}x {a.profile.gpu.label}, "
            f"the facts show {len(a.facts.gpu.devices)}x {seen}; drop --profile or pass "
            "--facts recorded on the serving host"
        )
    if as_json:
        emit_json(plan_json(a.plan, a.command))
    else:
        render_plan(a.plan, a.command)


@main.command()
@options(
    *PLAN_SETTINGS,
    "vllm_env_dir",
    facts_file={"help": "Refused by serve, which judges the host it runs on (replay facts "
                "with plan or preflight; for tests: --replay-facts-for-testing)."},
)  # fmt: skip
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
    callback=lambda ctx, param, value: _seconds(value),
    help="Seconds to wait for /health (cold starts load 62 GiB).",
)
@options("api_key_file", "replay_facts_for_testing")
# The image's entrypoint is `flashnext serve`: `podman run IMAGE --version` lands here.
@click.version_option(__version__, prog_name="flashnext")
def serve(
    as_json: bool,
    vllm_env_dir: str | None,
    dry_run: bool,
    startup_timeout: float,
    api_key_file: str | None,
    replay_facts_for_testing: str | None,
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

    kw["facts_file"] = _serve_facts(kw["facts_file"], replay_facts_for_testing)
    api_key = _api_key(api_key_file)
    env_inputs = _vllm_env_inputs(vllm_env_dir, _vllm_env_selection())
    a = assess_from_settings(kw, env_inputs=env_inputs, api_key_set=api_key is not None)
    if not dry_run and _only_the_env_is_missing(a.findings) and env_inputs["build_env"]:
        env_inputs = _build_pinned_env(env_inputs)
        a = assess_from_settings(
            kw, model=a.model, env_inputs=env_inputs, api_key_set=api_key is not None
        )
    failed = [f for f in a.findings if f.level == "fail"]
    command = _command_line(a) if a.plan else None
    if as_json:
        doc = {**_preflight_doc(a), "dry_run": dry_run, "command": command}
        if replay_facts_for_testing:  # absent otherwise: the envelope of a real serve
            doc["replayed_facts_for_testing"] = replay_facts_for_testing
        emit_json(doc)
    elif not dry_run or any(f.level != "ok" for f in a.findings):
        _render_preflight(a.findings)  # a dry run's warnings too, before its command
    if dry_run:
        if not as_json:
            if command is not None:
                click.echo(command)
            else:
                click.echo(f"serve --dry-run: no command: {a.plan_error}", err=True)
        if failed:
            click.echo(
                f"serve --dry-run: {len(failed)} check(s) failed (above): serve refuses to "
                f"run this command until they pass (`{invoked_as()} preflight` re-checks)",
                err=True,
            )
            raise SystemExit(1)
        return
    if failed:
        click.echo(
            "serve: not starting vLLM: fix the failed checks above "
            f"(`{invoked_as()} preflight` re-checks)",
            err=True,
        )
        raise SystemExit(1)
    from flashnext.serve import supervise

    vllm = a.vllm_env
    click.echo(f"flashnext: vLLM: {vllm.executable} ({vllm.selected_by})", err=True)
    # The key reaches vLLM through its environment (supervise sets VLLM_API_KEY), never
    # through argv, which `ps` shows to every user of the host.
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


MAX_STARTUP_S = 7 * 24 * 3600.0


def _seconds(value: float) -> float:
    """--startup-timeout: finite, positive, at most a week (nan and inf parse as floats)."""
    if not 0 < value <= MAX_STARTUP_S:  # False for nan too
        raise click.BadParameter(f"{value}: expected seconds, more than 0 and at most "
                                 f"{MAX_STARTUP_S:.0f} (a week)")  # fmt: skip
    return value


def _serve_facts(facts_file: str | None, replay: str | None) -> str | None:
    """The facts file serve judges: none (this host) unless the testing replay is asked
    for, loudly. Plain --facts is refused: a command that starts a server must judge the
    host it runs on, and replayed GPUs, memory and table would vouch for another one."""
    from click.core import ParameterSource

    if facts_file is not None:
        ctx = click.get_current_context()
        from_env = ctx.get_parameter_source("facts_file") == ParameterSource.ENVIRONMENT
        raise click.BadParameter(
            "serve judges the host it runs on, not facts recorded elsewhere: "
            + ("unset FLASHNEXT_FACTS" if from_env else "drop --facts")
            + " (replayed facts are for `flashnext plan` and `flashnext preflight`); to test "
            "serve against recorded facts, pass --replay-facts-for-testing FILE "
            "(FLASHNEXT_TEST_REPLAY_FACTS)",
            param_hint="FLASHNEXT_FACTS" if from_env else "'--facts'",
        )
    if replay is not None:
        click.echo(
            f"flashnext: TESTING ONLY: judging the facts replayed from {replay} "
            "(--replay-facts-for-testing), not this host: the GPU, memory and table checks "
            "below say nothing about this machine",
            err=True,
        )
    return replay


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
    from flashnext.serve import build_vllm_env

    checkout = find_checkout()

    def say(msg: str) -> None:
        click.echo(f"flashnext: {msg}", err=True)

    try:
        env_dir = build_vllm_env(checkout.build_env, os.environ, say)
    except KeyboardInterrupt:
        say("interrupted: nothing is started; rerun serve, pins/build-env resumes from its cache")
        raise SystemExit(130) from None
    return {**env_inputs, "vllm_env": probe_vllm_env(env_dir, "pins/build-env", os.environ, None)}
