"""GPU probe: a replayed NVML machine through the real pynvml's types, and this machine's NVML.

`ReplayNVML` implements the pynvml functions the probe calls and answers from a
recording: plain values where NVML returns plain values, the real pynvml
ctypes structs and "friendly objects" where it returns those, and the real
`pynvml.NVMLError` subclasses (by error code) where a recording says
{"nvml_error": CODE}. It refuses calls before nvmlInit and after nvmlShutdown,
as NVML does (NVML_ERROR_UNINITIALIZED).

Recording format (JSON-able; `python checks/launcher/test_probe_gpu.py --record`
prints one from a real machine):
  driver_version, cuda_driver_version, device_count, devices: [{name, uuid,
  memory: {total, free, used}, cuda_compute_capability: [major, minor],
  curr/max_pcie_link_generation, curr/max_pcie_link_width, persistence_mode,
  pci_bus_id (optional: NVML's busId), compute_processes / graphics_processes:
  [{pid, usedGpuMemory}]}],
  p2p_read: N x N status codes (diagonal null), process_names: {pid: name}.
"""

from __future__ import annotations

import copy
import ctypes.util
import json
import shutil
import subprocess
import sys
import types

import pytest
from flashnext.facts.gpu import cuda_version_text, probe_gpus
from flashnext.facts.schema import GpuFacts, HostFacts, dumps, host_facts_from_json

pynvml = pytest.importorskip("pynvml", reason="nvidia-ml-py is a launcher dependency")

GIB = 1 << 30

# A 3x RTX 3090 host as NVML would describe it at idle. Representative values,
# not a recording of one specific machine: UUIDs and the driver version are
# made up (shaped like real ones); the 3090's figures are its published ones
# (24 GiB = 25769803776 bytes, compute capability 8.6, PCIe Gen4 x16). The
# third card sits in a chipset slot (x4), as on many consumer boards; GeForce
# cards report P2P reads as chipset-not-supported (status 1) on such boards.
THREE_3090 = {
    "driver_version": "999.99.99",
    "cuda_driver_version": 12080,
    "device_count": 3,
    "devices": [
        {
            "name": "NVIDIA GeForce RTX 3090",
            "uuid": f"GPU-00000000-0000-4000-8000-00000000000{i}",
            "memory": {"total": 25769803776, "free": 25443434496, "used": 326369280},
            "cuda_compute_capability": [8, 6],
            "curr_pcie_link_generation": 1,  # idles at Gen1, trains to Gen4 under load
            "max_pcie_link_generation": 4,
            "curr_pcie_link_width": 16 if i < 2 else 4,
            "max_pcie_link_width": 16 if i < 2 else 4,
            "persistence_mode": 1,
            "pci_bus_id": f"00000000:{i + 1:02X}:00.0",
            "compute_processes": [],
            "graphics_processes": [],
        }
        for i in range(3)
    ],
    "p2p_read": [[None, 1, 1], [1, None, 1], [1, 1, None]],
    "process_names": {},
}


# Recorded on a real machine (one H200 with a torch process holding 2 GiB) with
# `--record`, together with what probe_gpus() returned there from the real
# NVML at the same moment; nvidia-smi listed pid 527 with 2566 MiB. Replaying
# the recording must give exactly what the real probe gave.
H200_RECORDED = {
    "cuda_driver_version": 13000,
    "device_count": 1,
    "devices": [
        {
            "compute_processes": [{"pid": 527, "usedGpuMemory": 2690646016}],
            "cuda_compute_capability": [9, 0],
            "curr_pcie_link_generation": 5,
            "curr_pcie_link_width": 16,
            "graphics_processes": [],
            "max_pcie_link_generation": 5,
            "max_pcie_link_width": 16,
            "memory": {"free": 147409993728, "total": 150754820096, "used": 3344826368},
            "name": "NVIDIA H200",
            "persistence_mode": 1,
            "uuid": "GPU-7aca84b7-080c-08e2-61de-679c8666270c",
        }
    ],
    "driver_version": "580.159.04",
    "p2p_read": [[None]],
    "process_names": {"527": "/opt/torch/.venv/bin/python"},
}

