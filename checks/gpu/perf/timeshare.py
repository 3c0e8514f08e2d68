"""What three ranks on one GPU do to each other's kernel times (pure, stdlib).

Without MPS a GPU runs kernels of one process (CUDA context) at a time and
time-slices between processes that have work queued. Under the PP=3
emulation the waiting ranks do have work queued: an NCCL kernel spins on
the GPU until its peer's data arrives (p1's rank 0 broadcast kernel ran 32
ms of a 38 ms step). So a rank's kernels can share the card with another
rank's spinning kernel, and the profiler's durations may count the other
process's slices; three 3090s would not.

`sharing` takes each rank's kernel intervals from one profiled window (the
profiler's absolute timestamps, one host clock for every process) and says,
per rank, how long its compute kernels were in flight (`busy`), how much of
that no other rank had a kernel in flight (`alone`), and the fair-share
time: each instant of its busy time divided by the number of ranks with a
kernel in flight then (`fair`). `fair` is what the rank would take alone if
the GPU gave every rank with work an equal share; whether it does is what
`shared_gpu_calibration.py` measures on the card, and the contract uses
`fair` only where that calibration held.

A rank's own NCCL kernels are not its compute (they are the pipeline's
wait), but they make it a process with work on the card for the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernels:
    """One rank's kernels in a window: absolute start and end (ns), NCCL or not."""

    starts_ns: list[int]
    ends_ns: list[int]
    nccl: list[bool]

    def __post_init__(self) -> None:
        if not len(self.starts_ns) == len(self.ends_ns) == len(self.nccl):
            raise ValueError("starts_ns, ends_ns and nccl must have one entry per kernel")


def common_window(ranks: dict[int, Kernels]) -> tuple[int, int] | None:
    """The span every rank's profile covers: from the latest first kernel to the
    earliest last one (each rank starts its profiler at its own first decode
    step, rank 0 before the others)."""
    spans = [(min(k.starts_ns), max(k.ends_ns)) for k in ranks.values() if k.starts_ns]
    if len(spans) < len(ranks):
        return None
    lo, hi = max(s for s, _ in spans), min(e for _, e in spans)
    return (lo, hi) if hi > lo else None


def sharing(
    ranks: dict[int, Kernels], window: tuple[int, int] | None = None
) -> dict[int, dict[str, float]]:
    """Per rank, in ms over the window (default: all the intervals): busy,
    alone, fair, and shared_fraction (1 - alone / busy; None without compute
    kernels). Intervals are clipped to the window."""
    lo, hi = window or (-(2**63), 2**63)
    # Sweep every kernel boundary in time order; at equal times ends come first,
    # so back-to-back kernels on one rank do not count as two in flight.
    events = []
    for rank, k in ranks.items():
        for start, end, comm in zip(k.starts_ns, k.ends_ns, k.nccl, strict=True):
            start, end = max(start, lo), min(end, hi)
            if end > start:
                events.append((start, 1, rank, comm))
                events.append((end, -1, rank, comm))
    events.sort(key=lambda e: (e[0], e[1]))
    in_flight = dict.fromkeys(ranks, 0)  # any kernel, NCCL's included
    computing = dict.fromkeys(ranks, 0)  # compute kernels only
    busy = dict.fromkeys(ranks, 0.0)
    alone = dict.fromkeys(ranks, 0.0)
    fair = dict.fromkeys(ranks, 0.0)
    previous = None
    for time_ns, delta, rank, comm in events:
        if previous is not None and time_ns > previous:
            span = time_ns - previous
            active = sum(1 for n in in_flight.values() if n > 0)
            for r, n in computing.items():
                if n > 0:
                    busy[r] += span
                    fair[r] += span / active
                    if active == 1:
                        alone[r] += span
        previous = time_ns
        in_flight[rank] += delta
        if not comm:
            computing[rank] += delta
    return {
        r: {
            "busy_ms": busy[r] / 1e6,
            "alone_ms": alone[r] / 1e6,
            "fair_ms": fair[r] / 1e6,
            "shared_fraction": 1.0 - alone[r] / busy[r] if busy[r] else None,
        }
        for r in ranks
    }


def kernels_of(prof, nccl_prefix: str = "ncclDevKernel") -> Kernels:
    """The GPU activity of a stopped torch.profiler.profile: every device event
    but the GPU-side user annotations (which span kernels already counted),
    with Kineto's absolute timestamps (the host's clock, as the CPU events)."""
    starts, ends, nccl = [], [], []
    for evt in prof.profiler.kineto_results.events():
        if not str(evt.device_type()).endswith("CUDA"):
            continue
        if getattr(evt, "is_user_annotation", lambda: False)():
            continue
        if evt.end_ns() <= evt.start_ns():
            continue
        starts.append(int(evt.start_ns()))
        ends.append(int(evt.end_ns()))
        nccl.append(evt.name().startswith(nccl_prefix))
    return Kernels(starts, ends, nccl)


def attach_sharing(profiles: list[dict]) -> list[dict]:
    """The ranks' profiles of one window (step_probe.profile_end), each with
    its `kernels` replaced by `time_sharing`.

    `sharing` runs over the span all ranks profiled (`common_window`), and its
    shares scale the rank's own compute time a decode step
    (`compute_ms_per_step`): busy as the profiler has it, alone and fair as
    that time's shares. A profile without kernels gets none."""
    kernels = {p["rank"]: Kernels(**p["kernels"]) for p in profiles if "kernels" in p}
    window = common_window(kernels) if len(kernels) > 1 else None
    shared = sharing(kernels, window) if window else {}
    out = []
    for p in profiles:
        p = {k: v for k, v in p.items() if k != "kernels"}
        s = shared.get(p["rank"])
        compute = p.get("compute_ms_per_step")
        if s and s["busy_ms"] and compute is not None:
            p["time_sharing"] = {
                "busy_ms_per_step": compute,
                "alone_ms_per_step": compute * s["alone_ms"] / s["busy_ms"],
                "fair_ms_per_step": compute * s["fair_ms"] / s["busy_ms"],
                "shared_fraction": s["shared_fraction"],
                "window_ms": (window[1] - window[0]) / 1e6,
                "ranks": len(kernels),
            }
        out.append(p)
    return out
