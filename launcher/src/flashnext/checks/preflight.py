"""Preflight: pure checks over facts, each a Finding with the fix in one sentence.

A check never touches the host. It reads HostFacts (probed or replayed from a
file), ModelFacts (or the error reading them), the profile and the plan, and
returns findings: id, level (ok/warn/fail), what was measured, what is
required, a message citing the fact, and a fix you can paste.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext import VLLM_VERSION
from flashnext.checkout import BUILD_DOWNLOAD_TEXT, BUILD_INSTALLED_TEXT
from flashnext.checks.finding import Finding
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
)
from flashnext.facts.schema import HostFacts, ModelFacts, StorageFacts, VllmEnvFacts
from flashnext.plan.mtp import INT4_FIX
from flashnext.plan.planner import Plan
from flashnext.profiles import Profile
from flashnext.table.file_layout import LAYOUTS, PACKED, both_sizes, layouts_matching, table_bytes
from flashnext.table.path_kind import interrupted_prepare_output, partial_message, rewrite_fix
from flashnext.table.storage_policy import storage_refusal
from flashnext.units import gib, size

EXPECTED_ARCH = "qwen4_exp"


@dataclass(frozen=True)
class PreflightInput:
    facts: HostFacts
    profile: Profile
    plan: Plan | None
    plan_error: str | None
    model: ModelFacts | None
    model_error: str | None
    model_dir: str | None
    table_path: str | None
    table_shape: tuple[int, int] | None
    """(rows, cols) of the PLE table the model config implies; None without a model."""
    port: int
    host: str
    facts_source: str | None = None
    """The facts file replayed with --facts; None when the facts were probed here."""
    generation_config_dir: str | None = None
    """--generation-config DIR: vLLM takes its sampling defaults from there instead."""
    generation_config: dict[str, Any] | None = None
    """DIR/generation_config.json, when it could be read."""
    generation_config_error: str | None = None
    """Why DIR/generation_config.json could not be read."""
    table_shape_error: str | None = None
    """Why config.json implies no table shape (table_shape is then None)."""
    model_missing: bool = False
    """model_dir does not exist (a wrong path, or not downloaded yet)."""
    model_error_fix: str | None = None
    """The fix of model_error where the reader says it (a file this user may not read
    wants access, not a download; model_error ends with it); None: re-download the
    missing or damaged files."""
    host_plan: Plan | None = None
    """The plan host memory is judged by: `plan`, else the plan for the profile's own
    checkpoint inventory (no checkpoint read); None: neither."""
    vllm_env: VllmEnvFacts | None = None
    """The vLLM serve would start; None: not asked (`plan`, pure tests)."""
    patch_series: tuple[tuple[str, str], ...] | None = None
    """(name, sha256) of each patch in this checkout's series; None outside a checkout."""
    build_env: str | None = None
    """The command that builds the pinned env from here (`pins/build-env`); None
    outside a checkout (the Nix app and the image carry their env)."""


def _ok(id_: str, measured: str, required: str, message: str, **values: int | None) -> Finding:
    return Finding(id_, "ok", measured, required, message, **values)


Check = Callable[[PreflightInput], Iterator[Finding]]
CHECKS: list[Check] = []


def check(fn: Check) -> Check:
    CHECKS.append(fn)
    return fn


def preflight(inp: PreflightInput) -> list[Finding]:
    return [finding for fn in CHECKS for finding in fn(inp)]


# ---------------------------------------------------------------- GPUs


@check
def gpus(inp: PreflightInput) -> Iterator[Finding]:
    gpu, spec = inp.facts.gpu, inp.profile.gpu
    want = f"{spec.count}x {spec.name}"
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
            f"GPU {d.index} has {gib(d.memory_total_bytes)}, the plan needs a 24 GB card",
            "use 24 GB cards (RTX 3090/4090 class) or a profile for your cards",
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


# ---------------------------------------------------------------- host memory


@check
def host_memory(inp: PreflightInput) -> Iterator[Finding]:
    """RAM, memlock and the cgroup against the plan; without one (no checkpoint read)
    against the plan for the profile's own checkpoint; /dev/shm always."""
    plan = inp.plan or inp.host_plan
    if plan is not None:
        yield from _host_memory_for(inp, plan)
    else:
        yield from _host_memory_unsized(inp)
    yield from _host_shm(inp)


def _pinned_what(plan: Plan) -> str:
    """What the plan pins: the QSA K/V pools, and the MTP drafter's weights when placed."""
    if plan.mtp is not None and plan.mtp.fits:
        return "QSA K/V pools and MTP drafter weights"
    return "QSA K/V pools"


