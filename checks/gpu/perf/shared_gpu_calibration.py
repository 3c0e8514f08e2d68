"""How a GPU shared by processes times one process's kernels (issue 27).

The PP=3 harness runs three ranks as three processes on one H200, and a
waiting rank keeps an NCCL kernel spinning on the card (`timeshare.py`). Two
readings of a rank's profiled kernel time are possible, and the card decides
which holds:

- `busy`: the profiler's kernel durations are the kernels' own; another
  process's work only delays when they start;
- `fair`: a kernel in flight beside another process's kernel gets a share of
  the card, and its duration counts the other's slices; `timeshare.fair`
  (each instant divided by the processes in flight) undoes that.

This measures it. A worker runs a fixed sequence of read kernels (the decode
step's kind of work: weight streams of 1-64 MiB) under torch.profiler, alone
and then beside 1 and 2 spinner processes, each keeping a kernel in flight
throughout (`torch.cuda._sleep`, back to back), profiled too. Per condition:
the worker's sequence span (CUDA events), its kernels' summed durations,
and `timeshare.sharing` over every process's intervals. `model` is the
reading whose figure stays within TOLERANCE of the worker's time alone in
every shared condition (null: neither; the contract then keeps `busy` and
says it is an upper bound).

Torch only, no vLLM; one GPU; about 20 s.

    python3 checks/gpu/perf/shared_gpu_calibration.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from timeshare import Kernels, kernels_of, sharing  # noqa: E402

MIB = 1 << 20
# Weight streams of a decode step's kind: small projections to a large MoE read.
WORKLOAD_MIB = (1, 4, 16, 64)
# ~89 GB read, about 21 ms alone on an H200: many time slices long.
REPEATS = 1000
# Each spinner kernel: about 1 ms at the H200's ~2 GHz clock.
SPIN_CYCLES = 2_000_000
SPIN_QUEUE = 8
TOLERANCE = 0.2


def spin(seconds: float, out: Path) -> None:
    """Spinner process: a kernel in flight for `seconds`, then its intervals to `out`."""
    import torch

    torch.cuda.init()
    marks = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(SPIN_QUEUE):
            torch.cuda._sleep(SPIN_CYCLES)
        print("ready", flush=True)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            # keep SPIN_QUEUE kernels queued: wait for the oldest mark only
            torch.cuda._sleep(SPIN_CYCLES)
            marks.append(torch.cuda.Event())
            marks[-1].record()
            if len(marks) > SPIN_QUEUE:
                marks.pop(0).synchronize()
        torch.cuda.synchronize()
    out.write_text(json.dumps(asdict(kernels_of(prof))))


def _workload():
    import torch

    buffers = [torch.ones(mib * MIB // 2, dtype=torch.bfloat16, device="cuda")
               for mib in WORKLOAD_MIB]  # fmt: skip
    out = torch.empty((), dtype=torch.float32, device="cuda")

    def run() -> None:
        for _ in range(REPEATS):
            for buf in buffers:
                torch.sum(buf, dim=0, dtype=torch.float32, out=out)

    return run


def _worker_pass(run) -> tuple[float, Kernels]:
    """The workload under the profiler: its span (CUDA events, ms) and its kernels."""
    import torch

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
    return start.elapsed_time(end), kernels_of(prof)


def condition(run, spinners: int, work: Path) -> dict:
    """The worker's pass beside `spinners` spinner processes (started, ready, joined)."""
    procs = []
    for i in range(spinners):
        out = work / f"spinner{spinners}-{i}.json"
        procs.append((subprocess.Popen(
            [sys.executable, __file__, "--spin", "6", "--spin-out", str(out)],
            stdout=subprocess.PIPE, text=True), out))  # fmt: skip
    for proc, _ in procs:
        if proc.stdout.readline().strip() != "ready":
            raise SystemExit(
                f"shared_gpu_calibration: a spinner did not start (exit {proc.wait()})"
            )
    time.sleep(0.2)  # every spinner's queue full
    span_ms, mine = _worker_pass(run)
    ranks = {0: mine}
    for i, (proc, out) in enumerate(procs, start=1):
        if proc.wait(timeout=120) != 0:
            raise SystemExit(f"shared_gpu_calibration: spinner {i} failed")
        ranks[i] = Kernels(**json.loads(out.read_text()))
    kernel_sum_ms = sum(e - s for s, e in zip(mine.starts_ns, mine.ends_ns, strict=True)) / 1e6
    return {"spinners": spinners, "span_ms": span_ms, "kernel_sum_ms": kernel_sum_ms,
            "kernels": len(mine.starts_ns)} | sharing(ranks)[0]  # fmt: skip


def verdict(conditions: list[dict]) -> dict:
    """Which reading of a shared kernel time recovers the time alone (module doc)."""
    alone = next(c for c in conditions if c["spinners"] == 0)["kernel_sum_ms"]
    shared = [c for c in conditions if c["spinners"] > 0]
    errors = {
        "busy": [c["kernel_sum_ms"] / alone - 1 for c in shared],
        "fair": [c["fair_ms"] / alone - 1 for c in shared],
    }
    held = [
        name for name, errs in errors.items() if errs and all(abs(e) <= TOLERANCE for e in errs)
    ]
    return {
        "alone_kernel_ms": alone,
        "inflation": {c["spinners"]: c["kernel_sum_ms"] / alone for c in shared},
        "span_inflation": {c["spinners"]: c["span_ms"] / conditions[0]["span_ms"] for c in shared},
        "errors": errors,
        "tolerance": TOLERANCE,
        # both can hold where the spinners never overlapped the worker; busy is then the plain one
        "model": held[0] if held else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--spinners", type=int, default=2, help="up to this many (default 2)")
    parser.add_argument("--spin", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--spin-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.spin is not None:
        spin(args.spin, args.spin_out)
        return 0
    import torch

    work = Path(tempfile.mkdtemp(prefix="shared_gpu_calibration."))
    run = _workload()
    run()  # warm-up
    conditions = [condition(run, s, work) for s in range(args.spinners + 1)]
    doc = {
        "what": "one process's kernel times beside spinning processes on one GPU "
        "(checks/gpu/perf/shared_gpu_calibration.py)",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "workload_mib": list(WORKLOAD_MIB),
        "repeats": REPEATS,
        "conditions": conditions,
        "verdict": verdict(conditions),
    }
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
