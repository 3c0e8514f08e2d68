"""The GPUs against the profile: count and model, each card's VRAM, compute capability,
idleness and PCIe link, the P2P matrix and the NUMA placement."""

from __future__ import annotations

from collections.abc import Iterator

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import _RECORD_FACTS, PreflightInput, _facts_lack, _ok
from flashnext.units import gib


def gpus(inp: PreflightInput) -> Iterator[Finding]:
    gpu, spec = inp.facts.gpu, inp.profile.gpu
    want = f"{spec.count}x {spec.label}"
    if not gpu.nvml_available:
        yield Finding(
            "gpu.nvml",
            "fail",
            f"NVML unavailable: {gpu.error or 'unknown reason'}",
            want,
            "no NVIDIA driver could be queried, so no GPU can be used",
            "install the NVIDIA driver (nvidia-smi must work); in a container pass "
            "--device nvidia.com/gpu=all",
        )
        return
    if gpu.error:  # NVML answered, but not about everything
        yield Finding(
            "gpu.nvml",
            "warn",
            gpu.error,
            "every GPU readable",
            f"NVML could not report everything: {gpu.error}",
            "check `nvidia-smi -q`; a GPU that fell off the bus needs a reboot",
        )
    devices = gpu.devices
    seen = ", ".join(sorted({d.name for d in devices})) or "none"
    matching = [d for d in devices if spec.matches(d)]
    if len(devices) != spec.count or len(matching) != spec.count:
        yield Finding(
            "gpu.count",
            "fail",
            f"{len(devices)}x {seen}",
            want,
            f"profile {inp.profile.name} needs {want}, the host shows {len(devices)}x {seen}",
            "run on the machine the profile describes, expose all its GPUs "
            "(CUDA_VISIBLE_DEVICES unset), or pick another --profile",
        )
    else:
        yield _ok("gpu.count", f"{len(devices)}x {seen}", want, "GPU model and count match")
    for d in devices:
        yield from _gpu_device(d, inp)
    if len(devices) > 1:
        yield from _gpu_p2p(inp)
    yield from _gpu_numa(inp)


def _gpu_p2p(inp: PreflightInput) -> Iterator[Finding]:
    """The P2P matrix NVML reports: without P2P, PP activations cross host memory."""
    statuses: dict[tuple[int, int], set[str]] = {}
    present = {d.index for d in inp.facts.gpu.devices}
    for link in inp.facts.gpu.p2p:
        if {link.gpu_a, link.gpu_b} <= present:
            statuses.setdefault(tuple(sorted((link.gpu_a, link.gpu_b))), set()).add(link.status)
    required = "GPU to GPU, or through host memory"
    if not statuses:
        yield Finding(
            "gpu.p2p",
            "warn",
            "unknown",
            required,
            f"{_facts_lack(inp, 'the GPUs P2P matrix')}: whether PP traffic goes GPU to GPU "
            "or through host memory is unknown",
            f"check `nvidia-smi topo -p2p r`; {_RECORD_FACTS}",
        )
        return
    matrix = ", ".join(f"{a}-{b} {'/'.join(sorted(s))}" for (a, b), s in sorted(statuses.items()))
    without = [pair for pair, s in sorted(statuses.items()) if s != {"ok"}]
    if any("unknown" in s for s in statuses.values()):
        yield Finding(
            "gpu.p2p",
            "warn",
            f"partly unknown: {matrix}",
            required,
            f"NVML could not say for every pair of GPUs whether P2P works ({matrix})",
            "check `nvidia-smi topo -p2p r`",
        )
    elif without:
        yield _ok(
            "gpu.p2p",
            f"no P2P on {len(without)} of {len(statuses)} pairs",
            required,
            f"P2P reads: {matrix}: PP activations go through host memory (NCCL's shared-"
            "memory transport), so the plan sets NCCL_P2P_DISABLE=1",
        )
    else:
        yield _ok("gpu.p2p", "P2P on every pair", required, f"P2P reads: {matrix}")


def _gpu_numa(inp: PreflightInput) -> Iterator[Finding]:
    """GPUs and the pinned K/V pools on the same NUMA node of a multi-socket host."""
    numa, devices = inp.facts.numa, inp.facts.gpu.devices
    gpus = ", ".join(
        f"GPU{d.index} node {'-' if d.numa_node is None else d.numa_node}" for d in devices
    )
    required = "pools on the GPUs' node"
    if not numa.nodes:
        yield Finding(
            "gpu.numa",
            "warn",
            "unknown",
            required,
            f"{_facts_lack(inp, 'the NUMA nodes')}: whether the pinned K/V pools sit on "
            "the GPUs' node is unknown",
            f"check `numactl -H` and `nvidia-smi topo -m`; {_RECORD_FACTS}",
        )
        return
    if len(numa.nodes) == 1:
        yield _ok(
            "gpu.numa",
            "1 NUMA node",
            required,
            "one NUMA node: the pinned pools and the GPUs share it"
            + (f" ({gpus})" if gpus else ""),
        )
        return
    nodes = len(numa.nodes)
    gpu_nodes = sorted({d.numa_node for d in devices if d.numa_node is not None})
    mems = sorted(set(numa.mems_allowed or numa.nodes))
    if len(gpu_nodes) > 1:
        yield Finding(
            "gpu.numa",
            "warn",
            f"GPUs on nodes {gpu_nodes}",
            required,
            f"{nodes} NUMA nodes, the GPUs on {len(gpu_nodes)} of them ({gpus}): one "
            "process-wide binding cannot keep every rank's pinned K/V pool beside its GPU, "
            "so some ranks read host K/V across the socket interconnect every token",
            "put the GPUs in slots of one socket if the board allows; otherwise expect "
            "slower decode on the far ranks",
        )
    elif not devices or any(d.numa_node is None for d in devices):
        yield Finding(
            "gpu.numa",
            "warn",
            "GPU nodes unknown",
            required,
            f"{nodes} NUMA nodes, but not every GPU's node is known ({gpus or 'no GPUs'})",
            "check `nvidia-smi topo -m` (the NUMA Affinity column)",
        )
    elif mems == gpu_nodes:
        yield _ok(
            "gpu.numa",
            f"bound to node {mems[0]}",
            required,
            f"{nodes} NUMA nodes; this process allocates on node {mems[0]} only, where the "
            f"GPUs sit ({gpus})",
        )
    else:
        n = gpu_nodes[0]
        yield Finding(
            "gpu.numa",
            "warn",
            f"GPUs on node {n}, pools on {mems}",
            required,
            f"{nodes} NUMA nodes; the GPUs sit on node {n} ({gpus}) but this process may "
            f"allocate on nodes {mems}: each worker's pinned K/V pool lands where it is "
            "first touched, possibly across the socket interconnect from its GPU",
            f"start serve bound to node {n}: `numactl --cpunodebind={n} --membind={n} "
            f"flashnext serve ...` (podman/docker: --cpuset-mems={n} and that node's CPUs "
            "in --cpuset-cpus)",
        )


