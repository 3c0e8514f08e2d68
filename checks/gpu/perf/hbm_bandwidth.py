"""The GPU's measured streaming bandwidth: the roofline a decode step is held to.

Issue 27 judges a step's bytes read from HBM against what the card streams,
measured, not the datasheet's figure. Three numbers, each the best of
`--repeats` timed passes (CUDA events) over a buffer far larger than L2:

- `read`: a sum over the buffer (reads only; a decode step's weight stream);
- `copy`: a device-to-device copy, counted as bytes read plus bytes written;
- `h2d_pinned` / `h2d_pageable`: a host-to-device copy (the QSA K/V and PLE
  reads over the host link).

Torch only, no vLLM: it runs on the GPU host's own torch.

    python3 checks/gpu/perf/hbm_bandwidth.py --out FILE.json [--gib 4] [--repeats 20]
    python3 checks/gpu/perf/hbm_bandwidth.py --device cpu --gib 0.01   # the CPU test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GIB = 1 << 30


def _timed(device, fn, repeats: int) -> float:
    """Best seconds of `repeats` calls of fn (CUDA events on a GPU, wall time on CPU)."""
    import torch

    fn()  # warm-up: allocator, kernel selection
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure(device_name: str, nbytes: int, repeats: int) -> dict:
    import torch

    device = torch.device(device_name)
    n = nbytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    out = torch.empty((), dtype=torch.float32, device=device)
    host_pinned = torch.ones(n, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    host_pageable = torch.ones(n, dtype=torch.bfloat16)
    results = {}
    for name, fn, moved in (
        ("read", lambda: torch.sum(src, dim=0, dtype=torch.float32, out=out), nbytes),
        ("copy", lambda: dst.copy_(src), 2 * nbytes),
        ("h2d_pinned", lambda: dst.copy_(host_pinned, non_blocking=True), nbytes),
        ("h2d_pageable", lambda: dst.copy_(host_pageable), nbytes),
    ):
        seconds = _timed(device, fn, repeats)
        results[name] = {"bytes": moved, "seconds": seconds, "bytes_per_s": moved / seconds}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gib", type=float, default=4.0, help="buffer size (default 4 GiB)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    import torch

    nbytes = int(args.gib * GIB) // 2 * 2
    doc = {
        "what": "streaming bandwidth, best of repeats (checks/gpu/perf/hbm_bandwidth.py)",
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        # which card (an H200 call may get an H100): perf_contract matches runs to it
        "device_memory_bytes": torch.cuda.get_device_properties(args.device).total_memory
        if args.device.startswith("cuda")
        else None,
        "torch": torch.__version__,
        "buffer_bytes": nbytes,
        "repeats": args.repeats,
        "results": measure(args.device, nbytes, args.repeats),
    }
    text = json.dumps(doc, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    sys.stdout.write(text)
    for name, r in doc["results"].items():
        print(f"{name:14} {r['bytes_per_s'] / 1e9:8.1f} GB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
