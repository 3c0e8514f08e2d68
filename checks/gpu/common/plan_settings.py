"""A flashnext plan's engine settings, for harnesses that start vLLM in-process.

`flashnext plan --json` holds the exact `vllm serve` argv and environment of
a profile. A harness that builds `LLM(...)` itself takes its arguments from
there, parsed by vLLM 0.33.0's own `vllm serve` parser: when a profile
changes, the harness follows. What a harness must differ in (eager instead
of graphs, PP=1 for a reference, the executor for the one-GPU emulation) is
overridden by name and returned, so results record it.

Runs under the pinned vLLM env's python (it imports vLLM).

    python checks/gpu/common/plan_settings.py PLAN.json [NAME=JSON ...]  # prints the settings
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


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
    config of an eager run); the environment is the plan's, exactly. Only
    overrides that change something are applied and returned: one that
    restates the plan is no difference to record.
    """
    kwargs = llm_kwargs(list(plan["argv"]))
    applied: dict[str, Any] = {}
    for name, value in (overrides or {}).items():
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