def _host_memory_for(inp: PreflightInput, plan: Plan) -> Iterator[Finding]:
    mem = inp.facts.memory
    sized = "" if inp.plan is not None else _SIZED_FOR_PROFILE.format(inp.profile.name)
    need = plan.host_ram_needed_bytes
    pinned = plan.pinned_bytes_needed
    avail = mem.mem_available_bytes
    if avail is None:
        yield Finding(
            "host.ram",
            "warn",
            "unknown",
            f">= {gib(need)}",
            f"{_not_known(inp, 'MemAvailable', 'mem_available_bytes')}: whether "
            f"{gib(need)} fit is unknown",
            f"check /proc/meminfo where vLLM will run; {_RECORD_FACTS}",
            required_bytes=need,
        )
    elif avail < need:
        yield Finding(
            "host.ram",
            "fail",
            f"{gib(avail)} available",
            f">= {gib(need)}",
            f"the plan pins {gib(pinned)} of {_pinned_what(plan)} plus {gib(need - pinned)} "
            f"for the processes, the host has {gib(avail)} available{sized}",
            "free host memory, or lower --kv-cache-memory-bytes (fewer pinned K/V blocks)",
            measured_bytes=avail,
            required_bytes=need,
        )
    else:
        yield _ok(
            "host.ram",
            f"{gib(avail)} available",
            f">= {gib(need)}",
            f"enough host RAM{sized}",
            measured_bytes=avail,
            required_bytes=need,
        )

    soft = mem.memlock_soft_bytes
    if pinned == 0:
        yield _ok("host.memlock", _limit(soft), "any", "nothing pinned beyond defaults")
    elif "memlock_soft_bytes" in mem.unknown:
        yield Finding(
            "host.memlock",
            "warn",
            "unknown",
            f">= {gib(pinned)} or unlimited",
            f"{_not_known(inp, 'RLIMIT_MEMLOCK', 'memlock_soft_bytes')}: whether the pinned "
            f"{_pinned_what(plan)} ({gib(pinned)}) can be locked is unknown",
            f"check `ulimit -l` where vLLM will run (unlimited, or >= {gib(pinned)}); "
            f"{_RECORD_FACTS}",
            required_bytes=pinned,
        )
    elif soft is not None and soft < pinned:
        yield Finding(
            "host.memlock",
            "fail",
            _limit(soft),
            f">= {gib(pinned)} or unlimited",
            f"RLIMIT_MEMLOCK is {_limit(soft)}; the pinned {_pinned_what(plan)} need "
            f"{gib(pinned)}{sized}",
            "raise it: `ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity; podman/docker: "
            "--ulimit memlock=-1:-1)",
            measured_bytes=soft,
            required_bytes=pinned,
        )
    else:
        yield _ok(
            "host.memlock",
            _limit(soft),
            f">= {gib(pinned)} or unlimited",
            f"enough{sized}",
            measured_bytes=soft,  # None: unlimited
            required_bytes=pinned,
        )

    limit = mem.cgroup_memory_limit_bytes
    if "cgroup_memory_limit_bytes" in mem.unknown:
        yield Finding(
            "host.cgroup",
            "warn",
            "unknown",
            f">= {gib(need)} or no limit",
            f"{_not_known(inp, 'the memory cgroup limit', 'cgroup_memory_limit_bytes')}: "
            f"whether the plan's {gib(need)} fit under it is unknown",
            "check memory.max of the cgroup vLLM will run in (podman/docker: --memory); "
            f"{_RECORD_FACTS}",
            required_bytes=need,
        )
    elif limit is not None and limit < need:
        yield Finding(
            "host.cgroup",
            "fail",
            gib(limit),
            f">= {gib(need)} or no limit",
            f"this process's cgroup ({mem.cgroup_version}) is limited to {gib(limit)}, the "
            f"plan needs {gib(need)}: the kernel would OOM-kill vLLM{sized}",
            "raise the limit (podman/docker: --memory or drop it; systemd: MemoryMax=)",
            measured_bytes=limit,
            required_bytes=need,
        )
    else:
        yield _ok(
            "host.cgroup",
            "no limit" if limit is None else gib(limit),
            f">= {gib(need)} or no limit",
            f"cgroup allows the plan{sized}",
            measured_bytes=limit,
            required_bytes=need,
        )


_SIZED_FOR_PROFILE = " (sized for the checkpoint profile {} serves, as no checkpoint was planned)"


def _unsized_because(inp: PreflightInput) -> tuple[str, str]:
    """(fix, why) of the host checks no plan could size: the checkpoint is missing only
    when --model was not given or could not be read; otherwise the plan failed."""
    if inp.model is not None:
        return (
            "fix what the plan check names, then re-run",
            "the plan failed (see the plan check), so it cannot size",
        )
    return (
        "pass --model the checkpoint directory: the plan sizes what the host must hold",
        "without a readable checkpoint (--model) the plan cannot size",
    )


def _host_memory_unsized(inp: PreflightInput) -> Iterator[Finding]:
    """No plan at all: show what the host has; what it needs waits for a checkpoint."""
    mem = inp.facts.memory
    required = "sized by the plan"
    fix, why = _unsized_because(inp)
    yield Finding(
        "host.ram",
        "warn",
        f"{gib(mem.mem_available_bytes)} available",
        required,
        f"{why} the host RAM vLLM needs",
        fix,
        measured_bytes=mem.mem_available_bytes,
    )
    soft = mem.memlock_soft_bytes
    if soft is None and "memlock_soft_bytes" not in mem.unknown:
        yield _ok("host.memlock", "unlimited", "any", "any pinned pool can be locked")
    else:
        shown = "unknown" if "memlock_soft_bytes" in mem.unknown else _limit(soft)
        yield Finding(
            "host.memlock", "warn", shown, required, f"{why} the pinned QSA K/V pools", fix
        )
    limit = mem.cgroup_memory_limit_bytes
    if limit is None and "cgroup_memory_limit_bytes" not in mem.unknown:
        yield _ok("host.cgroup", "no limit", "any", "no memory limit")
    else:
        shown = "unknown" if "cgroup_memory_limit_bytes" in mem.unknown else gib(limit)
        yield Finding(
            "host.cgroup", "warn", shown, required, f"{why} what vLLM needs under it", fix
        )


