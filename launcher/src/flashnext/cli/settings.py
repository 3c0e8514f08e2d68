"""Every option more than one command takes, declared once: flag, the parameter it
fills, help, environment variable and default. Commands take them by name
(`@options("model_dir", "as_json")`); a command may say `required` for itself.
Defaults the planner also uses come from PlanOptions, where they are documented.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from flashnext.plan.options import (
    MAX_KV_CACHE_BYTES,
    MAX_LAYERS_PER_RANK,
    MAX_MODEL_LEN,
    MAX_MTP_TOKENS,
    PlanOptions,
)


def _known_profile(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from flashnext.profiles import ProfileError, check_profile_name

    try:
        return check_profile_name(value)
    except ProfileError as exc:
        raise click.BadParameter(str(exc)) from None  # a usage error: exit 2


def _layer_counts(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """VLLM_PP_LAYER_PARTITION's form (their count and sum are the planner's: they depend
    on the profile and the model); a usage error naming the option."""
    if value is None:
        return None
    parts = value.split(",")
    if not all(p.strip().isdigit() and 1 <= int(p) <= MAX_LAYERS_PER_RANK for p in parts):
        raise click.BadParameter(
            f"{value!r}: expected layer counts per rank, comma-separated, each 1 to "
            f"{MAX_LAYERS_PER_RANK}, e.g. 16,16,16"
        )
    return value


@dataclass(frozen=True)
class Setting:
    flag: str
    dest: str
    help: str
    envvar: str | None = None
    default: Any = None
    type: Any = None
    is_flag: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def option(self, **override: Any) -> Callable:
        kw: dict[str, Any] = {"help": self.help, **self.extra}
        if self.envvar:
            kw.update(envvar=self.envvar, show_envvar=True)
        if self.is_flag:
            kw["is_flag"] = True
        elif self.default is not None:
            kw.update(default=self.default, show_default=True)
        if self.type is not None:
            kw["type"] = self.type
        kw.update(override)
        return click.option(self.flag, self.dest, **kw)


_DECLARED = (
    Setting("--facts", "facts_file", "Replay facts recorded with `flashnext facts --json` "
            "instead of probing this host.", "FLASHNEXT_FACTS",
            type=click.Path(exists=True, dir_okay=False)),
    Setting("--model", "model_dir", "The checkpoint directory (config.json, "
            "generation_config.json, *.safetensors).", "FLASHNEXT_MODEL",
            type=click.Path(file_okay=False)),
    Setting("--table", "table_path", "The PLE table flat file on NVMe (`flashnext table "
            "prepare` writes it).", "FLASHNEXT_TABLE", type=click.Path(dir_okay=False)),
    Setting("--profile", "profile_name", "Hardware profile; default: the one matching the "
            "GPUs (test profiles are chosen by name only), else 3x3090.", "FLASHNEXT_PROFILE",
            extra={"callback": _known_profile}),
    Setting("--host", "host", "Address the API binds; loopback unless you mean to expose it.",
            "FLASHNEXT_HOST", default=PlanOptions.host),
    Setting("--port", "port", "API port.", "FLASHNEXT_PORT", default=PlanOptions.port,
            type=click.IntRange(1, 65535)),
    Setting("--served-model-name", "served_model_name", "Model name clients send.",
            default=PlanOptions.served_model_name),
    Setting("--kv-cache-memory-bytes", "kv_cache_memory_bytes", "VRAM per card for the KV "
            "cache; default: derived for the tightest rank and the host pools.",
            type=click.IntRange(1, MAX_KV_CACHE_BYTES)),
    Setting("--max-model-len", "max_model_len", "Context length; default: the profile's, "
            "at most the model's own (config.json).",
            type=click.IntRange(1, MAX_MODEL_LEN)),
    Setting("--pp-layer-partition", "pp_layer_partition", "Layers per PP rank, e.g. 16,16,16 "
            "(vLLM's own variable).", "VLLM_PP_LAYER_PARTITION",
            extra={"callback": _layer_counts}),
    Setting("--generation-config", "generation_config_dir", "Directory whose "
            "generation_config.json supplies sampling defaults.",
            type=click.Path(file_okay=False)),
    Setting("--mtp", "mtp", "Speculative decoding with the checkpoint's MTP layer: N draft "
            "tokens per step, 0 for none; default: the profile's [mtp] (off on 3x3090).",
            "FLASHNEXT_MTP", type=click.IntRange(0, MAX_MTP_TOKENS)),
    Setting("--json", "as_json", "Print canonical JSON instead of tables.", is_flag=True),
    Setting("--vllm-env", "vllm_env_dir", "The vLLM env to judge and run: the dir "
            "`pins/build-env` prints (its venv/bin/vllm). Default: `vllm` on PATH, else this "
            "checkout's pinned env (serve builds it if missing).", "FLASHNEXT_VLLM_ENV",
            type=click.Path(file_okay=False)),
    Setting("--replay-facts-for-testing", "replay_facts_for_testing", "TESTING ONLY: judge "
            "facts recorded with `flashnext facts --json` instead of this host (e.g. a 3-GPU "
            "host emulated on one GPU). serve prints a banner and records the file; --facts "
            "is refused by serve.", "FLASHNEXT_TEST_REPLAY_FACTS",
            type=click.Path(exists=True, dir_okay=False)),
    Setting("--api-key-file", "api_key_file", "File holding the API key (else VLLM_API_KEY).",
            type=click.Path(exists=True, dir_okay=False)),
)  # fmt: skip
SETTINGS: dict[str, Setting] = {s.dest: s for s in _DECLARED}

# What preflight, plan, serve and report share: the inputs of a plan.
PLAN_SETTINGS = ("facts_file", "model_dir", "table_path", "profile_name", "host", "port",
                 "served_model_name", "kv_cache_memory_bytes", "max_model_len",
                 "pp_layer_partition", "generation_config_dir", "mtp", "as_json")  # fmt: skip


def options(*dests: str, **overrides: dict[str, Any]) -> Callable:
    """Decorator adding the named settings as options, in this order;
    `overrides[dest]` changes one command's use (e.g. {"required": True})."""

    def apply(fn: Callable) -> Callable:
        for dest in reversed(dests):
            fn = SETTINGS[dest].option(**overrides.get(dest, {}))(fn)
        return fn

    return apply


def plan_options(kw: dict[str, Any]) -> PlanOptions:
    """PlanOptions from a command's parsed settings; a value out of its bounds is a
    usage error (exit 2) naming the option, never a traceback."""
    from pydantic import ValidationError

    try:
        return PlanOptions(**{f: kw[f] for f in PlanOptions.__dataclass_fields__})
    except ValidationError as exc:
        first = exc.errors()[0]
        dest = str(first["loc"][0]) if first.get("loc") else "?"
        flag = SETTINGS[dest].flag if dest in SETTINGS else "--" + dest.replace("_", "-")
        raise click.BadParameter(first["msg"], param_hint=f"'{flag}'") from None
