"""Did the server's memory grow? A judge over the samples the soak records (pure).

Two levels per quantity, each the median (median_low: a value that was measured)
of the samples in a window, so one sample caught mid-allocation does not decide:

- **after warm-up**: the samples of the soak's second interval,
  [interval, 2 x interval). The first interval is the warm-up: the first requests
  of each kind fill the tokenizer's and detokenizer's caches, Python's and glibc's
  arenas and the torch allocator's segments for shapes the startup profile missed.
- **after idle**: the samples of the second half of the idle stretch that follows
  the soak (`--soak-idle`), when no request is in flight and aborted ones are freed;
  with no idle stretch, the samples taken once the soak ended.

The level after warm-up is taken under load, so it holds the in-flight working set;
the level after idle holds none. Growth is therefore judged one-sided: after idle
above after warm-up by more than the bound. A drop is never growth.

The bounds are design bounds, not measurements: they follow from how each quantity
is allocated and must be checked against the first GPU soak (checks/gpu/soak).

- **rss** (the server's process tree, psutil): 256 MiB + 5 % of the warm level.
  Freed memory does not all go back to the OS: glibc keeps each thread arena's
  high-water mark until a trim (one arena per thread, up to 8 x cores of them) and
  CPython frees an obmalloc arena only when every object in it is gone, so a
  fragmented heap stays resident without a leak. The API server and the engine each
  run a few dozen threads; 256 MiB covers a few MiB of kept heap per arena, and 5 %
  the caches that scale with the process (the tokenizer's, the detokenizer's).
  A leak of 10 KiB per request passes it after ~26 000 requests: a soak of hours
  catches such a leak, one of minutes catches a leak of ~1 MiB per request.
- **pinned** (VmPin plus the QSA pools' mappings, summed over the tree:
  facts/server_usage.py): exactly equal. The QSA host pools are
  sized by the plan and pinned once at startup; nothing pins per request. Any pinned
  byte more after idle is a new pin that was not released: growth.
- **gpu** (NVML: the memory it attributes to the server's processes, where it sees
  their pids; else the used memory of all GPUs): 128 MiB. vLLM allocates its KV cache
  once (--gpu-memory-utilization) and captures its CUDA graphs at startup; the torch
  caching allocator keeps what it reserved, so only a shape the startup profile did
  not see adds a segment (large ones are rounded up to 2 MiB, small pools are 2 MiB
  each). 128 MiB leaves room for a few such segments and the driver's own growth.
  Read per process, another process on the GPU does not count; read for the whole
  device (NVML without the pids, as in some containers), it does: then run the soak
  on a GPU of its own.

A quantity is `unknown` when either level has no sample (not sampled here, NVML
absent, the server not on this host): the reason says why.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MIB = 1 << 20

FIELDS = {"rss": "rss_bytes", "pinned": "pinned_bytes", "gpu": "gpu_used_bytes"}


def gpu_field(samples: list[dict[str, Any]]) -> str:
    """The server's own GPU memory (`gpu_tree_bytes`) when NVML attributed some to its
    processes in every sample that read the GPU; else the whole devices' use."""
    read = [s for s in samples if s.get("gpu_used_bytes") is not None]
    if read and all(s.get("gpu_tree_bytes") is not None for s in read):
        return "gpu_tree_bytes"
    return "gpu_used_bytes"


def fields(samples: list[dict[str, Any]]) -> dict[str, str]:
    return {**FIELDS, "gpu": gpu_field(samples)}


@dataclass(frozen=True)
class Bound:
    slack_bytes: int
    share: float
    """Allowed growth: slack_bytes + share x the level after warm-up."""

    def of(self, warm: int) -> int:
        return self.slack_bytes + int(self.share * warm)

    def text(self) -> str:
        parts = [f"{self.slack_bytes // MIB} MiB"] if self.slack_bytes else []
        if self.share:
            parts.append(f"{self.share:.0%} of the level after warm-up")
        return " + ".join(parts) or "none (must be equal)"


BOUNDS = {
    "rss": Bound(256 * MIB, 0.05),
    "pinned": Bound(0, 0.0),
    "gpu": Bound(128 * MIB, 0.0),
}


def level(samples: list[dict[str, Any]], field: str, t_from: float, t_to: float) -> int | None:
    """The median of `field` over samples with t_from <= t_s < t_to; None if none."""
    values = [s[field] for s in samples if t_from <= s["t_s"] < t_to and s.get(field) is not None]
    return statistics.median_low(values) if values else None


def windows(
    interval_s: float, soak_end_s: float, idle_from_s: float, idle_s: float
) -> dict[str, list[float]]:
    """[from, to) in soak time of the two levels (see the module's docstring)."""
    warm = [interval_s, min(2 * interval_s, soak_end_s)]
    after = [idle_from_s + idle_s / 2, float("inf")]
    return {"after_warmup": warm, "after_idle": after}


def judge(
    samples: list[dict[str, Any]],
    interval_s: float,
    soak_end_s: float,
    idle_from_s: float,
    idle_s: float,
    bounds: dict[str, Bound] = BOUNDS,
) -> dict[str, Any]:
    """{quantity: {after_warmup, after_idle, grew_by, bound, bound_rule, verdict, why}}
    with verdict ok, grew or unknown, and the windows used."""
    win = windows(interval_s, soak_end_s, idle_from_s, idle_s)
    out: dict[str, Any] = {}
    for key, field in fields(samples).items():
        warm = level(samples, field, *win["after_warmup"])
        after = level(samples, field, *win["after_idle"])
        row: dict[str, Any] = {
            "after_warmup": warm,
            "after_idle": after,
            "grew_by": None,
            "bound": None,
            "bound_rule": bounds[key].text(),
            "field": field,
        }
        if warm is None or after is None:
            row["verdict"] = "unknown"
            row["why"] = _why_unknown(samples, key, warm is None)
        else:
            row["grew_by"] = after - warm
            row["bound"] = bounds[key].of(warm)
            grew = after - warm > row["bound"]
            row["verdict"] = "grew" if grew else "ok"
            row["why"] = (
                f"{after - warm:+d} bytes after idle against after warm-up, "
                f"{'over' if grew else 'within'} the bound of {row['bound']}"
            )
        out[key] = row
    out["windows_s"] = {
        k: [round(a, 3), None if b == float("inf") else round(b, 3)] for k, (a, b) in win.items()
    }
    out["idle_s"] = idle_s
    return out


def _why_unknown(samples: list[dict[str, Any]], key: str, warm_missing: bool) -> str:
    reasons = [s.get("unavailable", {}).get(key) for s in samples]
    reason = next((r for r in reasons if r), None)
    if reason:
        return f"not measurable: {reason}"
    if warm_missing:
        return "no sample after warm-up: soak longer than two --soak-interval"
    return "no sample after the idle stretch"


def any_grew(verdict: dict[str, Any]) -> bool:
    return any(verdict[k]["verdict"] == "grew" for k in FIELDS)