def _host_shm(inp: PreflightInput) -> Iterator[Finding]:
    mem = inp.facts.memory
    min_shm = inp.profile.memory.min_shm_bytes
    if "shm_total_bytes" in mem.unknown:
        yield Finding(
            "host.shm",
            "warn",
            "unknown",
            f">= {gib(min_shm)}",
            f"{_not_known(inp, 'the size of /dev/shm', 'shm_total_bytes')}: NCCL and vLLM's "
            "broadcast queues live there",
            f"check `df -h /dev/shm` where vLLM will run; {_RECORD_FACTS}",
            required_bytes=min_shm,
        )
    elif mem.shm_total_bytes is None or mem.shm_total_bytes < min_shm:
        yield Finding(
            "host.shm",
            "fail",
            size(mem.shm_total_bytes),
            f">= {gib(min_shm)}",
            "/dev/shm is missing or small: NCCL and vLLM's broadcast queues between the "
            "three ranks live there",
            "in a container pass --ipc=host or --shm-size=8g",
            measured_bytes=mem.shm_total_bytes,
            required_bytes=min_shm,
        )
    else:
        yield _ok(
            "host.shm",
            gib(mem.shm_total_bytes),
            f">= {gib(min_shm)}",
            "enough",
            measured_bytes=mem.shm_total_bytes,
            required_bytes=min_shm,
        )


def _limit(n: int | None) -> str:
    return "unlimited" if n is None else size(n)


_RECORD_FACTS = "to replay facts, record them there with `flashnext facts --out FILE`"


def _facts_lack(inp: PreflightInput, what: str) -> str:
    if inp.facts_source:
        return f"{inp.facts_source} does not record {what}"
    return f"the facts do not record {what}"


def _not_known(inp: PreflightInput, what: str, field: str) -> str:
    """Why a memory fact is unknown: the replayed file lacks it, or the probe failed."""
    if inp.facts_source and field in inp.facts.memory.unknown:
        return _facts_lack(inp, what)
    return f"{what} could not be read ({inp.facts.memory.error or 'no reason given'})"


# ---------------------------------------------------------------- plan


@check
def plan_fits(inp: PreflightInput) -> Iterator[Finding]:
    plan = inp.plan
    if plan is None:
        if inp.model is not None:  # without a model, model.dir already says why
            yield Finding(
                "plan",
                "fail",
                inp.plan_error or "no plan",
                "a plan",
                f"cannot plan: {inp.plan_error}",
                "fix what the message names, then re-run",
            )
        return
    bad = [r for r in plan.ple_ranks if r != 0]
    if bad:
        yield Finding(
            "pp.ple_rank",
            "fail",
            f"PLE layer(s) {list(plan.ple_layers)} on rank(s) {bad}",
            "rank 0",
            "the PLE n-gram embedding needs the raw token ids, which only PP rank 0 has",
            "change VLLM_PP_LAYER_PARTITION so its first entry covers layer "
            f"{max(plan.ple_layers) + 1} or more (default: unset)",
        )
    else:
        yield _ok(
            "pp.ple_rank",
            f"PLE on rank {list(plan.ple_ranks)}",
            "rank 0",
            f"partition {[e - s for s, e in plan.pp_ranges]}",
        )
    yield from _kv_capacity(inp)
    for r in plan.ranks:
        if r.headroom_bytes < 0:
            yield Finding(
                f"rank{r.rank}.vram",
                "fail",
                gib(r.committed_bytes),
                f"<= {gib(r.vram_usable_bytes)}",
                f"rank {r.rank} needs {gib(r.committed_bytes)} (weights {gib(r.weight_bytes)}, KV "
                f"{gib(r.kv_cache_bytes)}), more than its usable {gib(r.vram_usable_bytes)}",
                "lower --kv-cache-memory-bytes or rebalance with VLLM_PP_LAYER_PARTITION",
                measured_bytes=r.committed_bytes,
                required_bytes=r.vram_usable_bytes,
            )
        else:
            yield _ok(
                f"rank{r.rank}.vram",
                gib(r.committed_bytes),
                f"<= {gib(r.vram_usable_bytes)}",
                f"headroom {gib(r.headroom_bytes)}",
                measured_bytes=r.committed_bytes,
                required_bytes=r.vram_usable_bytes,
            )
    yield from _start_peaks(inp)
    yield from _mtp_fit(inp)


