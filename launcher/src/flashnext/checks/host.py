"""Host memory against the plan: available RAM, RLIMIT_MEMLOCK for the pinned pools,
the memory cgroup, and /dev/shm."""

from __future__ import annotations

from collections.abc import Iterator

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import _RECORD_FACTS, PreflightInput, _facts_lack, _ok
from flashnext.plan.planner import Plan
from flashnext.units import gib, size


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


def _not_known(inp: PreflightInput, what: str, field: str) -> str:
    """Why a memory fact is unknown: the replayed file lacks it, or the probe failed."""
    if inp.facts_source and field in inp.facts.memory.unknown:
        return _facts_lack(inp, what)
    return f"{what} could not be read ({inp.facts.memory.error or 'no reason given'})"
