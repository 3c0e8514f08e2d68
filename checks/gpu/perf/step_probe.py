"""Where a step's time goes, on every rank: sent to each worker by
`LLM.collective_rpc` (perf_engine.py), the worker being `self`.

    install(self)            wrap the rank's step and its parts (once)
    window_begin(self, name) start a window of steps (clears the records)
    window_end(self)         resolve the CUDA events, return the window's summary
    profile_begin(self, settle)  arm torch.profiler (CPU and CUDA): it starts at
                             the first of `settle` decode steps in a row, so the
                             generate's prefill chunks stay out of it
    profile_end(self)        off: kernels' device time per decode step, top
                             kernels, host syncs, every kernel's interval
    memory(self, phase)      this process's memory peaks (onegpu_perf's sampler)

What is wrapped (Python only: inside a FULL_DECODE_ONLY graph nothing is,
so decode work is timed from outside):
- the worker's `execute_model` and `sample_tokens`: wall time (CPU, entry
  to return) and CUDA events on the current stream (the GPU span: from when
  the stream reaches the step to its end, so on ranks 1 and 2 it includes
  the wait for the previous rank's tensors);
- the PP group's `isend_tensor_dict` / `irecv_tensor_dict`: CPU time;
- the mapped PLE table's host gather (patch 0012's `HostRowGather`, called
  before forward by 0013): the whole `gather` call (`ple_gather`: it first
  waits for the step's ids from the GPU, on rank 0 at c=1 the whole
  pipeline's previous step, then selects, then copies to the device) and its
  `_select` alone (`ple_select`: the host row gather proper, where the
  mapping's page faults happen), each with wall time and bytes (rows x row
  bytes);
- the MTP drafter's `propose` (the V2 runner's `speculator`): wall time and
  CUDA events (the draft step's cost on the last rank);
- `torch.cuda.CUDAGraph.replay`: when the host launched the step's graph.
A step is a decode step when no request is new and none is scheduled more
than 1 + K tokens (K: speculative tokens).

Two figures per window are decode steps only: `decode_period_ms`, the wall
time per step over the trailing run of decode steps (the window's generate
starts with its prompt's prefill chunks: p1's "38.3 ms a step" had 6 of
them in 70 steps), and `host_critical_ms`, per decode step the host's time
from the end of its last wait for the step's input (rank 0: the PLE gather's
wait for the ids, where `_select` starts; later ranks: the PP receive's
return) to its graph launch: the host's share of the token's critical path.
On later ranks only where the GPU had nothing left to do at the launch
(`gpu_idle`: the stream's query() at the launch); else 0, the host having
prepared the step while the previous rank's GPU still computed. The whole
`execute_model` wall time counts those waits, the other ranks' work.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

_STATE: dict[str, Any] = {}


def _now() -> float:
    return time.perf_counter()


def _events():
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


def _step_shape(scheduler_output, spec_k: int) -> dict[str, Any]:
    per_req = dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
    new = len(getattr(scheduler_output, "scheduled_new_reqs", []) or [])
    tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", sum(per_req.values())))
    decode = tokens > 0 and new == 0 and all(n <= 1 + spec_k for n in per_req.values())
    return {"tokens": tokens, "reqs": len(per_req), "new_reqs": new, "decode": decode}


def _wrap_timed(owner, name: str, kind: str, events: bool, shape=None) -> None:
    inner = getattr(owner, name)

    def timed(*args, **kwargs):
        rec: dict[str, Any] = {"kind": kind}
        if shape is not None and args:
            rec.update(shape(args[0]))
        if kind == "execute_model" and rec.get("tokens"):
            _maybe_start_profile(rec["decode"])
        if events:
            rec["ev"] = _events()
        t0 = _now()
        try:
            return inner(*args, **kwargs)
        finally:
            t1 = _now()
            rec |= {"t0": t0, "t1": t1, "wall_us": (t1 - t0) * 1e6}
            if events:
                rec["ev"][1].record()
            profiled = _STATE.get("profiling") is not None and rec.get("tokens")
            if profiled and kind == "execute_model":
                _STATE["profiled_steps" if rec["decode"] else "profiled_other_steps"] += 1
            _STATE["records"].append(rec)

    setattr(owner, name, timed)


def install(self) -> dict[str, Any]:
    """Wrap this rank's step (idempotent). Returns what could be wrapped."""
    if _STATE.get("installed"):
        return _STATE["installed"]
    from vllm.distributed import get_pp_group

    _STATE.update(records=[], window=None, profiling=None, armed=None, profiled_steps=0,
                  profiled_other_steps=0)  # fmt: skip
    runner = self.model_runner
    spec = getattr(runner, "speculative_config", None) or getattr(
        self.vllm_config, "speculative_config", None
    )
    spec_k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    group = get_pp_group()
    wrapped = {"rank": group.rank_in_group, "pid": __import__("os").getpid(), "spec_k": spec_k}
    _wrap_timed(self, "execute_model", "execute_model", True, lambda so: _step_shape(so, spec_k))
    _wrap_timed(self, "sample_tokens", "sample_tokens", True)
    for name, kind in (("isend_tensor_dict", "pp_send"), ("irecv_tensor_dict", "pp_recv")):
        if hasattr(group, name):
            _wrap_timed(group, name, kind, False)
    wrapped["pp_group"] = True
    speculator = getattr(runner, "speculator", None)
    if speculator is not None and hasattr(speculator, "propose"):
        _wrap_timed(speculator, "propose", "mtp_propose", True)
        wrapped["mtp_propose"] = type(speculator).__name__
    wrapped.update(_wrap_ple_gather())
    wrapped["graph_replay"] = _wrap_graph_replay()
    _STATE["installed"] = wrapped
    return wrapped