def _start_peaks(inp: PreflightInput) -> Iterator[Finding]:
    """Each card's free memory against what its rank was measured to take while
    starting (the profile's rank-fit figures; the plan's budget does not hold the
    load-time repack). A warning: the figures are an H200's, an upper bound."""
    peaks = inp.profile.memory.measured_start_peak_bytes
    devices = sorted(inp.facts.gpu.devices, key=lambda d: d.index)
    if not peaks or len(peaks) != len(inp.plan.ranks) or len(devices) < len(peaks):
        return
    for rank, (peak, d) in enumerate(zip(peaks, devices, strict=False)):
        tag = f"rank{rank}.start"
        if d.memory_free_bytes >= peak:
            yield _ok(tag, f"GPU {d.index}: {gib(d.memory_free_bytes)} free", f">= {gib(peak)}",
                      f"start peak measured {gib(peak)}",
                      measured_bytes=d.memory_free_bytes, required_bytes=peak)  # fmt: skip
            continue
        yield Finding(
            tag,
            "warn",
            f"GPU {d.index}: {gib(d.memory_free_bytes)} free",
            f">= {gib(peak)}",
            f"rank {rank} was measured to take up to {gib(peak)} while loading (vLLM's MoE "
            f"repack, checks/gpu/RESULTS.md run r7); GPU {d.index} has "
            f"{gib(d.memory_free_bytes)} free, so the start may run out of memory",
            f"free memory on GPU {d.index} (nvidia-smi lists what holds it: a display server "
            "or another process)",
            measured_bytes=d.memory_free_bytes,
            required_bytes=peak,
        )


def _mtp_fit(inp: PreflightInput) -> Iterator[Finding]:
    """The profile asks for MTP: the drafter must fit on the last rank (plan/mtp.py),
    loading (its pass through VRAM) and serving (the KV pool it shares)."""
    mtp = inp.plan.mtp
    if mtp is None:
        return
    load = mtp.load
    off = "--mtp 0 (serve without MTP)"
    if load is None:  # no MTP tensors
        yield Finding("mtp.fit", "fail", "no MTP tensors", "an MTP layer (mtp.*)",
                      f"MTP does not fit: {mtp.reason}", off)  # fmt: skip
        return
    if mtp.fits:
        yield _ok("mtp.fit", f"{gib(load.transient_bytes)} while loading",
                  f"<= {gib(load.room_bytes)} on rank {mtp.rank}", mtp.reason,
                  measured_bytes=load.transient_bytes, required_bytes=load.room_bytes)  # fmt: skip
        return
    if not load.fits:
        yield Finding(
            "mtp.fit",
            "fail",
            f"{gib(load.transient_bytes)} while loading",
            f"<= {gib(load.room_bytes)} on rank {mtp.rank}",
            f"MTP does not fit: {mtp.reason}",
            f"{INT4_FIX} --model {inp.model_dir or 'MODEL_DIR'}" if mtp.experts_bf16 else off,
            measured_bytes=load.transient_bytes,
            required_bytes=load.room_bytes,
        )
        return
    cap = mtp.requests
    longest = cap.longest_request_tokens if cap is not None else 0
    yield Finding(
        "mtp.fit",
        "fail",
        f"{cap.usable_blocks if cap else 0} KV blocks with the drafter",
        f">= {cap.blocks_per_request if cap else 1} (one request of "
        f"{inp.plan.max_model_len.value} tokens)",
        f"MTP does not fit: {mtp.reason}",
        f"{off}, or --max-model-len {longest}" if longest else off,
    )


def _kv_capacity(inp: PreflightInput) -> Iterator[Finding]:
    """Requests of --max-model-len tokens the pool holds, counted in blocks as vLLM
    counts them: each takes its K/V blocks and, whatever its length, its state blocks
    (qsa_sizing.RequestCapacity)."""
    cap, seqs = inp.plan.kv_capacity, inp.profile.scheduler.max_num_seqs
    if cap is None:
        return
    max_len, per = cap.max_model_len, cap.blocks_per_request
    each = (
        f"a full-length request (--max-model-len {max_len}) takes {per} blocks of "
        f"{cap.block_size_tokens} tokens "
        f"({cap.kv_blocks_per_request} of K/V, {cap.state_blocks_per_request} of GDN, PLE and "
        f"ring state), the pool has {cap.usable_blocks}"
    )
    vllm = f"vLLM: {cap.max_concurrency:.2f}x, {cap.kv_cache_tokens} tokens"
    if not cap.starts:
        longest = cap.longest_request_tokens
        yield Finding(
            "kv.capacity",
            "fail",
            f"{cap.usable_blocks} blocks",
            f">= {per} (one request of {max_len} tokens)",
            f"{each}: vLLM refuses to start",
            "raise --kv-cache-memory-bytes"
            + (f", or lower --max-model-len to {longest}" if longest else ""),
        )
    elif cap.full_length_requests < seqs:
        yield Finding(
            "kv.capacity",
            "warn",
            f"{cap.full_length_requests} full-length requests",
            f">= {seqs} (--max-num-seqs)",
            f"{each}: {cap.full_length_requests} run at once, more queue ({vllm}); shorter "
            "requests fit more",
            f"accept it, or --max-model-len {cap.longest_for(seqs)} for {seqs} at once"
            if cap.longest_for(seqs)
            else "accept it, or raise --kv-cache-memory-bytes if VRAM allows",
        )
    else:
        yield _ok(
            "kv.capacity",
            f"{cap.full_length_requests} full-length requests",
            f">= {seqs}",
            f"{each}: {seqs} fit ({vllm})",
        )


