"""What no host can report: replayed facts that contradict themselves are refused
before anything is planned on them (free memory over the total, two GPUs with one
UUID, no CPUs, a P2P matrix with pairs left out, NFS that is not on the network).

A probe of a real host never produces these; a hand-edited or damaged facts file
can, and a plan made from it would vouch for a machine that cannot exist.
"""

from __future__ import annotations

import re
from itertools import combinations

from flashnext.facts.schema import FactsSchemaError, HostFacts, host_facts_from_file
from flashnext.facts.storage import NETWORK_FS

_COMPUTE_CAPABILITY = re.compile(r"\d{1,2}\.\d{1,2}")


def _memory(facts: HostFacts) -> list[str]:
    m = facts.memory
    out = [f"memory.{name} is {value}, below 0"
           for name, value in vars(m).items()
           if name.endswith(("_bytes", "_total", "_free")) and isinstance(value, int)
           and value < 0]  # fmt: skip
    for free, total in (("mem_available_bytes", "mem_total_bytes"),
                        ("swap_free_bytes", "swap_total_bytes"),
                        ("hugepages_free", "hugepages_total"),
                        ("shm_free_bytes", "shm_total_bytes"),
                        ("memlock_soft_bytes", "memlock_hard_bytes")):  # fmt: skip
        a, b = getattr(m, free), getattr(m, total)
        if a is not None and b is not None and a > b:
            out.append(f"memory.{free} {a} is more than memory.{total} {b}")
    if m.cpu_count is not None and m.cpu_count < 1:
        out.append(f"memory.cpu_count is {m.cpu_count}: a running host has a CPU")
    return out


def _gpus(facts: HostFacts) -> list[str]:
    devices = facts.gpu.devices
    out = []
    for d in devices:
        if d.memory_total_bytes <= 0 or not 0 <= d.memory_free_bytes <= d.memory_total_bytes:
            out.append(f"GPU {d.index}: {d.memory_free_bytes} bytes free of "
                       f"{d.memory_total_bytes}")  # fmt: skip
        if not _COMPUTE_CAPABILITY.fullmatch(d.compute_capability):
            out.append(f"GPU {d.index}: compute_capability {d.compute_capability!r} is not "
                       "major.minor (8.6)")  # fmt: skip
    for what, values in (("index", [d.index for d in devices]),
                         ("UUID", [d.uuid for d in devices])):  # fmt: skip
        twice = sorted({str(v) for v in values if values.count(v) > 1})
        if twice:
            out.append(f"two GPUs share the {what} {twice[0]}")
    links = facts.gpu.p2p
    if links:
        indices = {d.index for d in devices}
        seen = [tuple(sorted((p.gpu_a, p.gpu_b))) for p in links]
        wanted = set(combinations(sorted(indices), 2))
        stray = [pair for pair in seen if pair not in wanted]
        missing = sorted(wanted - set(seen))
        if stray:
            out.append(f"the P2P matrix names the pair {stray[0]}, not two of GPUs "
                       f"{sorted(indices)}")  # fmt: skip
        elif len(seen) != len(set(seen)):
            out.append("the P2P matrix lists a pair twice")
        elif missing:
            out.append(f"the P2P matrix leaves out the pair {missing[0]}")
    return out


def _storage(facts: HostFacts) -> list[str]:
    return [
        f"storage.{role}: fs_type {s.fs_type} is a network filesystem, but network is false"
        for role, s in sorted(facts.storage.items())
        if s.fs_type in NETWORK_FS and not s.network
    ]


def replayed_facts(path: str) -> HostFacts:
    """A facts file (--facts) whose facts a real host could have reported; else
    FactsSchemaError naming the first contradictions and the fix."""
    facts = host_facts_from_file(path)
    problems = impossible(facts)
    if problems:
        raise FactsSchemaError(
            f"{path}: no host reports this: {'; '.join(problems[:3])}; record facts on the "
            "serving host with `flashnext facts --out FILE` instead of editing them"
        )
    return facts


def impossible(facts: HostFacts) -> list[str]:
    """Each contradiction in `facts`; empty when a real host could have reported them."""
    return [*_memory(facts), *_gpus(facts), *_storage(facts)]