def _gpu_device(d, inp: PreflightInput) -> Iterator[Finding]:
    spec = inp.profile.gpu
    tag = f"gpu{d.index}"
    if d.memory_total_bytes < spec.min_memory_bytes:
        yield Finding(
            f"{tag}.vram",
            "fail",
            gib(d.memory_total_bytes),
            f">= {gib(spec.min_memory_bytes)}",
            f"GPU {d.index} has {gib(d.memory_total_bytes)}; profile {inp.profile.name} "
            f"needs {spec.label} cards of at least {gib(spec.min_memory_bytes)}",
            f"run on whole {spec.label} cards (not a MIG slice), or pick a --profile for "
            "your cards",
            measured_bytes=d.memory_total_bytes,
            required_bytes=spec.min_memory_bytes,
        )
    else:
        yield _ok(
            f"{tag}.vram",
            gib(d.memory_total_bytes),
            f">= {gib(spec.min_memory_bytes)}",
            "enough VRAM",
            measured_bytes=d.memory_total_bytes,
            required_bytes=spec.min_memory_bytes,
        )
    if _cc(d.compute_capability) < _cc(spec.min_compute_capability):
        yield Finding(
            f"{tag}.compute_capability",
            "fail",
            d.compute_capability,
            f">= {spec.min_compute_capability}",
            f"GPU {d.index} is sm_{d.compute_capability.replace('.', '')}: the Marlin INT4/INT8 "
            "and QSA kernels need Ampere (8.6) or newer",
            "use Ampere or newer GPUs",
        )
    else:
        yield _ok(
            f"{tag}.compute_capability",
            d.compute_capability,
            f">= {spec.min_compute_capability}",
            "kernels supported",
        )
    yield from _gpu_idle(d, inp)
    yield from _gpu_pcie(d, inp)


def _cc(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def _gpu_idle(d, inp: PreflightInput) -> Iterator[Finding]:
    tag = f"gpu{d.index}.idle"
    util = inp.profile.memory.gpu_memory_utilization
    needed = int(d.memory_total_bytes * util)
    if d.processes:
        procs = ", ".join(
            f"{p.pid} ({p.name or '?'}, {gib(p.used_memory_bytes)})" for p in d.processes
        )
        yield Finding(
            tag,
            "fail",
            f"{len(d.processes)} process(es): {procs}",
            "no other processes",
            f"GPU {d.index} is in use by {procs}; vLLM needs {util:.0%} of it",
            f"stop them (nvidia-smi shows them; kill {' '.join(str(p.pid) for p in d.processes)})",
        )
    elif d.memory_free_bytes < needed:
        yield Finding(
            tag,
            "fail",
            f"{gib(d.memory_free_bytes)} free",
            f">= {gib(needed)} free",
            f"GPU {d.index} has only {gib(d.memory_free_bytes)} free of "
            f"{gib(d.memory_total_bytes)}; vLLM will reserve {util:.0%}",
            "free the GPU (a display server or another container may hold memory)",
            measured_bytes=d.memory_free_bytes,
            required_bytes=needed,
        )
    else:
        yield _ok(
            tag,
            f"{gib(d.memory_free_bytes)} free",
            f">= {gib(needed)} free",
            "idle",
            measured_bytes=d.memory_free_bytes,
            required_bytes=needed,
        )


def _gpu_pcie(d, inp: PreflightInput) -> Iterator[Finding]:
    spec = inp.profile.gpu
    tag = f"gpu{d.index}.pcie"
    # The link trains down at idle: judge the maximum, report the current.
    gen, width = d.pcie_gen_max, d.pcie_width_max
    measured = f"Gen{gen} x{width} (now Gen{d.pcie_gen_current} x{d.pcie_width_current})"
    required = f">= Gen{spec.min_pcie_gen} x{spec.min_pcie_width}"
    if gen is None or width is None:
        yield Finding(
            tag,
            "warn",
            "unknown",
            required,
            "NVML did not report the PCIe link",
            "check `nvidia-smi -q -d PCIE`",
        )
    elif gen < spec.min_pcie_gen or width < spec.min_pcie_width:
        yield Finding(
            tag,
            "warn",
            measured,
            required,
            f"GPU {d.index} links at Gen{gen} x{width}: host K/V and PP traffic cross PCIe "
            "every token, so decode and long prefills slow down",
            "put the card in a full x16 Gen4 slot (check BIOS lane bifurcation and risers)",
        )
    else:
        yield _ok(tag, measured, required, "full link")