# ---------------------------------------------------------------- model


@check
def model(inp: PreflightInput) -> Iterator[Finding]:
    if not inp.model_dir:
        yield Finding(
            "model.dir",
            "fail",
            "not given",
            "a checkpoint directory",
            "no model directory was given",
            "pass --model DIR (or `flashnext skeleton DIR` to plan before downloading)",
        )
        return
    if inp.model is None and inp.model_missing:
        repo = inp.profile.checkpoint.hub_repo
        where = shlex.quote(inp.model_dir)
        get = f"; to download it there: `hf download {repo} --local-dir {where}`"
        yield Finding(
            "model.dir",
            "fail",
            "no such directory",
            "a complete checkpoint",
            inp.model_error or f"{inp.model_dir}: no such directory",
            "check the path: --model is the checkpoint directory (config.json, *.safetensors)"
            + (get if repo else ""),
        )
        return
    if inp.model is None:
        fix = inp.model_error_fix
        # The reader's message ends with its fix; the finding says it once, as the fix.
        error = inp.model_error.removesuffix(f"; {fix}") if inp.model_error and fix else None
        yield Finding(
            "model.dir",
            "fail",
            error or inp.model_error or "unreadable",
            "a complete checkpoint",
            error or inp.model_error or "the checkpoint could not be read",
            fix or "re-download the missing or damaged files (`hf download` resumes)",
        )
        return
    m = inp.model
    yield _ok(
        "model.dir",
        f"{len(m.shards)} shards, {len(m.tensors)} tensors",
        "a complete checkpoint",
        "all shards present, headers parse",
    )
    text_type = m.text_config.get("model_type", "")
    if m.model_type != EXPECTED_ARCH and not str(text_type).startswith(EXPECTED_ARCH):
        yield Finding(
            "model.arch",
            "fail",
            f"{m.model_type} {list(m.architectures)}",
            EXPECTED_ARCH,
            f"this kit serves {EXPECTED_ARCH} checkpoints only",
            "point --model at the Qwen3.8-Flash-Next checkpoint",
        )
    else:
        yield _ok("model.arch", str(m.model_type), EXPECTED_ARCH, "architecture")
    yield from _quant_groups(inp)
    yield from _sampling_keys(inp)


def _quant_groups(inp: PreflightInput) -> Iterator[Finding]:
    """The duplicate-target half of `checkpoint check`: vLLM's scheme map as
    SchemeMap builds it, without reading the stored modules (0.6 s of plan time)."""
    # Here, not at the top: flashnext.checkpoint imports this package (its Finding).
    from flashnext.facts.scheme_map import SchemeMap

    qcfg = inp.model.quantization_config or {}
    groups = qcfg.get("config_groups") or {}
    shared = SchemeMap.from_config(qcfg).duplicates
    if shared:
        target, names = next(iter(sorted(shared.items())))
        yield Finding(
            "model.quant_groups",
            "fail",
            f"target {target!r} in groups {names}",
            "each target in one group",
            f"vLLM keys schemes by target, so only group {names[-1]!r} applies: the INT4 "
            "experts would be read with the wrong scheme",
            f"flashnext checkpoint fix --model {inp.model_dir}",
        )
    else:
        yield _ok(
            "model.quant_groups",
            f"{len(groups)} groups",
            "each target in one group",
            "quantization groups are unambiguous",
        )


def _sampling_keys(inp: PreflightInput) -> Iterator[Finding]:
    if inp.generation_config_dir:
        yield from _given_generation_config(inp)
        return
    present = sampling_keys_present(inp.model.generation_config)
    if present:
        yield _ok("model.sampling", ", ".join(present), "sampling keys", "defaults present")
        return
    neutral = sampling_keys_restoring_nothing(inp.model.generation_config)
    yield Finding(
        "model.sampling",
        "fail",
        f"only {neutral}" if neutral else "no sampling keys",
        ", ".join(VLLM_SAMPLING_KEYS[:4]) + ", ...",
        (
            f"generation_config.json sets only {neutral}, which restore nothing"
            if neutral
            else "generation_config.json has no sampling keys"
        )
        + ": vLLM falls back to temperature 1, top_p 1, top_k 0 over 248k tokens and output "
        "degrades",
        f"flashnext checkpoint fix --model {inp.model_dir} --generation-config-from "
        "<dir of the original release>",
    )


def _given_generation_config(inp: PreflightInput) -> Iterator[Finding]:
    """--generation-config DIR replaces the checkpoint's own: judge DIR's file."""
    given = inp.generation_config_dir
    required = ", ".join(VLLM_SAMPLING_KEYS[:4]) + ", ..."
    fix = (
        "pass --generation-config a directory holding the published generation_config.json "
        "(with temperature, top_p, top_k), or leave it out to use the checkpoint's own"
    )
    if inp.generation_config_error:
        yield Finding(
            "model.sampling",
            "fail",
            "unreadable",
            required,
            f"{inp.generation_config_error}: vLLM would serve without sampling defaults",
            fix,
        )
        return
    present = sampling_keys_present(inp.generation_config)
    if present:
        yield _ok(
            "model.sampling",
            ", ".join(present),
            "sampling keys",
            f"from --generation-config {given}",
        )
        return
    neutral = sampling_keys_restoring_nothing(inp.generation_config)
    yield Finding(
        "model.sampling",
        "fail",
        f"only {neutral}" if neutral else "no sampling keys",
        required,
        f"{Path(given) / 'generation_config.json'} sets "
        + (
            f"only {neutral}, which restore nothing"
            if neutral
            else f"none of {', '.join(VLLM_SAMPLING_KEYS)}"
        )
        + ": vLLM falls back to temperature 1, top_p 1, top_k 0 and output degrades",
        fix,
    )


