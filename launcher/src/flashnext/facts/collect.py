"""collect_host_facts: run every host probe once and assemble HostFacts.

This is the one entry point that touches the host; the result is plain data
that checks and plan consume, and that `flashnext facts --json` writes out.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from types import ModuleType

from flashnext.facts.gpu import probe_gpus
from flashnext.facts.host import in_container, probe_memory, probe_numa
from flashnext.facts.manifest import probe_manifest
from flashnext.facts.ports import probe_port
from flashnext.facts.schema import HostFacts
from flashnext.facts.storage import probe_storage
from flashnext.units import gib as _gib


def collect_host_facts(
    storage: Mapping[str, str | os.PathLike[str]] | None = None,
    ports: Sequence[tuple[str, int]] = (),
    *,
    nvml: ModuleType | None = None,
    proc: str = "/proc",
    sys: str = "/sys",
    root: str = "/",
) -> HostFacts:
    """Probe memory, GPUs, the storage under each role's path ("table", "model") and ports.

    `nvml`, `proc`, `sys` and `root` exist for tests (a replayed NVML, synthetic trees).
    """
    return HostFacts(
        collected_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        hostname=socket.gethostname(),
        kernel=os.uname().release,
        in_container=in_container(proc, root),
        memory=probe_memory(proc, root),
        gpu=probe_gpus(nvml, sys),
        storage={
            role: _probe_role(role, path, proc, sys)
            for role, path in sorted((storage or {}).items())
        },
        ports=tuple(probe_port(host, port) for host, port in ports),
        numa=probe_numa(proc, sys),
    )


def _probe_role(role: str, path: str | os.PathLike[str], proc: str, sys: str):
    facts = probe_storage(path, proc, sys)
    if role == "table":  # vLLM learns the table's layout from its manifest
        facts = dataclasses.replace(facts, manifest=probe_manifest(path))
    return facts


# ---------------------------------------------------------------- for people


def _size(n: int | None) -> str:
    """GiB for big figures; MiB/KiB for small limits (memlock is often 8 MiB)."""
    if n is None or n >= 1 << 30 or n == 0:
        return _gib(n)
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.0f} KiB"


def _limit(n: int | None, unknown: bool = False) -> str:
    if unknown:
        return "unknown"
    return "unlimited" if n is None else _size(n)


def _numa(facts: HostFacts) -> str:
    n = facts.numa
    if not n.nodes:
        return f"unknown ({n.error})" if n.error else "unknown"
    nodes = ",".join(map(str, n.nodes))
    mems = ",".join(map(str, n.mems_allowed)) or "?"
    return f"{nodes} ({mems})"


def _spin(rotational: bool | None) -> str:
    return {True: "rotational", False: "solid-state", None: "?"}[rotational]


def host_facts_tables(facts: HostFacts) -> list[tuple[str, list[str], list[list[object]]]]:
    """(title, columns, rows) for each table `flashnext facts` prints."""
    m = facts.memory
    tables: list[tuple[str, list[str], list[list[object]]]] = []
    tables.append(
        (
            "Host",
            ["fact", "value"],
            [
                ["hostname", facts.hostname],
                ["kernel", facts.kernel],
                ["in container", "yes" if facts.in_container else "no"],
                ["collected at", facts.collected_at],
            ],
        )
    )
    hugepages = (
        "-"
        if m.hugepages_total is None
        else f"{m.hugepages_free}/{m.hugepages_total} free x {_size(m.hugepage_size_bytes)}"
    )
    memory_rows: list[list[object]] = [
        ["RAM total", _gib(m.mem_total_bytes)],
        ["RAM available", _gib(m.mem_available_bytes)],
        ["swap total / free", f"{_gib(m.swap_total_bytes)} / {_gib(m.swap_free_bytes)}"],
        ["hugepages", hugepages],
        [
            "cgroup memory limit",
            f"{_limit(m.cgroup_memory_limit_bytes, 'cgroup_memory_limit_bytes' in m.unknown)} "
            f"({m.cgroup_version or 'no memory cgroup'})",
        ],
        [
            "RLIMIT_MEMLOCK soft / hard",
            f"{_limit(m.memlock_soft_bytes, 'memlock_soft_bytes' in m.unknown)} / "
            f"{_limit(m.memlock_hard_bytes, 'memlock_hard_bytes' in m.unknown)}",
        ],
        ["/dev/shm total / free", f"{_gib(m.shm_total_bytes)} / {_gib(m.shm_free_bytes)}"],
        ["yama ptrace_scope", "not present" if m.ptrace_scope is None else m.ptrace_scope],
        ["CPUs usable", m.cpu_count],
        ["NUMA nodes (allocates on)", _numa(facts)],
    ]
    if m.error:
        memory_rows.append(["probe error", m.error])
    tables.append(("Memory", ["fact", "value"], memory_rows))

    g = facts.gpu
    if not g.nvml_available:
        tables.append(("GPUs", ["fact", "value"], [["NVML", f"unavailable: {g.error}"]]))
    else:
        rows: list[list[object]] = []
        for d in g.devices:
            procs = ", ".join(
                f"{p.pid} {p.name or '?'} {_gib(p.used_memory_bytes)}" for p in d.processes
            )
            rows.append(
                [
                    d.index,
                    d.name,
                    f"{_gib(d.memory_free_bytes)} / {_gib(d.memory_total_bytes)}",
                    d.compute_capability,
                    f"Gen{d.pcie_gen_current or '?'} x{d.pcie_width_current or '?'} "
                    f"(max Gen{d.pcie_gen_max or '?'} x{d.pcie_width_max or '?'})",
                    {True: "on", False: "off", None: "-"}[d.persistence_mode],
                    "-" if d.numa_node is None else d.numa_node,
                    procs or "none",
                ]
            )
        title = (
            f"GPUs: {len(g.devices)} (driver {g.driver_version or '?'}, "
            f"CUDA {g.cuda_driver_version or '?'})"
        )
        if g.error:
            title += f" - {g.error}"
        tables.append(
            (
                title,
                ["#", "name", "free / total", "cc", "PCIe now (max)", "persist", "NUMA", "procs"],
                rows,
            )
        )
        if g.p2p:
            p2p_rows = [[p.gpu_a, p.gpu_b, p.status] for p in g.p2p]
            tables.append(("GPU P2P read", ["from", "to", "status"], p2p_rows))

    storage_rows = []
    for role, s in sorted(facts.storage.items()):
        if not s.exists:
            what = "missing"
        elif s.is_regular_file:
            what = f"file, {s.size_bytes} bytes"
        else:
            what = "directory"
        if s.exists and not s.readable:
            what += ", not readable"
        devices = ", ".join(f"{d.name} ({d.transport}, {_spin(d.rotational)})" for d in s.devices)
        storage_rows.append(
            [
                role,
                s.path,
                what,
                f"{s.mount_point or '-'} ({s.fs_type or '?'} from {s.mount_source or '?'})",
                s.transport,
                devices or "-",
                _gib(s.free_bytes),
                s.error,
            ]
        )
    if storage_rows:
        tables.append(
            (
                "Storage",
                ["role", "path", "is", "mount", "medium", "leaf devices", "free", "error"],
                storage_rows,
            )
        )
    if facts.ports:
        tables.append(
            (
                "Ports",
                ["address", "free", "error"],
                [[f"{p.host}:{p.port}", "yes" if p.free else "no", p.error] for p in facts.ports],
            )
        )
    return tables
