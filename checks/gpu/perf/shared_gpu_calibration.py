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

This measures it. A worker process runs a fixed sequence of read kernels
(the decode step's kind of work: weight streams of 1-64 MiB) under
torch.profiler, alone and then beside 1 and 2 spinner processes, each
keeping a kernel in flight throughout (`torch.cuda._sleep`, back to back),
profiled too. Per condition: the worker's sequence span (CUDA events), its
kernels' summed durations, and `timeshare.sharing` over every process's
intervals (a worker `shared_fraction` near 1 beside a spinner also shows
that the processes' timestamps line up). `verdict.model` is the reading
whose figure stays within TOLERANCE of the worker's time alone in every
shared condition (null: neither; the contract then keeps `busy` and says it
is an upper bound).

Where the host has NVIDIA's MPS control daemon, the 2-spinner condition runs
once more under a private MPS server (its own pipe directory, stopped at the
end; the GPU's settings are not touched): MPS runs the processes' kernels
side by side instead of in turns, and `mps.clean` says whether the worker
kept its time alone there, i.e. whether an MPS engine would give each rank
its own kernel time directly.

Torch only, no vLLM; one GPU; about 30 s (every process starts CUDA).

    python3 checks/gpu/perf/shared_gpu_calibration.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))

from card import card as card_now  # noqa: E402
from timeshare import Kernels, kernels_of, sharing  # noqa: E402

MIB = 1 << 20
# Weight streams of a decode step's kind: small projections to a large MoE read.
WORKLOAD_MIB = (1, 4, 16, 64)
# ~89 GB read, about 21 ms alone on an H200: many time slices long.
REPEATS = 1000
# Each spinner kernel: about 1 ms at the H200's ~2 GHz clock.
SPIN_CYCLES = 2_000_000
SPIN_QUEUE = 8
SPIN_LIMIT_S = 120  # a spinner whose stop file never comes stops itself
TOLERANCE = 0.2
MPS_CONTROL = "nvidia-cuda-mps-control"


def _profile():
    import torch

    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])


def spin(stop: Path, out: Path) -> None:
    """Spinner process: a kernel in flight until `stop` exists, then its intervals to `out`."""
    import torch

    marks = []
    with _profile() as prof:
        for _ in range(SPIN_QUEUE):
            torch.cuda._sleep(SPIN_CYCLES)
        print("ready", flush=True)
        deadline = time.monotonic() + SPIN_LIMIT_S
        while not stop.exists() and time.monotonic() < deadline:
            # keep SPIN_QUEUE kernels queued: wait for the oldest mark only
            torch.cuda._sleep(SPIN_CYCLES)
            marks.append(torch.cuda.Event())
            marks[-1].record()
            if len(marks) > SPIN_QUEUE:
                marks.pop(0).synchronize()
        torch.cuda.synchronize()
    out.write_text(json.dumps(asdict(kernels_of(prof))))


def work(out: Path) -> None:
    """Worker process: the workload once to warm up, once profiled; span and kernels to `out`."""
    import torch

    buffers = [torch.ones(mib * MIB // 2, dtype=torch.bfloat16, device="cuda")
               for mib in WORKLOAD_MIB]  # fmt: skip
    total = torch.empty((), dtype=torch.float32, device="cuda")

    def run() -> None:
        for _ in range(REPEATS):
            for buf in buffers:
                torch.sum(buf, dim=0, dtype=torch.float32, out=total)

    run()
    torch.cuda.synchronize()
    with _profile() as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
    out.write_text(json.dumps({"span_ms": start.elapsed_time(end)} | asdict(kernels_of(prof))))


def _child(mode: str, out: Path, env: dict[str, str], stop: Path | None = None):
    argv = [sys.executable, __file__, f"--{mode}", str(out)]
    if stop is not None:
        argv += ["--stop", str(stop)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)


def condition(spinners: int, tmp: Path, env: dict[str, str], tag: str = "") -> dict:
    """The worker's pass beside `spinners` spinner processes, all under `env`."""
    name = f"{tag}{spinners}"
    stop = tmp / f"stop-{name}"
    procs = [(_child("spin", tmp / f"spinner-{name}-{i}.json", env, stop),
              tmp / f"spinner-{name}-{i}.json") for i in range(spinners)]  # fmt: skip
    try:
        for proc, _ in procs:
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"shared_gpu_calibration: a spinner did not start ({name})")
        worker_out = tmp / f"worker-{name}.json"
        if _child("work", worker_out, env).wait(timeout=600) != 0:
            raise SystemExit(f"shared_gpu_calibration: the worker failed ({name})")
    finally:
        stop.touch()
    ranks = {}
    for i, (proc, out) in enumerate(procs, start=1):
        if proc.wait(timeout=SPIN_LIMIT_S + 60) != 0:
            raise SystemExit(f"shared_gpu_calibration: spinner {i} failed ({name})")
        ranks[i] = Kernels(**json.loads(out.read_text()))
    worker = json.loads(worker_out.read_text())
    span_ms = worker.pop("span_ms")
    ranks[0] = Kernels(**worker)
    mine = ranks[0]
    kernel_sum_ms = sum(e - s for s, e in zip(mine.starts_ns, mine.ends_ns, strict=True)) / 1e6
    return {"spinners": spinners, "span_ms": span_ms, "kernel_sum_ms": kernel_sum_ms,
            "kernels": len(mine.starts_ns)} | sharing(ranks)[0]  # fmt: skip


