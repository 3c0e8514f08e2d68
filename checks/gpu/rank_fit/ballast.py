"""Hold a GPU's memory down to one smaller card's free memory (issue 12).

    python3 checks/gpu/rank_fit/ballast.py FREE_BYTES

On the lent H200 (about 140 GiB) this leaves FREE_BYTES free, as NVML counts
it, for the engine started next, so vLLM sees what it would see on one idle
3090 (plus what a PP=1 slice builds that its rank does not hold). It takes
the memory with plain device allocations (torch's caching allocator, no
expandable segments: each block a cudaMalloc), then prints one JSON line
(`total`, `target_free`, `free_cuda`, `free_before`, `free_after`, `held`)
and holds everything until its stdin closes or it gets SIGTERM. Exit 1 with
a message when the GPU has less free than asked or the allocation fails.

Its own CUDA context is counted: `held` is what the ballast process takes in
all, the drop of NVML's free memory from before its context to after its
allocations; the loop itself reads cudaMemGetInfo, which is what vLLM's
start-up check reads.
"""

from __future__ import annotations

import json
import os
import signal
import sys

# The last adjustment allocates in blocks of this size (torch rounds large
# requests to 2 MiB), so the result lands within 2 MiB of the target.
ROUND = 2 << 20


def nvml_free() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)


def main() -> int:
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():
        print("usage: ballast.py FREE_BYTES", file=sys.stderr)
        return 2
    target = int(sys.argv[1])
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # plain cudaMalloc blocks
    import torch

    free0 = nvml_free()  # before this process has a CUDA context
    blocks = []
    free, total = torch.cuda.mem_get_info()  # what the engine will ask too
    if free < target:
        print(f"ballast: only {free} bytes free, fewer than the {target} asked", file=sys.stderr)
        return 1
    try:
        # One big block, then top up: the first allocation's own overhead
        # (allocator bookkeeping, alignment) is only known after it.
        while free - target >= ROUND:
            n = (free - target) // ROUND * ROUND
            blocks.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
            free, _ = torch.cuda.mem_get_info()
    except torch.OutOfMemoryError as exc:
        print(f"ballast: allocation failed: {exc}", file=sys.stderr)
        return 1
    free_after = nvml_free()
    print(
        json.dumps(
            {"total": total, "target_free": target, "free_cuda": free,
             "free_before": free0, "free_after": free_after, "held": free0 - free_after}
        ),
        flush=True,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sys.stdin.read()  # until the parent closes our stdin
    return 0


if __name__ == "__main__":
    sys.exit(main())