H200_PROBED = {
    "cuda_driver_version": "13.0",
    "devices": [
        {
            "compute_capability": "9.0",
            "index": 0,
            "memory_free_bytes": 147409993728,
            "memory_total_bytes": 150754820096,
            "name": "NVIDIA H200",
            "pcie_gen_current": 5,
            "pcie_gen_max": 5,
            "pcie_width_current": 16,
            "pcie_width_max": 16,
            "persistence_mode": True,
            "processes": [
                {"name": "/opt/torch/.venv/bin/python", "pid": 527, "used_memory_bytes": 2690646016}
            ],
            "uuid": "GPU-7aca84b7-080c-08e2-61de-679c8666270c",
            # Not in that recording (the probe read neither then): none replayed.
            "pci_bus_id": None,
            "numa_node": None,
        }
    ],
    "driver_version": "580.159.04",
    "error": None,
    "nvml_available": True,
    "p2p": [],
}


class _Handle:
    """Stands in for c_nvmlDevice_t: opaque to the caller."""

    def __init__(self, index: int) -> None:
        self.index = index


class ReplayNVML(types.ModuleType):
    """The subset of pynvml the probe uses, answering from a recording."""

    def __init__(self, recording: dict, legacy_bytes: bool = False) -> None:
        super().__init__("pynvml_replay")
        self.rec = recording
        self.legacy_bytes = legacy_bytes  # pynvml < 11.515 returned bytes for strings
        self.initialised = False
        self.init_calls = self.shutdown_calls = 0
        self.NVMLError = pynvml.NVMLError
        self.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
        self.NVML_P2P_CAPS_INDEX_READ = pynvml.NVML_P2P_CAPS_INDEX_READ

    # -- helpers
    def _answer(self, value):
        if isinstance(value, dict) and "nvml_error" in value:
            raise pynvml.NVMLError(value["nvml_error"])
        return value

    def _ready(self) -> None:
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _str(self, value):
        value = self._answer(value)
        return value.encode() if self.legacy_bytes else value

    def _dev(self, handle: _Handle, key: str):
        self._ready()
        return self._answer(self.rec["devices"][handle.index][key])

    # -- system
    def nvmlInit(self) -> None:
        self.init_calls += 1
        self._answer(self.rec.get("init", None))
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._ready()
        self.shutdown_calls += 1
        self.initialised = False

    def nvmlSystemGetDriverVersion(self):
        self._ready()
        return self._str(self.rec["driver_version"])

    def nvmlSystemGetCudaDriverVersion(self):
        self._ready()
        return self._answer(self.rec["cuda_driver_version"])

    def nvmlSystemGetProcessName(self, pid):
        self._ready()
        name = self.rec["process_names"].get(str(pid), {"nvml_error": pynvml.NVML_ERROR_NOT_FOUND})
        return self._str(name)

    def nvmlDeviceGetCount(self):
        self._ready()
        return self._answer(self.rec["device_count"])

    def nvmlDeviceGetHandleByIndex(self, index):
        self._ready()
        if not 0 <= index < len(self.rec["devices"]):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._answer(self.rec["devices"][index].get("handle"))
        return _Handle(index)

    # -- device
    def nvmlDeviceGetName(self, h):
        self._ready()
        return self._str(self.rec["devices"][h.index]["name"])

    def nvmlDeviceGetUUID(self, h):
        self._ready()
        return self._str(self.rec["devices"][h.index]["uuid"])

    def nvmlDeviceGetMemoryInfo(self, h):
        mem = self._dev(h, "memory")
        return pynvml.c_nvmlMemory_t(total=mem["total"], free=mem["free"], used=mem["used"])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return tuple(self._dev(h, "cuda_compute_capability"))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._dev(h, "curr_pcie_link_generation")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._dev(h, "max_pcie_link_generation")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._dev(h, "curr_pcie_link_width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._dev(h, "max_pcie_link_width")

    def nvmlDeviceGetPersistenceMode(self, h):
        return self._dev(h, "persistence_mode")

    def nvmlDeviceGetPciInfo(self, h):
        self._ready()
        bus_id = self.rec["devices"][h.index].get("pci_bus_id")
        if bus_id is None:  # a recording made before bus ids were recorded
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return types.SimpleNamespace(busId=bus_id.encode() if self.legacy_bytes else bus_id)

    def _processes(self, h, key):
        out = []
        for p in self._dev(h, key):
            used = p["usedGpuMemory"]
            struct = pynvml.c_nvmlProcessInfo_v2_t(
                pid=p["pid"],
                usedGpuMemory=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
                if used is None
                else used,
            )
            obj = pynvml.nvmlStructToFriendlyObject(struct)
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None  # what pynvml itself does with "not available"
            out.append(obj)
        return out

    def _unversioned(self, h, key):
        # An old driver lacks the _v3 entry points pynvml's unversioned wrappers call.
        if self.rec.get("driver_lacks_v3"):
            raise pynvml.NVMLLibraryMismatchError("Unversioned function called and the ...")
        return self._processes(h, key)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._unversioned(h, "compute_processes")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return self._unversioned(h, "graphics_processes")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h):
        return self._processes(h, "compute_processes")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, h):
        return self._processes(h, "graphics_processes")

    def nvmlDeviceGetP2PStatus(self, h1, h2, index):
        self._ready()
        assert index == pynvml.NVML_P2P_CAPS_INDEX_READ
        return self._answer(self.rec["p2p_read"][h1.index][h2.index])


