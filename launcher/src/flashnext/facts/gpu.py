"""GPU probe through NVML (nvidia-ml-py's `pynvml`).

The NVML module is a parameter: production passes nothing and the real
`pynvml` is imported; tests pass a replay of a recorded machine that
implements the same functions. Values are normalised here because pynvml
versions differ in shape (bytes vs str names; NVMLError subclasses per code).
`probe_gpus` never raises: no library, no driver or a failed init is a fact
(`nvml_available=False` with the reason), and a field one GPU does not
support is None.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType
from typing import Any

from flashnext.facts.schema import GpuDevice, GpuFacts, GpuProcess, P2PLink

# nvmlGpuP2PStatus_t values (nvml.h); the names are what facts and checks use.
P2P_STATUS_NAMES = {
    0: "ok",
    1: "chipset_not_supported",
    2: "gpu_not_supported",
    3: "topology_not_supported",
    4: "disabled_by_regkey",
    5: "not_supported",
    6: "unknown",
}

# What to do about an NVML init failure, keyed by nvmlReturn_t code.
_INIT_HINTS = {
    9: "the NVIDIA kernel module is not loaded: install the driver or `modprobe nvidia`",
    12: (
        "libnvidia-ml.so.1 was not found: no NVIDIA driver on this host, or a container "
        "started without GPU access (podman --device nvidia.com/gpu=all, docker --gpus all)"
    ),
    4: "insufficient permissions on /dev/nvidia*: run as a user in the video group",
    18: "the driver's user-space library and kernel module differ: reboot or reload the driver",
}


def _text(value: Any) -> str:
    """pynvml returns bytes before 11.515 and str after; facts hold str."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _error_text(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    return f"{exc} (NVML code {code})" if code is not None else str(exc)


def _nvml_errors(nvml: ModuleType) -> tuple[type[BaseException], ...]:
    # pynvml raises NVMLLibraryMismatchError (not an NVMLError) when an unversioned
    # wrapper needs a newer driver than the one installed.
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    return (nvml.NVMLError, AttributeError) + ((mismatch,) if mismatch else ())


def _optional(nvml: ModuleType, fn: str, *args: Any) -> Any:
    """Call nvml.<fn>; None when NVML says the device cannot answer (not supported, ...)."""
    try:
        return getattr(nvml, fn)(*args)
    except _nvml_errors(nvml):
        return None


def _process_list(nvml: ModuleType, fn: str, handle: Any) -> tuple[list[Any] | None, str | None]:
    """(processes, None) or (None, why): the _v2 call serves drivers older than pynvml's default."""
    reason = None
    for name in (fn, f"{fn}_v2"):
        try:
            return list(getattr(nvml, name)(handle)), None
        except _nvml_errors(nvml) as exc:
            reason = reason or f"{fn}: {_error_text(exc)}"
    return None, reason


def cuda_version_text(value: int) -> str:
    """nvmlSystemGetCudaDriverVersion's 12080 → "12.8" (NVML encodes 1000*major + 10*minor)."""
    return f"{value // 1000}.{(value % 1000) // 10}"


def _processes(nvml: ModuleType, handle: Any, notes: list[str]) -> tuple[GpuProcess, ...]:
    """Compute and graphics processes by pid; a list NVML cannot give is noted, not guessed."""
    by_pid: dict[int, GpuProcess] = {}
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        procs, reason = _process_list(nvml, fn, handle)
        if reason:
            notes.append(f"process list unknown ({reason})")
        for proc in procs or ():
            pid = int(proc.pid)
            used = getattr(proc, "usedGpuMemory", None)  # None when the driver cannot tell
            name = _optional(nvml, "nvmlSystemGetProcessName", pid)
            seen = by_pid.get(pid)
            if seen is not None and (used is None or (seen.used_memory_bytes or 0) >= used):
                continue  # a process using both APIs is listed twice; keep the larger figure
            by_pid[pid] = GpuProcess(
                pid=pid,
                used_memory_bytes=None if used is None else int(used),
                name=None if name is None else _text(name),
            )
    return tuple(by_pid[pid] for pid in sorted(by_pid))


def sysfs_bus_id(nvml_bus_id: str) -> str | None:
    """NVML's "00000000:01:00.0" (8-digit domain) -> sysfs's "0000:01:00.0"."""
    domain, sep, rest = nvml_bus_id.strip().lower().partition(":")
    try:
        return f"{int(domain, 16):04x}:{rest}" if sep and rest else None
    except ValueError:
        return None