# ---------------------------------------------------------------- PLE table


@check
def table(inp: PreflightInput) -> Iterator[Finding]:
    if not inp.table_path:
        yield Finding(
            "table.path",
            "fail",
            "not given",
            "the PLE table file",
            "no PLE table path was given",
            "pass --table FILE (make it with `flashnext table prepare`)",
        )
        return
    st = inp.facts.storage.get("table")
    if inp.facts_source and (st is None or not _same_path(st.path, inp.table_path)):
        recorded = "no table storage" if st is None else f"the storage of {st.path}"
        yield Finding(
            "table.path",
            "warn",
            "not in the facts" if st is None else f"facts for {st.path}",
            inp.table_path,
            f"{inp.facts_source} records {recorded}, not of {inp.table_path}: its size, "
            "manifest and medium are unknown",
            "record facts for it on the serving host (`flashnext facts --table "
            f"{inp.table_path} --out FILE`) and pass --facts FILE"
            + ("" if st is None else f", or pass --table {st.path}"),
        )
        return
    partial = _interrupted_prepare(inp)
    if partial is not None:
        yield partial
        return
    if st is None or not st.exists:
        yield Finding(
            "table.path",
            "fail",
            "missing",
            inp.table_path,
            f"{inp.table_path} does not exist",
            f"flashnext table prepare --model {inp.model_dir or 'DIR'} --out {inp.table_path}",
        )
        return
    if not st.is_regular_file:
        yield Finding(
            "table.path",
            "fail",
            "not a regular file",
            "a regular file",
            f"{inp.table_path} is not a regular file",
            "point --table at the flat file",
        )
        return
    if not st.readable:
        yield Finding(
            "table.readable",
            "fail",
            "not readable",
            "readable",
            f"{inp.table_path} cannot be read by this user",
            f"chmod a+r {inp.table_path}",
        )
    yield from _table_size(inp, st)
    yield from _table_medium(inp, st)


def _interrupted_prepare(inp: PreflightInput) -> Finding | None:
    """--table names an interrupted prepare's partial copy or journal: say so, and resume
    (a size or manifest finding's "remove it" would throw the copy away)."""
    final = interrupted_prepare_output(inp.table_path)
    if final is None:
        return None
    return Finding(
        "table.path", "fail", "an interrupted prepare's partial", "the finished table",
        partial_message(inp.table_path, final, inp.model_dir),
        f"flashnext table prepare --model {inp.model_dir or 'DIR'} --out {final}",
    )  # fmt: skip


def _manifest_sizes_disagree(doc: dict[str, Any], row_bytes: int, total: int) -> str | None:
    """What verify also checks: the manifest's row_bytes and total_bytes are the shape's."""
    for key, want in (("row_bytes", row_bytes), ("total_bytes", total)):
        if doc.get(key) != want:
            return f"{key} is {doc.get(key)!r}, the checkpoint implies {want}"
    return None


def _same_path(recorded: str, asked: str) -> bool:
    return os.path.normpath(recorded) == os.path.normpath(os.path.abspath(asked))


def _table_size(inp: PreflightInput, st: StorageFacts) -> Iterator[Finding]:
    if inp.table_shape is None:
        if inp.table_shape_error:
            yield Finding(
                "table.size",
                "fail",
                "unknown",
                "the shape config.json implies",
                f"cannot tell the PLE table's shape: {inp.table_shape_error}",
                "restore config.json from the published checkpoint",
            )
        return
    rows, cols = inp.table_shape
    row_bytes = cols * 2  # BF16
    # Either layout `table prepare` writes; vLLM checks the one its manifest names.
    fits = layouts_matching(st.size_bytes, rows, row_bytes)
    if not fits:
        yield Finding(
            "table.size",
            "fail",
            f"{st.size_bytes} bytes",
            f"{both_sizes(rows, row_bytes)} ([{rows}, {cols}] BF16)",
            f"{inp.table_path} is {st.size_bytes} bytes, not the [{rows}, {cols}] BF16 table "
            f"the model config implies in either layout ({both_sizes(rows, row_bytes)}): "
            "a truncated copy or another model's table",
            f"remove it and rerun `flashnext table prepare --model {inp.model_dir} "
            f"--out {inp.table_path}` (add --layout page-aligned for the page-aligned layout)",
            measured_bytes=st.size_bytes,
            required_bytes=table_bytes(rows, row_bytes, PACKED),
        )
    else:
        yield from _table_manifest(inp, st, fits)