def machine(**changes) -> dict:
    rec = copy.deepcopy(THREE_3090)
    rec.update(changes)
    return rec


# ---------------------------------------------------------------- replayed machines


@pytest.mark.parametrize("legacy_bytes", [False, True], ids=["str", "bytes"])
def test_idle_3x3090(legacy_bytes):
    nvml = ReplayNVML(machine(), legacy_bytes=legacy_bytes)
    facts = probe_gpus(nvml)
    assert (nvml.init_calls, nvml.shutdown_calls, nvml.initialised) == (1, 1, False)
    assert facts.nvml_available and facts.error is None
    assert (facts.driver_version, facts.cuda_driver_version) == ("999.99.99", "12.8")
    assert [d.index for d in facts.devices] == [0, 1, 2]
    d0, _, d2 = facts.devices
    assert d0.name == "NVIDIA GeForce RTX 3090" and isinstance(d0.name, str)
    assert d0.uuid == "GPU-00000000-0000-4000-8000-000000000000"
    assert (d0.memory_total_bytes, d0.memory_free_bytes) == (24 * GIB, 25443434496)
    assert d0.compute_capability == "8.6"
    assert (d0.pcie_gen_current, d0.pcie_gen_max, d0.pcie_width_current, d0.pcie_width_max) == (
        1,
        4,
        16,
        16,
    )
    assert (d2.pcie_width_current, d2.pcie_width_max) == (4, 4)
    assert d0.persistence_mode is True
    assert d0.processes == ()
    # Every ordered pair, both directions.
    assert [(p.gpu_a, p.gpu_b) for p in facts.p2p] == [
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 2),
        (2, 0),
        (2, 1),
    ]
    assert {p.status for p in facts.p2p} == {"chipset_not_supported"}


def test_replay_of_a_real_recording_matches_the_real_probe():
    probed = probe_gpus(ReplayNVML(copy.deepcopy(H200_RECORDED)))
    assert json.loads(dumps(probed)) == H200_PROBED


