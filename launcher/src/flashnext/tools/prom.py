"""vLLM's /metrics (Prometheus text format): the counters and gauges soak follows.

Names are vLLM 0.33.0's (v1/metrics/loggers.py); prometheus_client exposes a
counter `x` as `x_total`. Samples of several engines are summed.
"""

from __future__ import annotations

import re

# vLLM's FinishReason strings (v1/engine/__init__.py FINISH_REASON_STRINGS).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

SUCCESS = "vllm:request_success_total"
GAUGES = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
}
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
}

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[str, float]:
    """The followed series: gauges and counters by key, and `success_<reason>` for
    request_success_total by finished_reason; a series the server lacks is absent."""
    wanted = {name: key for key, name in {**GAUGES, **COUNTERS}.items()}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name = m[1]
        if name == SUCCESS:
            labels = dict(_LABEL.findall(m[2] or ""))
            key = f"success_{labels.get('finished_reason', '?')}"
        elif name in wanted:
            key = wanted[name]
        else:
            continue
        try:
            value = float(m[3])
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter growth between two reads (gauges left out)."""
    keys = [k for k in after if k not in GAUGES]
    return {k: after[k] - before.get(k, 0.0) for k in sorted(keys)}
