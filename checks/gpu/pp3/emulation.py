"""PP=3 on one GPU, as the launcher sees it: the one card's facts as three cards,
and the environment that puts the three ranks on it (test only; stdlib only).

    python3 checks/gpu/pp3/emulation.py facts HOST_FACTS OUT [--gpus N]
    python3 checks/gpu/pp3/emulation.py env

`facts`: HOST_FACTS is `flashnext facts --json` as probed on the lent host
(one GPU); OUT gets the same facts with that GPU N times (default 3; indexes
0..N-1, placeholder UUIDs), for the launcher's `--facts` and serve's
`--replay-facts-for-testing`. Preflight's GPU-count check then judges N
replayed cards; it is never switched off. Prints one line: what was replayed.

`env`: the shim's environment as KEY=VALUE lines, PYTHONPATH with the shim
folder (onegpu/) first and the caller's PYTHONPATH after it. Exported to
`flashnext serve`, it reaches the `vllm serve` that serve starts (serve runs
vLLM with its own environment plus the plan's): the plan's argv and env stay
the shipped ones.

Used by checks/gpu/serve/serve-tiny (PROFILE=h200-tiny-pp3 PP_ONE_GPU=1), the PP=3
harness (orchestrate.py) and checks/launcher/test_profile_h200_tiny_pp3.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "onegpu"
"""sitecustomize.py: must be first on PYTHONPATH."""

ONE_GPU_ENV = {
    "FLASHNEXT_PP_ONE_GPU": "1",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_IB_DISABLE": "1",
}


def replicate_gpu(facts: dict, count: int = 3) -> dict:
    """`facts` of a host with one GPU as a host with `count` of it (indexes 0..count-1,
    placeholder UUIDs: not real serials). Everything else is the probe's."""
    devices = facts["gpu"]["devices"]
    if len(devices) != 1:
        raise ValueError(
            f"the facts show {len(devices)} GPU(s); the one-GPU emulation replays exactly one"
        )
    out = copy.deepcopy(facts)
    card = out["gpu"]["devices"][0]
    out["gpu"]["devices"] = []
    for index in range(count):
        device = copy.deepcopy(card)
        device["index"] = index
        device["uuid"] = f"GPU-00000000-0000-0000-0000-{index:012d}"  # not real serials
        out["gpu"]["devices"].append(device)
    if "device_count" in out["gpu"]:
        out["gpu"]["device_count"] = count
    return out


def shim_env(pythonpath: str | None) -> dict[str, str]:
    """ONE_GPU_ENV and PYTHONPATH with the shim folder first."""
    first = str(SHIM_DIR)
    return {**ONE_GPU_ENV, "PYTHONPATH": f"{first}:{pythonpath}" if pythonpath else first}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="checks/gpu/pp3/emulation.py", description=__doc__)
    sub = parser.add_subparsers(dest="what", required=True)
    facts = sub.add_parser("facts", help="replay one GPU's facts as N GPUs")
    facts.add_argument("host_facts", type=Path)
    facts.add_argument("out", type=Path)
    facts.add_argument("--gpus", type=int, default=3)
    sub.add_parser("env", help="the shim's environment, KEY=VALUE lines")
    args = parser.parse_args(argv)
    if args.what == "env":
        for key, value in shim_env(os.environ.get("PYTHONPATH")).items():
            print(f"{key}={value}")
        return 0
    try:
        host = json.loads(args.host_facts.read_text())
        replayed = replicate_gpu(host, args.gpus)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"emulation.py facts: {args.host_facts}: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(replayed, indent=2, sort_keys=True) + "\n")
    card = host["gpu"]["devices"][0]
    print(f"{card['name']} x{args.gpus} (the host has 1), written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