def verdict(conditions: list[dict]) -> dict:
    """Which reading of a shared kernel time recovers the time alone (module doc)."""
    alone = next(c for c in conditions if c["spinners"] == 0)
    shared = [c for c in conditions if c["spinners"] > 0]
    errors = {
        "busy": [c["kernel_sum_ms"] / alone["kernel_sum_ms"] - 1 for c in shared],
        "fair": [c["fair_ms"] / alone["kernel_sum_ms"] - 1 for c in shared],
    }
    held = [
        name for name, errs in errors.items() if errs and all(abs(e) <= TOLERANCE for e in errs)
    ]
    return {
        "alone_kernel_ms": alone["kernel_sum_ms"],
        "inflation": {c["spinners"]: c["kernel_sum_ms"] / alone["kernel_sum_ms"] for c in shared},
        "span_inflation": {c["spinners"]: c["span_ms"] / alone["span_ms"] for c in shared},
        "errors": errors,
        "tolerance": TOLERANCE,
        # both can hold where the spinners never overlapped the worker; busy is then the plain one
        "model": held[0] if held else None,
    }


def mps_condition(tmp: Path, alone_ms: float) -> dict:
    """The 2-spinner condition under a private MPS server, if the host has one."""
    control = shutil.which(MPS_CONTROL)
    if control is None:
        return {"available": False, "why": f"{MPS_CONTROL} is not on PATH"}
    env = os.environ | {"CUDA_MPS_PIPE_DIRECTORY": str(tmp / "mps-pipe"),
                        "CUDA_MPS_LOG_DIRECTORY": str(tmp / "mps-log")}  # fmt: skip
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        Path(env[key]).mkdir()
    started = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, check=False)
    if started.returncode != 0:
        return {"available": False, "why": f"{MPS_CONTROL} -d: {started.stderr.strip()[:300]}"}
    try:
        got = condition(2, tmp, env, tag="mps")
    except SystemExit as exc:
        return {"available": True, "error": str(exc)}
    finally:
        subprocess.run([control], input="quit\n", env=env, text=True, capture_output=True,
                       check=False, timeout=60)  # fmt: skip
    error = got["kernel_sum_ms"] / alone_ms - 1
    return {"available": True, "condition": got, "error": error, "clean": abs(error) <= TOLERANCE}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--spinners", type=int, default=2, help="up to this many (default 2)")
    parser.add_argument("--no-mps", action="store_true", help="skip the MPS condition")
    parser.add_argument("--spin", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--stop", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.spin is not None:
        spin(args.stop, args.spin)
        return 0
    if args.work is not None:
        work(args.work)
        return 0
    import torch  # the device's name only; this process starts no CUDA context

    tmp = Path(tempfile.mkdtemp(prefix="shared_gpu_calibration."))
    conditions = [condition(s, tmp, dict(os.environ)) for s in range(args.spinners + 1)]
    result = verdict(conditions)
    doc = {
        "what": "one process's kernel times beside spinning processes on one GPU "
        "(checks/gpu/perf/shared_gpu_calibration.py)",
        "torch": torch.__version__,
        "card": card_now(),  # which card ran: an H200 call may get an H100
        "workload_mib": list(WORKLOAD_MIB),
        "repeats": REPEATS,
        "conditions": conditions,
        "verdict": result,
        "mps": (
            {"available": False, "why": "--no-mps"}
            if args.no_mps
            else mps_condition(tmp, result["alone_kernel_ms"])
        ),
    }
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
