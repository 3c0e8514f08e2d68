"""Host memory probe: /proc/meminfo, the memory cgroup, RLIMIT_MEMLOCK, /dev/shm, Yama, CPUs.

These bound what the serving stack may allocate on the host: the QSA pool and
the PLE page cache live in RAM, pinned buffers count against RLIMIT_MEMLOCK,
NCCL and vLLM's IPC use /dev/shm, and CUDA IPC between ranks needs ptrace
rights under Yama. Paths are parameters so tests can use synthetic trees.
`probe_memory` never raises: what cannot be read is None, and `error` says why.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable

from flashnext.facts.schema import MemoryFacts, NumaFacts
from flashnext.facts.storage import Mount, parse_mountinfo

# memory.limit_in_bytes (v1) reads as PAGE_COUNTER_MAX pages when unset
# (9223372036854771712 on 4 KiB pages); anything this large means "no limit".
CGROUP_V1_UNLIMITED_THRESHOLD = 1 << 62

_MEMINFO_FIELDS = {
    "MemTotal": ("mem_total_bytes", 1024),
    "MemAvailable": ("mem_available_bytes", 1024),
    "SwapTotal": ("swap_total_bytes", 1024),
    "SwapFree": ("swap_free_bytes", 1024),
    "HugePages_Total": ("hugepages_total", 1),  # a page count, not kB
    "HugePages_Free": ("hugepages_free", 1),
    "Hugepagesize": ("hugepage_size_bytes", 1024),
}


def _read_text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def parse_meminfo(text: str) -> dict[str, int]:
    """MemoryFacts field → value from /proc/meminfo text ("MemTotal: 123 kB" lines)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key not in _MEMINFO_FIELDS:
            continue
        field, scale = _MEMINFO_FIELDS[key]
        words = rest.split()
        if words and words[0].isdigit():
            out[field] = int(words[0]) * scale
    return out