def _row_bytes(rows: int, buffer) -> int:
    return int(rows) * buffer.shape[-1] * buffer.element_size()


def _wrap_ple_gather() -> dict[str, bool]:
    """Patch 0012's host gather of the mapped table (absent on stock or without PLE):
    `gather` whole (`ple_gather`) and its `_select` (`ple_select`), the host row
    gather without gather's wait for the step's ids and its copy to the device."""
    try:
        from vllm.models.qwen4_exp.common import ple_mmap
    except ImportError:
        return {"ple_gather": False, "ple_select": False}
    cls = getattr(ple_mmap, "HostRowGather", None)
    if cls is None or getattr(cls, "_perf_wrapped", False):
        return {"ple_gather": cls is not None, "ple_select": cls is not None}
    inner_gather, inner_select = cls.gather, cls._select

    def gather(gather_self, ids):
        t0 = _now()
        n = inner_gather(gather_self, ids)
        wall_us = (_now() - t0) * 1e6
        bytes_ = _row_bytes(n, gather_self.staging)
        _STATE["records"].append({"kind": "ple_gather", "wall_us": wall_us, "bytes": bytes_})
        return n

    def select(gather_self, ids, out):
        # t0: gather() has the step's ids on the host here (its wait is over)
        t0 = _now()
        inner_select(gather_self, ids, out)
        wall_us = (_now() - t0) * 1e6
        bytes_ = _row_bytes(ids.numel(), out)
        _STATE["records"].append({"kind": "ple_select", "t0": t0, "wall_us": wall_us,
                                  "bytes": bytes_})  # fmt: skip

    cls.gather, cls._select = gather, select
    cls._perf_wrapped = True
    return {"ple_gather": True, "ple_select": True}


def _wrap_graph_replay() -> bool:
    """When the host launches a captured graph (the V2 runner's FULL decode graphs)."""
    import torch

    cls = torch.cuda.CUDAGraph
    if getattr(cls, "_perf_wrapped", False):
        return True
    inner = cls.replay

    def replay(graph_self, *args, **kwargs):
        # gpu_idle: the stream had finished all it was given (on a later rank,
        # the wait for the previous rank's tensors included): the GPU waited
        # for this launch, so the host was on the critical path.
        idle = torch.cuda.current_stream().query()
        _STATE["records"].append({"kind": "graph_replay", "t0": _now(), "gpu_idle": idle})
        return inner(graph_self, *args, **kwargs)

    cls.replay = replay
    cls._perf_wrapped = True
    return True


def window_begin(self, name: str) -> None:
    import torch

    torch.cuda.synchronize()
    _STATE["records"] = []
    _STATE["window"] = {"name": name, "t0": _now()}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def window_end(self) -> dict[str, Any]:
    """The window's steps: counts, medians and sums, per kind of record."""
    import torch

    torch.cuda.synchronize()
    window = _STATE.get("window") or {"name": None, "t0": _now()}
    wall_s = _now() - window["t0"]
    records = _STATE["records"]
    for rec in records:
        ev = rec.pop("ev", None)
        if ev is not None:
            rec["gpu_us"] = ev[0].elapsed_time(ev[1]) * 1e3
    _STATE["window"] = None
    return summarize(records, window["name"], _STATE["installed"]["rank"], wall_s,
                     t_end=window["t0"] + wall_s)  # fmt: skip