def numa_node_of(bus_id: str | None, sys: str = "/sys") -> int | None:
    """sysfs numa_node of a PCI device; None for -1 (no NUMA affinity) or unreadable."""
    if bus_id is None:
        return None
    try:
        with open(os.path.join(sys, "bus", "pci", "devices", bus_id, "numa_node")) as fh:
            node = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _device(
    nvml: ModuleType, index: int, handle: Any, notes: list[str], sys: str = "/sys"
) -> GpuDevice:
    """Read one GPU; the required fields raise NVMLError, the optional ones become None."""
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    persistence = _optional(nvml, "nvmlDeviceGetPersistenceMode", handle)

    def pcie(fn: str) -> int | None:
        value = _optional(nvml, fn, handle)
        return None if value is None else int(value)

    pci = _optional(nvml, "nvmlDeviceGetPciInfo", handle)
    raw_bus_id = getattr(pci, "busId", None) if pci is not None else None
    bus_id = sysfs_bus_id(_text(raw_bus_id)) if raw_bus_id else None

    return GpuDevice(
        index=index,
        name=_text(nvml.nvmlDeviceGetName(handle)),
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        memory_total_bytes=int(memory.total),
        memory_free_bytes=int(memory.free),
        compute_capability=f"{major}.{minor}",
        # The current generation drops at idle to save power (a 3090 idles at Gen1);
        # the max is what the link trains to under load.
        pcie_gen_current=pcie("nvmlDeviceGetCurrPcieLinkGeneration"),
        pcie_gen_max=pcie("nvmlDeviceGetMaxPcieLinkGeneration"),
        pcie_width_current=pcie("nvmlDeviceGetCurrPcieLinkWidth"),
        pcie_width_max=pcie("nvmlDeviceGetMaxPcieLinkWidth"),
        persistence_mode=None if persistence is None else persistence == 1,
        processes=_processes(nvml, handle, notes),
        pci_bus_id=bus_id,
        numa_node=numa_node_of(bus_id, sys),
    )


def _p2p(nvml: ModuleType, handles: dict[int, Any]) -> tuple[P2PLink, ...]:
    """P2P read status for every ordered pair: NVML asks whether A can read B's memory."""
    read = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    links = []
    for a, ha in handles.items():
        for b, hb in handles.items():
            if a == b:
                continue
            try:
                status = P2P_STATUS_NAMES.get(int(nvml.nvmlDeviceGetP2PStatus(ha, hb, read)))
            except nvml.NVMLError:
                status = None
            links.append(P2PLink(gpu_a=a, gpu_b=b, status=status or "unknown"))
    return tuple(links)


def _import_pynvml() -> ModuleType | str:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError as exc:
        return f"nvidia-ml-py is not installed ({exc}); install it: pip install nvidia-ml-py"
    return pynvml


def probe_gpus(nvml: ModuleType | None = None, sys: str = "/sys") -> GpuFacts:
    """GPU facts through NVML (and each GPU's NUMA node from sysfs under `sys`);
    `nvml` defaults to the real pynvml module. Never raises."""
    if nvml is None:
        loaded = _import_pynvml()
        if isinstance(loaded, str):
            return GpuFacts(nvml_available=False, error=loaded)
        nvml = loaded
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        hint = _INIT_HINTS.get(getattr(exc, "value", None), "")
        reason = f"NVML init failed: {_error_text(exc)}"
        return GpuFacts(nvml_available=False, error=f"{reason}; {hint}" if hint else reason)
    except Exception as exc:  # a broken install must not crash `flashnext facts`
        return GpuFacts(nvml_available=False, error=f"NVML init failed: {exc!r}")
    try:
        return _probe_initialised(nvml, sys)
    except Exception as exc:
        return GpuFacts(nvml_available=True, error=f"NVML query failed: {exc!r}")
    finally:
        with contextlib.suppress(Exception):  # nothing useful to do if shutdown fails
            nvml.nvmlShutdown()


def _probe_initialised(nvml: ModuleType, sys: str = "/sys") -> GpuFacts:
    errors = []
    driver = _optional(nvml, "nvmlSystemGetDriverVersion")
    cuda = _optional(nvml, "nvmlSystemGetCudaDriverVersion")
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError as exc:
        return GpuFacts(
            nvml_available=True,
            error=f"nvmlDeviceGetCount failed: {_error_text(exc)}",
            driver_version=None if driver is None else _text(driver),
            cuda_driver_version=None if cuda is None else cuda_version_text(int(cuda)),
        )
    devices = []
    handles: dict[int, Any] = {}
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            notes: list[str] = []
            devices.append(_device(nvml, index, handle, notes, sys))
            errors.extend(f"GPU {index}: {note}" for note in notes)
            handles[index] = handle
        except nvml.NVMLError as exc:
            # A lost or inaccessible GPU is left out of `devices`; the error names it.
            errors.append(f"GPU {index}: {_error_text(exc)}")
    return GpuFacts(
        nvml_available=True,
        error="; ".join(errors) or None,
        driver_version=None if driver is None else _text(driver),
        cuda_driver_version=None if cuda is None else cuda_version_text(int(cuda)),
        devices=tuple(devices),
        p2p=_p2p(nvml, handles),
    )
