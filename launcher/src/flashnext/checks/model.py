"""The checkpoint: present and readable, its architecture, its quantization groups,
and the sampling defaults vLLM will take (its own or --generation-config's)."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

from flashnext.checks.checkpoint_metadata import QUANT_METHOD, quant_method_problem
from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _ok
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
    sampling_value_problems,
)
from flashnext.facts.scheme_map import SchemeMap

EXPECTED_ARCH = "qwen4_exp"


def model(inp: PreflightInput) -> Iterator[Finding]:
    if not inp.model_dir:
        yield Finding(
            "model.dir",
            "fail",
            "not given",
            "a checkpoint directory",
            "no model directory was given",
            "pass --model DIR (or `flashnext skeleton DIR` to plan before downloading)",
        )
        return
    if inp.model is None and inp.model_missing:
        repo = inp.profile.checkpoint.hub_repo
        where = shlex.quote(inp.model_dir)
        get = f"; to download it there: `hf download {repo} --local-dir {where}`"
        yield Finding(
            "model.dir",
            "fail",
            "no such directory",
            "a complete checkpoint",
            inp.model_error or f"{inp.model_dir}: no such directory",
            "check the path: --model is the checkpoint directory (config.json, *.safetensors)"
            + (get if repo else ""),
        )
        return
    if inp.model is None:
        fix = inp.model_error_fix
        # The reader's message ends with its fix; the finding says it once, as the fix.
        error = inp.model_error.removesuffix(f"; {fix}") if inp.model_error and fix else None
        yield Finding(
            "model.dir",
            "fail",
            error or inp.model_error or "unreadable",
            "a complete checkpoint",
            error or inp.model_error or "the checkpoint could not be read",
            fix or "re-download the missing or damaged files (`hf download` resumes)",
        )
        return
    m = inp.model
    yield _ok(
        "model.dir",
        f"{len(m.shards)} shards, {len(m.tensors)} tensors",
        "a complete checkpoint",
        "all shards present, headers parse",
    )
    text_type = m.text_config.get("model_type", "")
    if m.model_type != EXPECTED_ARCH and not str(text_type).startswith(EXPECTED_ARCH):
        yield Finding(
            "model.arch",
            "fail",
            f"{m.model_type} {list(m.architectures)}",
            EXPECTED_ARCH,
            f"this kit serves {EXPECTED_ARCH} checkpoints only",
            "point --model at the Qwen3.8-Flash-Next checkpoint",
        )
    else:
        yield _ok("model.arch", str(m.model_type), EXPECTED_ARCH, "architecture")
    yield from _quant_groups(inp)
    yield from _sampling_keys(inp)


def _quant_groups(inp: PreflightInput) -> Iterator[Finding]:
    """The duplicate-target half of `checkpoint check`: vLLM's scheme map as
    SchemeMap builds it, without reading the stored modules (0.6 s of plan time)."""

    qcfg = inp.model.quantization_config or {}
    groups = qcfg.get("config_groups") or {}
    wrong_method = quant_method_problem(inp.model)
    shared = SchemeMap.from_config(qcfg).duplicates
    if wrong_method:
        yield Finding(
            "model.quant_groups",
            "fail",
            f"quant_method {qcfg.get('quant_method')!r}" if qcfg else "no quantization_config",
            QUANT_METHOD,
            wrong_method,
            "restore config.json from the published checkpoint",
        )
    elif shared:
        target, names = next(iter(sorted(shared.items())))
        yield Finding(
            "model.quant_groups",
            "fail",
            f"target {target!r} in groups {names}",
            "each target in one group",
            f"vLLM keys schemes by target, so only group {names[-1]!r} applies: the INT4 "
            "experts would be read with the wrong scheme",
            f"flashnext checkpoint fix --model {inp.model_dir}",
        )
    else:
        yield _ok(
            "model.quant_groups",
            f"{len(groups)} groups",
            "each target in one group",
            "quantization groups are unambiguous",
        )


def _sampling_keys(inp: PreflightInput) -> Iterator[Finding]:
    if inp.generation_config_dir:
        yield from _given_generation_config(inp)
        return
    refused = sampling_value_problems(inp.model.generation_config)
    if refused:
        fix = (f"flashnext checkpoint fix --model {inp.model_dir} --generation-config-from "
               "<dir of the original release>")  # fmt: skip
        yield _refused_sampling("generation_config.json", refused, fix)
        return
    present = sampling_keys_present(inp.model.generation_config)
    if present:
        yield _ok("model.sampling", ", ".join(present), "sampling keys", "defaults present")
        return
    neutral = sampling_keys_restoring_nothing(inp.model.generation_config)
    yield Finding(
        "model.sampling",
        "fail",
        f"only {neutral}" if neutral else "no sampling keys",
        ", ".join(VLLM_SAMPLING_KEYS[:4]) + ", ...",
        (
            f"generation_config.json sets only {neutral}, which restore nothing"
            if neutral
            else "generation_config.json has no sampling keys"
        )
        + ": vLLM falls back to temperature 1, top_p 1, top_k 0 over 248k tokens and output "
        "degrades",
        f"flashnext checkpoint fix --model {inp.model_dir} --generation-config-from "
        "<dir of the original release>",
    )


def _refused_sampling(source: str, refused: list[str], fix: str) -> Finding:
    """Sampling defaults vLLM refuses: every request relying on one would fail."""
    return Finding(
        "model.sampling",
        "fail",
        "; ".join(refused),
        "values vLLM accepts",
        f"{source}: {'; '.join(refused)}: vLLM refuses such a default, so every request that "
        "relies on it fails",
        fix,
    )


def _given_generation_config(inp: PreflightInput) -> Iterator[Finding]:
    """--generation-config DIR replaces the checkpoint's own: judge DIR's file."""
    given = inp.generation_config_dir
    required = ", ".join(VLLM_SAMPLING_KEYS[:4]) + ", ..."
    fix = (
        "pass --generation-config a directory holding the published generation_config.json "
        "(with temperature, top_p, top_k), or leave it out to use the checkpoint's own"
    )
    if inp.generation_config_error:
        yield Finding(
            "model.sampling",
            "fail",
            "unreadable",
            required,
            f"{inp.generation_config_error}: vLLM would serve without sampling defaults",
            fix,
        )
        return
    refused = sampling_value_problems(inp.generation_config)
    if refused:
        yield _refused_sampling(f"--generation-config {given}", refused, fix)
        return
    present = sampling_keys_present(inp.generation_config)
    if present:
        yield _ok(
            "model.sampling",
            ", ".join(present),
            "sampling keys",
            f"from --generation-config {given}",
        )
        return
    neutral = sampling_keys_restoring_nothing(inp.generation_config)
    yield Finding(
        "model.sampling",
        "fail",
        f"only {neutral}" if neutral else "no sampling keys",
        required,
        f"{Path(given) / 'generation_config.json'} sets "
        + (
            f"only {neutral}, which restore nothing"
            if neutral
            else f"none of {', '.join(VLLM_SAMPLING_KEYS)}"
        )
        + ": vLLM falls back to temperature 1, top_p 1, top_k 0 and output degrades",
        fix,
    )
