"""Preflight: pure checks over facts, each a Finding with the fix in one sentence.

A check never touches the host. It reads HostFacts (probed or replayed from a
file), ModelFacts (or the error reading them), the profile and the plan, and
returns findings: id, level (ok/warn/fail), what was measured, what is
required, a message citing the fact, and a fix you can paste.

Each domain's checks live in its own module; CHECKS below is the one registry and
orders the findings. A new check goes into its domain's module and, if it is a new
entry point, into CHECKS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from flashnext.checks import gpu, host, model, mtp, port, rank_fit, table, vllm_env
from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput

Check = Callable[[PreflightInput], Iterator[Finding]]

# The order findings are reported in: the hardware, what the plan needs of it (MTP's
# fit right after the ranks'), then the model, the table, the vLLM env and the port.
CHECKS: tuple[Check, ...] = (
    gpu.gpus,
    host.host_memory,
    rank_fit.plan_fits,
    mtp.mtp_fit,
    model.model,
    table.table,
    vllm_env.vllm_env,
    port.port,
    port.exposure,
)


def preflight(inp: PreflightInput) -> list[Finding]:
    return [finding for fn in CHECKS for finding in fn(inp)]