def test_foreign_processes_are_listed_once_with_names():
    rec = machine(process_names={"1234": "/usr/lib/xorg/Xorg", "4321": "python3"})
    rec["devices"][0]["graphics_processes"] = [
        {"pid": 1234, "usedGpuMemory": 300 << 20},
        {"pid": 4321, "usedGpuMemory": 200 << 20},
    ]
    rec["devices"][0]["compute_processes"] = [{"pid": 4321, "usedGpuMemory": 10 * GIB}]
    # A process in another PID namespace: NVML knows its pid, not its name or usage.
    rec["devices"][1]["compute_processes"] = [{"pid": 777, "usedGpuMemory": None}]
    facts = probe_gpus(ReplayNVML(rec))
    p0 = facts.devices[0].processes
    assert [(p.pid, p.name, p.used_memory_bytes) for p in p0] == [
        (1234, "/usr/lib/xorg/Xorg", 300 << 20),
        (4321, "python3", 10 * GIB),
    ]
    (p1,) = facts.devices[1].processes
    assert (p1.pid, p1.name, p1.used_memory_bytes) == (777, None, None)


def test_unsupported_fields_become_none():
    rec = machine()
    not_supported = {"nvml_error": pynvml.NVML_ERROR_NOT_SUPPORTED}
    rec["devices"][1]["persistence_mode"] = not_supported
    rec["devices"][1]["max_pcie_link_generation"] = not_supported
    rec["devices"][1]["graphics_processes"] = not_supported
    rec["p2p_read"][0][1] = {"nvml_error": pynvml.NVML_ERROR_UNKNOWN}
    rec["p2p_read"][1][2] = 0
    facts = probe_gpus(ReplayNVML(rec))
    d1 = facts.devices[1]
    assert (d1.persistence_mode, d1.pcie_gen_max, d1.pcie_gen_current) == (None, None, 1)
    status = {(p.gpu_a, p.gpu_b): p.status for p in facts.p2p}
    assert status[(0, 1)] == "unknown"
    assert status[(1, 2)] == "ok"
    # An unknown process list is not an empty one: the error says so.
    assert facts.error == (
        "GPU 1: process list unknown "
        "(nvmlDeviceGetGraphicsRunningProcesses: Not Supported (NVML code 3))"
    )


def test_old_driver_process_lists_through_v2():
    rec = machine(driver_lacks_v3=True, process_names={"4321": "python3"})
    rec["devices"][2]["compute_processes"] = [{"pid": 4321, "usedGpuMemory": 5 * GIB}]
    facts = probe_gpus(ReplayNVML(rec))
    assert facts.error is None
    assert [(p.pid, p.name) for p in facts.devices[2].processes] == [(4321, "python3")]


def test_lost_gpu_is_left_out_and_named():
    rec = machine()
    rec["devices"][1]["handle"] = {"nvml_error": pynvml.NVML_ERROR_GPU_IS_LOST}
    facts = probe_gpus(ReplayNVML(rec))
    assert facts.nvml_available
    assert [d.index for d in facts.devices] == [0, 2]
    assert facts.error == "GPU 1: GPU is lost (NVML code 15)"
    assert {(p.gpu_a, p.gpu_b) for p in facts.p2p} == {(0, 2), (2, 0)}


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVML Shared Library Not Found (NVML code 12)"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded (NVML code 9)"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "(NVML code 18); the driver's user-space"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "Insufficient Permissions (NVML code 4)"),
    ],
)
def test_init_failure_is_a_fact(code, words):
    nvml = ReplayNVML(machine(init={"nvml_error": code}))
    facts = probe_gpus(nvml)
    assert facts.nvml_available is False
    assert facts.devices == ()
    assert facts.error.startswith("NVML init failed: ")
    assert words in facts.error
    assert nvml.shutdown_calls == 0


def test_count_failure_keeps_driver_facts():
    nvml = ReplayNVML(machine(device_count={"nvml_error": pynvml.NVML_ERROR_UNKNOWN}))
    facts = probe_gpus(nvml)
    assert facts.nvml_available and facts.devices == ()
    assert facts.driver_version == "999.99.99"
    assert facts.error == "nvmlDeviceGetCount failed: Unknown Error (NVML code 999)"
    assert nvml.shutdown_calls == 1


