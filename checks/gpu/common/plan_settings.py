"""A flashnext plan's engine settings, for harnesses that start vLLM in-process.

`flashnext plan --json` holds the exact `vllm serve` argv and environment of
a profile. A harness that builds `LLM(...)` itself takes its arguments from
there, parsed by vLLM 0.33.0's own `vllm serve` parser: when a profile
changes, the harness follows. What a harness must differ in (eager instead
of graphs, PP=1 for a reference, the executor for the one-GPU emulation) is
overridden by name and returned, so results record it. A harness that
starts `vllm serve`'s argv itself (rank-fit) applies its overrides to the argv
here too (`argv_with_overrides`).

`engine_settings` and `llm_kwargs` run under a vLLM python (they import
vLLM's parser); the rest is stdlib, for the harnesses' orchestrators.

    python checks/gpu/common/plan_settings.py PLAN.json [NAME=JSON ...]  # prints the settings
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

# Flags of the patched tree that stock vLLM's parser rejects: stock's EngramConfig
# has no mmap_path (patch 0012). Overridden to None, they leave the argv before parsing.
PATCHED_ONLY_FLAGS = {"engram_config": "--engram-config"}

# The plan's QSA offload variables (patch 0022): an engine that keeps K/V in VRAM drops them.
QSA_OFFLOAD_ENV = (
    "VLLM_QSA_KV_OFFLOAD",
    "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS",
    "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES",
)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` in argv (None: absent)."""
    return argv[argv.index(flag) + 1] if flag in argv else None


def plan_table(plan: dict[str, Any]) -> str | None:
    """The PLE table file the plan's `--engram-config` names."""
    engram = flag_value(list(plan["argv"]), "--engram-config")
    return None if engram is None else json.loads(engram).get("mmap_path")


def mtp_compilation(plan: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
    """The plan's compilation config with the decode graphs K draft tokens need,
    as the launcher's MTP plan has them (flashnext.plan.decode_graphs), for an
    engine that turns MTP on in a plan made without it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launcher" / "src"))
    from flashnext.plan.decode_graphs import decode_capture_sizes

    compilation = json.loads(flag_value(list(plan["argv"]), "--compilation-config") or "{}")
    sizes = decode_capture_sizes(compilation["cudagraph_capture_sizes"], num_speculative_tokens)
    return compilation | {"cudagraph_capture_sizes": sizes}


def without_flag(argv: list[str], flag: str) -> list[str]:
    """argv less `flag VALUE`."""
    if flag not in argv:
        return argv
    at = argv.index(flag)
    return argv[:at] + argv[at + 2 :]


def plan_env(plan: dict[str, Any], *, offload: bool) -> tuple[dict[str, str], list[str]]:
    """The plan's environment for an engine, and the plan's variables it drops: an
    engine with QSA K/V in VRAM (offload False) drops the offload variables."""
    dropped = [] if offload else [k for k in QSA_OFFLOAD_ENV if k in plan["env"]]
    return {k: v for k, v in plan["env"].items() if k not in dropped}, dropped


def argv_with_overrides(argv: list[str], overrides: dict[str, Any]) -> list[str]:
    """`vllm serve`'s own arguments (the model first) with overrides by EngineArgs
    name: "model" replaces the positional; None drops the flag and its value; True
    is a bare flag; other values replace the flag's value in place, or are appended
    (dicts and lists as JSON)."""
    out = list(argv)
    for name, value in overrides.items():
        if name == "model":
            out[0] = str(value)
            continue
        flag = "--" + name.replace("_", "-")
        if value is None:
            out = without_flag(out, flag)
        elif value is False:
            raise ValueError(f"override {name}=False: name its --no- flag in the plan instead")
        elif value is True:
            out += [] if flag in out else [flag]
        else:
            text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
            if flag in out:
                out[out.index(flag) + 1] = text
            else:
                out += [flag, text]
    return out


def llm_kwargs(argv: list[str]) -> dict[str, Any]:
    """LLM(...) keyword arguments that differ from vLLM's defaults for this argv."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:2] != ["vllm", "serve"] and not argv[0].endswith("vllm"):
        raise ValueError(f"not a `vllm serve` command: {argv[:3]}")
    ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv[2:])
    ns.model = ns.model_tag  # `vllm serve MODEL` takes the model as a positional
    engine = EngineArgs.from_cli_args(ns)
    default = EngineArgs(model=engine.model)
    kwargs = {"model": engine.model}
    for field in dataclasses.fields(EngineArgs):
        value = getattr(engine, field.name)
        # None and "" are the serve parser's own "unset", not settings of the plan.
        if value in (None, "") or value == getattr(default, field.name):
            continue
        kwargs[field.name] = value
    kwargs.pop("served_model_name", None)  # the API server's name, not the engine's
    return kwargs


def engine_settings(
    plan: dict[str, Any], overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, str], dict[str, Any]]:
    """(LLM kwargs, environment, the overrides applied) of a plan.

    An override whose value is None removes the setting (e.g. the compilation
    config of an eager run); a patched-only flag so removed leaves the argv
    before parsing, so stock's parser never sees it. The environment is the
    plan's, exactly. Only overrides that change something are applied and
    returned: one that restates the plan is no difference to record.
    """
    argv, applied = list(plan["argv"]), {}
    overrides = dict(overrides or {})
    for name, flag in PATCHED_ONLY_FLAGS.items():
        if name in overrides and overrides[name] is None:
            del overrides[name]
            if flag in argv:
                argv, applied[name] = without_flag(argv, flag), None
    kwargs = llm_kwargs(argv)
    for name, value in overrides.items():
        if name not in {f.name for f in dataclasses.fields(_engine_args())}:
            raise ValueError(f"override {name!r} is not an EngineArgs field")
        if kwargs.get(name) == value:
            continue
        applied[name] = value
        if value is None:
            kwargs.pop(name, None)
        else:
            kwargs[name] = value
    return kwargs, dict(plan["env"]), applied


def _engine_args():
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs


def _printable(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {k: str(v) for k, v in dataclasses.asdict(value).items() if v not in (None, "")}
    return value


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    overrides = {k: json.loads(v) for k, v in (a.split("=", 1) for a in argv[1:])}
    kwargs, env, applied = engine_settings(plan, overrides)
    out = {"kwargs": {k: _printable(v) for k, v in kwargs.items()}, "env": env}
    print(json.dumps(out | {"overrides": applied}, indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