def _table_manifest(inp: PreflightInput, st: StorageFacts, fits: list[str]) -> Iterator[Finding]:
    """The size fits a layout; vLLM reads which one from the manifest (none: packed)."""
    rows, cols = inp.table_shape
    row_bytes = cols * 2
    shape = f"[{rows}, {cols}] BF16"
    measured = f"{st.size_bytes} bytes"
    table = inp.table_path
    m = st.manifest
    name = Path(m.path).name if m else f"{Path(table).name}.json"
    redo = (
        f"remove {table} and {name} and rerun `flashnext table prepare --model "
        f"{inp.model_dir} --out {table}`"
    )
    if m is None:
        yield Finding(
            "table.size",
            "warn",
            measured,
            shape,
            f"{_facts_lack(inp, f'the table manifest ({name})')}, as facts from a flashnext "
            f"before manifests were read: whether vLLM takes the file as {fits[0]} is unknown",
            f"record facts with this flashnext on the serving host (`flashnext facts --table "
            f"{table} --out FILE`)",
        )
        return
    if not m.exists:
        if PACKED in fits:
            yield _ok("table.size", measured, shape, "exact size (packed layout, no manifest)")
            return
        yield Finding(
            "table.size",
            "fail",
            measured,
            f"{table_bytes(rows, row_bytes, PACKED)} bytes (packed: no manifest)",
            f"{table} has no manifest ({name}), so vLLM reads it as packed: "
            f"{table_bytes(rows, row_bytes, PACKED)} bytes, but it is {st.size_bytes} bytes "
            f"(the {fits[0]} size: its manifest is missing)",
            f"restore {name} from where the table was prepared, or remove {table} and rerun "
            f"`flashnext table prepare --model {inp.model_dir} --out {table} --layout {fits[0]}`",
        )
        return
    doc = m.doc or {}
    layout = doc.get("layout", PACKED)
    if m.error or layout not in LAYOUTS:
        why = m.error or f"layout is {layout!r}, not one of {', '.join(LAYOUTS)}"
        yield Finding(
            "table.size",
            "fail",
            f"{name}: unreadable" if m.error else f"{name}: layout {layout!r}",
            shape,
            f"{m.path}: {why}: vLLM refuses to load the table",
            rewrite_fix(inp.model_dir or "DIR", table),
        )
        return
    found = (doc.get("rows"), doc.get("dim"), doc.get("dtype"))
    if found != (rows, cols, "BF16"):
        yield Finding(
            "table.size",
            "fail",
            f"{name}: [{found[0]}, {found[1]}] {found[2]}",
            shape,
            f"{name} describes [{found[0]}, {found[1]}] {found[2]} rows, the model config "
            f"implies {shape}: vLLM refuses the table",
            redo,
        )
        return
    want = table_bytes(rows, row_bytes, layout)
    if st.size_bytes != want:
        yield Finding(
            "table.size",
            "fail",
            measured,
            f"{want} bytes ({layout}, per {name})",
            f"{table} is {st.size_bytes} bytes, but {name} says the {layout} layout: {want} "
            f"bytes for {shape}; vLLM refuses it (the size is the {fits[0]} one: the manifest "
            "is stale)",
            redo,
        )
        return
    lie = _manifest_sizes_disagree(doc, row_bytes, want)
    if lie:
        yield Finding("table.size", "fail", f"{name}: {lie.split(',')[0]}", shape,
                      f"{m.path}: {lie}: the manifest does not describe this table",
                      rewrite_fix(inp.model_dir or "DIR", table))  # fmt: skip
        return
    yield _ok("table.size", measured, shape, f"exact size ({layout} layout, per {m.path})")


def _table_medium(inp: PreflightInput, st: StorageFacts) -> Iterator[Finding]:
    where = f"{st.mount_point} ({st.fs_type}, {st.transport})"
    fix = "move the table to a local NVMe filesystem (ext4/xfs) and pass its new path"
    # One policy for `table prepare` and preflight: flashnext.table.storage_policy.
    refusal = storage_refusal(st)
    if refusal and inp.profile.table.medium_check == "warn":
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            f'{refusal} (profile {inp.profile.name} accepts it: table.medium_check = "warn")',
            fix,
        )
    elif refusal:
        yield Finding("table.medium", "fail", where, "local NVMe", refusal, fix)
    elif st.transport == "nvme":
        yield _ok("table.medium", where, "local NVMe", "random reads at NVMe latency")
    elif st.transport == "sata":
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            "a SATA SSD serves the random row reads, but cold prefills will be slower",
            fix,
        )
    else:
        yield Finding(
            "table.medium",
            "warn",
            where,
            "local NVMe",
            f"the table's device ({st.transport}) is not a local NVMe drive",
            fix,
        )


# ---------------------------------------------------------------- the vLLM serve starts