def test_unexpected_exception_does_not_escape():
    nvml = ReplayNVML(machine())
    nvml.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(RuntimeError("boom"))
    facts = probe_gpus(nvml)
    assert facts.nvml_available and "RuntimeError('boom')" in facts.error
    assert nvml.shutdown_calls == 1


def test_missing_pynvml_is_a_fact(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    facts = probe_gpus()
    assert facts.nvml_available is False
    assert "nvidia-ml-py is not installed" in facts.error
    assert "pip install nvidia-ml-py" in facts.error


def test_replayed_facts_round_trip_through_json():
    host = HostFacts(gpu=probe_gpus(ReplayNVML(machine())))
    assert host_facts_from_json(dumps(host)) == host


def test_cuda_version_text():
    assert [cuda_version_text(v) for v in (12080, 12020, 11080, 13000)] == [
        "12.8",
        "12.2",
        "11.8",
        "13.0",
    ]


# ---------------------------------------------------------------- this machine


def test_real_nvml():
    facts = probe_gpus()
    assert isinstance(facts, GpuFacts)
    if ctypes.util.find_library("nvidia-ml") is None:
        # No driver here: the probe says so, with NVML's own reason and the fix.
        assert facts.nvml_available is False
        assert "NVML Shared Library Not Found (NVML code 12)" in facts.error
        assert "libnvidia-ml.so.1 was not found" in facts.error
        return
    assert facts.nvml_available, facts.error
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert [d.uuid for d in facts.devices] == listed


# ---------------------------------------------------------------- recorder


def record() -> dict:
    """Read a real machine through pynvml into the replay format (for new fixtures)."""

    def ask(fn, *args):
        try:
            value = fn(*args)
        except pynvml.NVMLError as exc:
            return {"nvml_error": exc.value}
        return value.decode() if isinstance(value, bytes) else value

    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        devices, names = [], {}
        for h in handles:
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            dev = {
                "name": ask(pynvml.nvmlDeviceGetName, h),
                "uuid": ask(pynvml.nvmlDeviceGetUUID, h),
                "memory": {"total": mem.total, "free": mem.free, "used": mem.used},
                "cuda_compute_capability": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
            }
            for key, fn in (
                ("curr_pcie_link_generation", pynvml.nvmlDeviceGetCurrPcieLinkGeneration),
                ("max_pcie_link_generation", pynvml.nvmlDeviceGetMaxPcieLinkGeneration),
                ("curr_pcie_link_width", pynvml.nvmlDeviceGetCurrPcieLinkWidth),
                ("max_pcie_link_width", pynvml.nvmlDeviceGetMaxPcieLinkWidth),
                ("persistence_mode", pynvml.nvmlDeviceGetPersistenceMode),
            ):
                dev[key] = ask(fn, h)
            pci = ask(pynvml.nvmlDeviceGetPciInfo, h)
            bus_id = None if isinstance(pci, dict) else pci.busId
            dev["pci_bus_id"] = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
            for key, fn in (
                ("compute_processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
                ("graphics_processes", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
            ):
                procs = ask(fn, h)
                if isinstance(procs, list):
                    procs = [{"pid": p.pid, "usedGpuMemory": p.usedGpuMemory} for p in procs]
                    for p in procs:
                        names[str(p["pid"])] = ask(pynvml.nvmlSystemGetProcessName, p["pid"])
                dev[key] = procs
            devices.append(dev)
        read = pynvml.NVML_P2P_CAPS_INDEX_READ
        return {
            "driver_version": ask(pynvml.nvmlSystemGetDriverVersion),
            "cuda_driver_version": ask(pynvml.nvmlSystemGetCudaDriverVersion),
            "device_count": count,
            "devices": devices,
            "p2p_read": [
                [
                    None if a is b else ask(pynvml.nvmlDeviceGetP2PStatus, a, b, read)
                    for b in handles
                ]
                for a in handles
            ],
            "process_names": names,
        }
    finally:
        pynvml.nvmlShutdown()


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    print(json.dumps(record(), indent=2, sort_keys=True))