# ---------------------------------------------------------------- cgroups


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """(v1 memory cgroup path, v2 unified path) from /proc/self/cgroup."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v1, v2


def _cgroup_dir(mount: Mount, cgroup_path: str, root: str) -> str:
    """Directory of `cgroup_path` inside `mount`, seen from filesystem root `root`.

    /proc/self/cgroup paths are relative to the hierarchy's root; the mount may
    show only a subtree (containers, cgroup namespaces), given by its root field.
    """
    rel = cgroup_path
    if mount.root != "/" and (rel == mount.root or rel.startswith(mount.root.rstrip("/") + "/")):
        rel = rel[len(mount.root) :]
    return os.path.join(root, mount.mount_point.lstrip("/"), rel.lstrip("/"))


LimitParser = Callable[[str], "int | None"]


def _tightest_limit(leaf: str, top: str, filename: str, parse: LimitParser) -> int | None:
    """Smallest limit in `filename` from `leaf` up to `top` (a parent's limit binds children)."""
    limits = []
    current = os.path.normpath(leaf)
    top = os.path.normpath(top)
    while True:
        try:
            value = parse(_read_text(os.path.join(current, filename)).strip())
        except (OSError, ValueError):
            value = None
        if value is not None:
            limits.append(value)
        if current == top or len(current) <= len(top):
            break
        current = os.path.dirname(current)
    return min(limits) if limits else None


def _parse_v1_limit(text: str) -> int | None:
    value = int(text)
    return None if value >= CGROUP_V1_UNLIMITED_THRESHOLD else value


def _parse_v2_limit(text: str) -> int | None:
    return None if text == "max" else int(text)


def _limit_or_error(
    version: str, leaf: str, top: str, filename: str, parse: LimitParser
) -> tuple[str, int | None, str | None]:
    if not os.path.isdir(leaf):
        return version, None, f"cgroup directory {leaf} not visible; limit unknown"
    return version, _tightest_limit(leaf, top, filename, parse), None


def probe_cgroup_memory(
    proc: str = "/proc", root: str = "/"
) -> tuple[str | None, int | None, str | None]:
    """(cgroup version, tightest memory limit in bytes or None, error) for this process.

    Raises OSError only when /proc cannot be read; the caller turns that into an error field.
    """
    v1_path, v2_path = parse_proc_cgroup(_read_text(os.path.join(proc, "self", "cgroup")))
    mounts = parse_mountinfo(_read_text(os.path.join(proc, "self", "mountinfo")))
    # Hybrid hosts have both: the memory controller sits on whichever hierarchy lists it.
    if v1_path is not None:
        for m in mounts:
            if m.fs_type == "cgroup" and "memory" in m.super_options.split(","):
                leaf = _cgroup_dir(m, v1_path, root)
                top = os.path.join(root, m.mount_point.lstrip("/"))
                return _limit_or_error("v1", leaf, top, "memory.limit_in_bytes", _parse_v1_limit)
    if v2_path is not None:
        for m in mounts:
            if m.fs_type != "cgroup2":
                continue
            top = os.path.join(root, m.mount_point.lstrip("/"))
            try:
                controllers = _read_text(os.path.join(top, "cgroup.controllers")).split()
            except OSError:
                continue
            if "memory" in controllers:
                leaf = _cgroup_dir(m, v2_path, root)
                return _limit_or_error("v2", leaf, top, "memory.max", _parse_v2_limit)
    return None, None, None


# ---------------------------------------------------------------- the probe


def _rlimit_bytes(value: int) -> int | None:
    return None if value == resource.RLIM_INFINITY else value


def probe_memory(proc: str = "/proc", root: str = "/") -> MemoryFacts:
    """Memory facts of the host as this process sees them. Never raises.

    `proc` is the procfs root; `root` prefixes absolute paths from mountinfo
    (cgroup mounts) and /dev/shm, so tests can point both at synthetic trees.
    """
    values: dict[str, object] = {}
    errors: list[str] = []

    try:
        values.update(parse_meminfo(_read_text(os.path.join(proc, "meminfo"))))
    except OSError as exc:
        errors.append(f"meminfo: {exc}")

    # A limit that could not be read is unknown, not "unlimited" (see MemoryFacts.unknown).
    unknown: list[str] = []
    try:
        version, limit, cgroup_error = probe_cgroup_memory(proc, root)
        values["cgroup_version"] = version
        values["cgroup_memory_limit_bytes"] = limit
        if cgroup_error:
            errors.append(f"cgroup: {cgroup_error}")
            unknown.append("cgroup_memory_limit_bytes")
    except (OSError, ValueError) as exc:
        errors.append(f"cgroup: {exc}")
        unknown += ["cgroup_version", "cgroup_memory_limit_bytes"]

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        values["memlock_soft_bytes"] = _rlimit_bytes(soft)
        values["memlock_hard_bytes"] = _rlimit_bytes(hard)
    except (OSError, ValueError) as exc:
        errors.append(f"RLIMIT_MEMLOCK: {exc}")
        unknown += ["memlock_hard_bytes", "memlock_soft_bytes"]

    try:
        st = os.statvfs(os.path.join(root, "dev", "shm"))
        values["shm_total_bytes"] = st.f_blocks * st.f_frsize
        values["shm_free_bytes"] = st.f_bavail * st.f_frsize
    except FileNotFoundError:
        pass  # no /dev/shm is a fact (None), not a probe failure
    except OSError as exc:
        errors.append(f"/dev/shm: {exc}")
        unknown += ["shm_free_bytes", "shm_total_bytes"]

    try:
        text = _read_text(os.path.join(proc, "sys", "kernel", "yama", "ptrace_scope"))
        values["ptrace_scope"] = int(text.strip())
    except FileNotFoundError:
        pass  # Yama not built in: no restriction beyond classic ptrace rules
    except (OSError, ValueError) as exc:
        errors.append(f"ptrace_scope: {exc}")

    try:
        values["cpu_count"] = len(os.sched_getaffinity(0))
    except (OSError, AttributeError):
        values["cpu_count"] = os.cpu_count()

    return MemoryFacts(
        error="; ".join(errors) or None,
        unknown=tuple(sorted(unknown)),
        **values,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------- identity


_CONTAINER_CGROUP_MARKERS = ("docker", "kubepods", "containerd", "libpod", "lxc", "crio")


def in_container(proc: str = "/proc", root: str = "/") -> bool:
    """Best-effort: marker files from docker/podman, the `container` env var, or PID 1's cgroup."""
    for marker in (".dockerenv", "run/.containerenv"):
        if os.path.exists(os.path.join(root, marker)):
            return True
    if os.environ.get("container"):  # noqa: SIM112 (lower-case by convention: nspawn, podman)
        return True
    try:
        text = _read_text(os.path.join(proc, "1", "cgroup"))
    except OSError:
        return False
    return any(marker in text for marker in _CONTAINER_CGROUP_MARKERS)


# ---------------------------------------------------------------- NUMA


def parse_cpulist(text: str) -> tuple[int, ...]:
    """The kernel's list format, "0-2,5" -> (0, 1, 2, 5)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


def probe_numa(proc: str = "/proc", sys: str = "/sys") -> NumaFacts:
    """Online NUMA nodes, and the nodes this process may allocate from. Never raises."""
    errors = []
    nodes: tuple[int, ...] = ()
    mems: tuple[int, ...] = ()
    try:
        nodes = parse_cpulist(_read_text(os.path.join(sys, "devices", "system", "node", "online")))
    except (OSError, ValueError) as exc:
        errors.append(f"node/online: {exc}")
    try:
        for line in _read_text(os.path.join(proc, "self", "status")).splitlines():
            if line.startswith("Mems_allowed_list:"):
                mems = parse_cpulist(line.split(":", 1)[1])
    except (OSError, ValueError) as exc:
        errors.append(f"status: {exc}")
    return NumaFacts(nodes=nodes, mems_allowed=mems, error="; ".join(errors) or None)