@check
def vllm_env(inp: PreflightInput) -> Iterator[Finding]:
    """The vLLM serve would exec: importable, the pinned version, this checkout's patches."""
    env = inp.vllm_env
    if env is None:
        return
    series = inp.patch_series
    required = (
        f"vLLM {VLLM_VERSION} + the {len(series)} patches of patches/vllm-{VLLM_VERSION}"
        if series is not None
        else f"vLLM {VLLM_VERSION} + the flashnext patches"
    )
    where = env.executable or env.env_dir or "-"
    use_pinned = _use_pinned_env(inp)
    if env.selected_by == "none":
        built = f", and {inp.build_env} has not built the pinned env here" if inp.build_env else ""
        yield Finding(
            "vllm.env",
            "fail",
            "no vLLM found",
            required,
            "no vLLM to start: --vllm-env and FLASHNEXT_VLLM_ENV are unset, no `vllm` is on "
            f"PATH{built}",
            (
                f"{inp.build_env} (builds the pinned, patched env: {BUILD_DOWNLOAD_TEXT}, "
                f"{BUILD_INSTALLED_TEXT}; `flashnext serve` runs it itself)"
            )
            if inp.build_env
            else use_pinned,
        )
        return
    if env.error:
        yield Finding(
            "vllm.env",
            "fail",
            "not usable",
            required,
            f"the vLLM chosen by {env.selected_by} ({where}): {env.error}",
            use_pinned,
        )
        return
    if env.version != VLLM_VERSION:
        yield Finding(
            "vllm.env",
            "fail",
            f"vLLM {env.version}",
            required,
            f"{where} ({env.selected_by}) runs vLLM {env.version} from {env.package_dir}; "
            f"the patch series is written for {VLLM_VERSION}",
            use_pinned,
        )
        return
    if env.stamp_error:
        yield Finding(
            "vllm.env",
            "fail",
            "unreadable patch stamp",
            required,
            f"{env.package_dir}/_flashnext_patches.json cannot be read: {env.stamp_error}",
            use_pinned,
        )
        return
    if env.stamp is None:
        yield Finding(
            "vllm.env",
            "fail",
            f"stock vLLM {env.version}",
            required,
            f"{where} ({env.selected_by}) runs a stock vLLM from {env.package_dir} (no "
            "_flashnext_patches.json): it refuses qwen4_exp under PP=3 and has neither the "
            "PLE table file nor the QSA offload",
            use_pinned,
        )
        return
    applied = tuple((p.get("name"), p.get("sha256")) for p in env.stamp.get("patches") or ())
    stamped_for = env.stamp.get("vllm_version")
    if stamped_for != VLLM_VERSION or (series is not None and applied != series):
        yield Finding(
            "vllm.env",
            "fail",
            f"stale: {_stamp_difference(applied, series, stamped_for)}",
            required,
            f"{env.package_dir} ({env.selected_by}) was patched with another series than this "
            "checkout's: it runs other code than the one proven here",
            use_pinned,
        )
        return
    compared = (
        "equal to this checkout's series"
        if series is not None
        else "no checkout series to compare (an installed launcher ships with its env)"
    )
    yield _ok(
        "vllm.env",
        f"vLLM {env.version}, {len(applied)} patches",
        required,
        f"{where} ({env.selected_by}); stamp {compared}",
    )


def _use_pinned_env(inp: PreflightInput) -> str:
    if inp.build_env:
        return (
            f'pass --vllm-env "$({inp.build_env} | tail -1)" (builds the pinned, patched env '
            "or reuses the built one)"
        )
    return (
        "pass --vllm-env DIR of an env built by pins/build-env in a flashnext checkout, or "
        "run the Nix app or the image, which carry theirs"
    )


def _stamp_difference(
    applied: tuple[tuple[Any, Any], ...], series: tuple[tuple[str, str], ...] | None, version: Any
) -> str:
    if version != VLLM_VERSION:
        return f"stamped for vLLM {version}"
    names = {n for n, _ in applied}
    for name, digest in series or ():
        if name not in names:
            return f"{name} not applied"
        if (name, digest) not in applied:
            return f"{name} changed since"
    extra = [n for n, _ in applied if n not in {n for n, _ in series or ()}]
    return f"{extra[0]} not in the series" if extra else "patch order differs"


# ---------------------------------------------------------------- port


@check
def port(inp: PreflightInput) -> Iterator[Finding]:
    probed = [p for p in inp.facts.ports if (p.host, p.port) == (inp.host, inp.port)]
    if not probed:
        held = ", ".join(f"{p.host}:{p.port}" for p in inp.facts.ports) or "none"
        yield Finding(
            "port",
            "warn",
            "unknown",
            "free",
            f"{_facts_lack(inp, f'a probe of {inp.host}:{inp.port}')} (it has {held}): "
            "whether the API can bind is unknown",
            f"record facts with `flashnext facts --host {inp.host} --port {inp.port} --out FILE` "
            "on the serving host and pass --facts FILE",
        )
    for p in probed:
        if p.free:
            yield _ok("port", f"{p.host}:{p.port} free", "free", "the API can bind")
        elif p.error:  # the probe could not answer (bad address, no permission)
            yield Finding(
                "port",
                "fail",
                f"{p.host}:{p.port}: {p.error}",
                "bindable",
                f"cannot bind {p.host}:{p.port}: {p.error}",
                "pass --host with an address of this machine, or a --port above 1023",
            )
        else:
            yield Finding(
                "port",
                "fail",
                f"{p.host}:{p.port} in use",
                "free",
                f"{p.host}:{p.port} is taken ({p.error or 'in use'})",
                f"stop what listens there (`ss -ltnp 'sport = :{p.port}'`) or pass --port N",
            )
