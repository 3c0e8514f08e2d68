"""What every preflight check reads (PreflightInput), and the helpers the domains share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashnext.checks.finding import Finding
from flashnext.facts.schema import HostFacts, ModelFacts, VllmEnvFacts
from flashnext.plan.planner import Plan
from flashnext.profiles import Profile


@dataclass(frozen=True)
class PreflightInput:
    facts: HostFacts
    profile: Profile
    plan: Plan | None
    plan_error: str | None
    model: ModelFacts | None
    model_error: str | None
    model_dir: str | None
    table_path: str | None
    table_shape: tuple[int, int] | None
    """(rows, cols) of the PLE table the model config implies; None without a model."""
    port: int
    host: str
    facts_source: str | None = None
    """The facts file replayed with --facts; None when the facts were probed here."""
    generation_config_dir: str | None = None
    """--generation-config DIR: vLLM takes its sampling defaults from there instead."""
    generation_config: dict[str, Any] | None = None
    """DIR/generation_config.json, when it could be read."""
    generation_config_error: str | None = None
    """Why DIR/generation_config.json could not be read."""
    table_shape_error: str | None = None
    """Why config.json implies no table shape (table_shape is then None)."""
    model_missing: bool = False
    """model_dir does not exist (a wrong path, or not downloaded yet)."""
    model_error_fix: str | None = None
    """The fix of model_error where the reader says it (a file this user may not read
    wants access, not a download; model_error ends with it); None: re-download the
    missing or damaged files."""
    host_plan: Plan | None = None
    """The plan host memory is judged by: `plan`, else the plan for the profile's own
    checkpoint inventory (no checkpoint read); None: neither."""
    vllm_env: VllmEnvFacts | None = None
    """The vLLM serve would start; None: not asked (`plan`, pure tests)."""
    patch_series: tuple[tuple[str, str], ...] | None = None
    """(name, sha256) of each patch in this checkout's series; None outside a checkout."""
    build_env: str | None = None
    """The command that builds the pinned env from here (`pins/build-env`); None
    outside a checkout (the Nix app and the image carry their env)."""
    api_key_set: bool | None = None
    """Whether the server will demand an API key (--api-key-file or VLLM_API_KEY);
    None: not asked (`plan`, pure tests)."""


def _ok(id_: str, measured: str, required: str, message: str, **values: int | None) -> Finding:
    return Finding(id_, "ok", measured, required, message, **values)


_RECORD_FACTS = "to replay facts, record them there with `flashnext facts --out FILE`"


def _facts_lack(inp: PreflightInput, what: str) -> str:
    if inp.facts_source:
        return f"{inp.facts_source} does not record {what}"
    return f"the facts do not record {what}"
