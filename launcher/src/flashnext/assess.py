"""Gather facts (probe or replay), read the model, pick a profile, plan, check.

The one place that strings the pure pieces together for `preflight`, `plan`
and `serve`; the CLI renders what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput
from flashnext.checks.preflight import preflight
from flashnext.facts.model import (
    CONFIG_FILE,
    ModelFactsError,
    read_generation_config_dir,
    read_model_facts,
)
from flashnext.facts.model_derived import ple_table_shape
from flashnext.facts.plausible import replayed_facts
from flashnext.facts.schema import HostFacts, ModelFacts, VllmEnvFacts
from flashnext.plan.command import ServeCommand, serve_command
from flashnext.plan.partition import PartitionError
from flashnext.plan.planner import Plan, PlanError, PlanOptions, plan
from flashnext.profiles import Profile, select_profile, with_mtp


@dataclass(frozen=True)
class Assessment:
    facts: HostFacts
    profile: Profile
    profile_reason: str
    model: ModelFacts | None
    model_error: str | None
    plan: Plan | None
    plan_error: str | None
    findings: list[Finding]
    vllm_env: VllmEnvFacts | None = None
    """The vLLM serve would start, when it was asked (preflight, serve)."""
    command: ServeCommand | None = None
    """The plan as `vllm serve` argv and env; None without a plan."""


def load_facts(facts_file: str | None, options: PlanOptions) -> HostFacts:
    """Replay a facts file, or probe this host for the paths and port in `options`."""
    if facts_file is not None:
        return replayed_facts(facts_file)
    from flashnext.facts.collect import collect_host_facts  # the only probing import

    storage = {
        role: path
        for role, path in (("table", options.table_path), ("model", options.model_dir))
        if path
    }
    return collect_host_facts(storage, [(options.host, options.port)])


def read_model(model_dir: str | None) -> tuple[ModelFacts | None, str | None]:
    model, error, _, _ = _read_model(model_dir)
    return model, error


def _read_model(
    model_dir: str | None,
) -> tuple[ModelFacts | None, str | None, bool, str | None]:
    """(facts, why not, whether the directory itself is missing, the reader's own fix)."""
    if not model_dir:
        return None, "no model directory given", False, None
    try:
        return read_model_facts(model_dir), None, False, None
    except ModelFactsError as exc:
        return None, str(exc), exc.missing_dir, exc.fix


def reference_plan(
    facts: HostFacts, profile: Profile, options: PlanOptions, reason: str
) -> Plan | None:
    """The plan for the profile's own checkpoint (its skeleton inventory), used to size
    host memory when no checkpoint could be read or planned; None without one."""
    if profile.checkpoint.skeleton is None:
        return None
    from flashnext.skeleton import reference_model_facts

    try:
        return plan(facts, reference_model_facts(profile.checkpoint.skeleton), profile, options,
                    profile_reason=reason)  # fmt: skip
    except (PlanError, PartitionError):
        return None  # e.g. a --pp-layer-partition for another layer count


def read_generation_config(directory: str | None) -> tuple[dict | None, str | None]:
    """--generation-config DIR's generation_config.json, or why it cannot be read."""
    if not directory:
        return None, None
    try:
        return read_generation_config_dir(directory), None
    except ModelFactsError as exc:
        return None, str(exc)


def assess(
    facts: HostFacts,
    options: PlanOptions,
    profile_name: str | None,
    model: ModelFacts | None = None,
    facts_source: str | None = None,
    vllm_env: VllmEnvFacts | None = None,
    patch_series: tuple[tuple[str, str], ...] | None = None,
    build_env: str | None = None,
    api_key_set: bool | None = None,
) -> Assessment:
    """`model`: facts already read from options.model_dir (tests reuse one read);
    `facts_source`: the facts file replayed (--facts), named in findings;
    `vllm_env`: the vLLM serve would start (None: not judged), with this checkout's
    `patch_series` and the `build_env` command (None outside a checkout);
    `api_key_set`: whether the server will demand an API key (None: not asked)."""
    profile, reason = select_profile(facts, profile_name)
    profile = with_mtp(profile, options.mtp)
    model_error, model_missing, model_error_fix = None, False, None
    if model is None:
        model, model_error, model_missing, model_error_fix = _read_model(options.model_dir)
    the_plan, plan_error = None, None
    table_shape = table_shape_error = None
    if model is None:
        plan_error = f"no model facts ({model_error})"
    else:
        try:
            the_plan = plan(facts, model, profile, options, profile_reason=reason)
        except (PlanError, PartitionError) as exc:  # anything else is a bug: let it raise
            plan_error = str(exc)
        try:
            table_shape = ple_table_shape(model.text_config)
        except (ValueError, AttributeError) as exc:  # ConfigValueError names the key
            table_shape_error = f"{Path(model.path) / CONFIG_FILE}: {exc}"
    host_plan = the_plan or reference_plan(facts, profile, options, reason)
    generation_config, generation_config_error = read_generation_config(
        options.generation_config_dir
    )
    findings = preflight(
        PreflightInput(
            facts=facts,
            profile=profile,
            plan=the_plan,
            plan_error=plan_error,
            model=model,
            model_error=model_error,
            model_dir=options.model_dir,
            table_path=options.table_path,
            table_shape=table_shape,
            port=options.port,
            host=options.host,
            facts_source=facts_source,
            generation_config_dir=options.generation_config_dir,
            generation_config=generation_config,
            generation_config_error=generation_config_error,
            table_shape_error=table_shape_error,
            model_missing=model_missing,
            model_error_fix=model_error_fix,
            host_plan=host_plan,
            vllm_env=vllm_env,
            patch_series=patch_series,
            build_env=build_env,
            api_key_set=api_key_set,
        )
    )
    command = serve_command(the_plan, profile, options) if the_plan else None
    return Assessment(
        facts, profile, reason, model, model_error, the_plan, plan_error, findings, vllm_env,
        command,
    )  # fmt: skip