# The kinds summarised per window besides execute_model (the step itself).
WINDOW_KINDS = ("sample_tokens", "pp_send", "pp_recv", "ple_gather", "ple_select", "mtp_propose")


def decode_tail(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trailing run of decode steps: after the window's last prefill chunk."""
    tail: list[dict[str, Any]] = []
    for rec in reversed(steps):
        if not rec.get("decode"):
            break
        tail.append(rec)
    return tail[::-1]


def host_critical_us(step: dict[str, Any], records: list[dict[str, Any]]) -> float | None:
    """The host's time from the end of the step's last wait for its input to
    its graph launch (module doc); None when the step waited for nothing on the
    host (its host ran ahead of the GPU) or has no timestamps (p1).

    Rank 0 waits for the ids themselves (the PLE gather's host sync): its GPU
    can start only after that host time. A later rank's host waits only for
    the previous rank's metadata and then prepares the step while that rank's
    GPU still computes; where its stream was still busy at the launch (the
    recorded `gpu_idle` false) the GPU waited for data, not for the host: 0."""
    if "t0" not in step:
        return None

    def inside(t: float | None) -> bool:
        return t is not None and step["t0"] <= t <= step["t1"]

    ids = [r["t0"] for r in records if r["kind"] == "ple_select" and inside(r.get("t0"))]
    metadata = [r["t1"] for r in records if r["kind"] == "pp_recv" and inside(r.get("t1"))]
    if not ids + metadata:
        return None
    ready = max(ids + metadata)
    launches = [r for r in records if r["kind"] == "graph_replay"
                and inside(r.get("t0")) and r["t0"] >= ready]  # fmt: skip
    if not launches:
        # An eager step: everything it launched was launched by its return.
        return (step["t1"] - ready) * 1e6
    launch = min(launches, key=lambda r: r["t0"])
    if not ids and launch.get("gpu_idle") is False:
        return 0.0
    return (launch["t0"] - ready) * 1e6


def summarize(records: list[dict[str, Any]], name: str | None, rank: int, wall_s: float,
              t_end: float | None = None):  # fmt: skip
    """A window's summary from its records (CUDA events already resolved to gpu_us);
    `t_end`: when the window closed (perf_counter), for the decode tail's period."""
    steps = [r for r in records if r["kind"] == "execute_model" and r.get("tokens")]
    decode = [r for r in steps if r.get("decode")]
    tail = decode_tail(steps)
    timed_tail = t_end is not None and tail and "t0" in tail[0]
    critical = [us for us in (host_critical_us(r, records) for r in decode) if us is not None]
    out: dict[str, Any] = {
        "window": name,
        "rank": rank,
        "wall_s": wall_s,
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_rows": sorted({r["tokens"] for r in decode}),
        "step_period_ms": wall_s * 1e3 / len(steps) if steps else None,
        "decode_tail_steps": len(tail),
        "decode_period_ms": (t_end - tail[0]["t0"]) * 1e3 / len(tail) if timed_tail else None,
        "host_critical_ms": _median([us / 1e3 for us in critical]),
        "host_critical_steps": len(critical),
        "execute_wall_ms": _median([r["wall_us"] / 1e3 for r in decode]),
        "execute_gpu_span_ms": _median([r["gpu_us"] / 1e3 for r in decode if "gpu_us" in r]),
    }
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_kind.setdefault(rec["kind"], []).append(rec)
    n_decode = max(len(decode), 1)
    for kind in WINDOW_KINDS:
        recs = by_kind.get(kind, [])
        out[kind] = {
            "calls": len(recs),
            "wall_us_median": _median([r["wall_us"] for r in recs]),
            "wall_us_per_step": sum(r["wall_us"] for r in recs) / n_decode if decode else None,
            "gpu_us_median": _median([r["gpu_us"] for r in recs if "gpu_us" in r]),
            "bytes": sum(r.get("bytes", 0) for r in recs),
        }
    return out


def profile_begin(self, settle: int = 1) -> None:
    """Arm the profiler: `_maybe_start_profile` starts it at the step that
    completes `settle` decode steps in a row (1 at c=1: the first decode step;
    more where decodes and other requests' prefill chunks take turns)."""
    import torch

    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    _STATE.update(armed={"prof": prof, "settle": max(int(settle), 1), "run": 0},
                  profiling=None, profiled_steps=0, profiled_other_steps=0)  # fmt: skip


def _maybe_start_profile(decode: bool) -> None:
    armed = _STATE.get("armed")
    if armed is None:
        return
    armed["run"] = armed["run"] + 1 if decode else 0
    if armed["run"] < armed["settle"]:
        return
    import torch

    # The prefill's kernels, still queued under async scheduling, stay out.
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    armed["prof"].start()
    _STATE.update(armed=None, profiling=armed["prof"])


NCCL_KERNEL = "ncclDevKernel"
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync")  # fmt: skip
TOP_KERNELS = 15


def _device_us(evt) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(evt, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_end(self) -> dict[str, Any]:
    """Kernels' device time per profiled step (the GPU busy time), the top
    kernels, and the host's CUDA runtime calls that can block (count, CPU time)."""
    from dataclasses import asdict

    import torch
    from timeshare import kernels_of

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof = _STATE.pop("profiling", None)
    _STATE["profiling"] = None
    if prof is None:
        armed, _STATE["armed"] = _STATE.get("armed"), None
        why = "no decode steps in a row came" if armed else "profile_begin was not called"
        return {"rank": _STATE["installed"]["rank"], "error": f"not profiled: {why}"}
    prof.stop()
    steps = _STATE.get("profiled_steps", 0)
    return (
        {"rank": _STATE["installed"]["rank"], "other_steps": _STATE["profiled_other_steps"]}
        | profile_summary(prof.key_averages(), steps)
        # every kernel's interval, for timeshare.sharing across the ranks (perf_engine)
        | {"kernels": asdict(kernels_of(prof, NCCL_KERNEL))}
    )


def profile_summary(events, steps: int) -> dict[str, Any]:
    """GPU busy time from the profiler's averaged events: kernels only.

    A GPU-side user annotation (c10d's `nccl:broadcast`, `gloo:send`) spans
    kernels already counted (`ncclDevKernel_Broadcast...`) or none at all
    (a gloo send's wait): p1 counted them and got 157 ms busy in a 38 ms
    step. They are listed apart, not summed."""
    kernels, annotations, syncs = [], [], {}
    for evt in events:
        device_us = _device_us(evt)
        is_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        if is_device and device_us > 0:
            entry = {"name": evt.key[:160], "calls": evt.count, "device_us": device_us}
            annotated = getattr(evt, "is_user_annotation", False)
            (annotations if annotated else kernels).append(entry)
        elif evt.key in SYNC_CALLS:
            syncs[evt.key] = {"calls": evt.count, "cpu_us": float(evt.cpu_time_total)}
    kernels.sort(key=lambda k: -k["device_us"])
    busy_us = sum(k["device_us"] for k in kernels)
    # An NCCL kernel runs from launch until its peer's data arrives: p1's
    # rank 0 broadcast kernel took 32 ms of a 38 ms step, waiting for the
    # last rank's sampled tokens. Its time is the pipeline's, kept apart.
    comm_us = sum(k["device_us"] for k in kernels if k["name"].startswith(NCCL_KERNEL))
    per_step = (lambda us: us / 1e3 / steps) if steps else (lambda us: None)
    return {
        "steps": steps,
        "gpu_busy_ms_per_step": per_step(busy_us),
        "nccl_kernel_ms_per_step": per_step(comm_us),
        "compute_ms_per_step": per_step(busy_us - comm_us),
        "top_kernels": [
            k | {"us_per_step": k["device_us"] / steps if steps else None}
            for k in kernels[:TOP_KERNELS]
        ],
        "host_sync_calls": syncs,
        "annotations": sorted(annotations, key=lambda k: -k["device_us"])[:TOP_KERNELS],
    }


def memory(self, phase: str) -> dict[str, Any]:
    """This process's peaks from onegpu_perf's sampler; `phase` closes the current one."""
    try:
        import sitecustomize
    except ImportError:
        return {"error": "no sitecustomize"}
    sampler = getattr(sitecustomize, "PERF_SAMPLER", None)
    if sampler is None:
        return {"error": "the memory sampler is off (FLASHNEXT_PERF_MEMORY unset)"}
    return sampler.close_phase(phase)
