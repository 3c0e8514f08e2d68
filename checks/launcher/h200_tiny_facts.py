"""Facts of the lent GPU host (an H200, or the H100 a call for it may get) serving the
tiny checkpoint, for replay (`--facts`).

The document is what `flashnext facts --json` writes (the real schema, by
construction): this machine is probed for the model directory, the table and
the port, then the two sections this machine cannot show are replaced by the
GPU host's values. Where each value comes from:

- storage, ports, kernel, in_container, collected_at, hostname: the real probe
  on THIS machine. This workplace's machines are Firecracker VMs like the GPU
  host, whose disk is also one virtio block device (`vda`, ext4, reported
  rotational): the medium preflight judges for the table is the GPU host's kind.
- gpu: NVML as recorded on the lent host (checks/launcher/test_probe_gpu.py,
  H200_RECORDED / H200_PROBED: "NVIDIA H200", 143771 MiB, compute capability
  9.0, PCIe gen 5 x16, driver 580.159.04, CUDA 13.0), with the torch process
  of that recording gone: free = total - what NVML used beside that process.
- gpu, for the H100 a call for the H200 may get (`card="H100"`): no NVML
  recording of it exists. Its name and total are nvidia-smi's on the lent
  H100 (.library/device KINDS.md, nvidia-h100-x1, 2026-11-13: "NVIDIA H100
  80GB HBM3", 81559 MiB, driver 580.159.04, sm_90); the rest is the H200
  recording's (CUDA 13.0, the driver's idle reserve, free = total - that
  reserve), except the PCIe link, which nothing recorded: None (preflight
  warns that NVML did not report it), and persistence mode: None.
- memory: from the brief for this run (no recording of the GPU host's
  /proc/meminfo exists): ~125 GiB of RAM, RLIMIT_MEMLOCK unlimited (root);
  16 CPUs (.library/device KINDS.md); cgroup, /dev/shm, hugepages and swap as
  this Firecracker VM has them (no memory limit; /dev/shm the size of RAM).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from test_probe_gpu import H200_PROBED, H200_RECORDED

GIB = 1 << 30


def h200_gpu() -> dict:
    gpu = copy.deepcopy(H200_PROBED)
    device = gpu["devices"][0]
    memory = H200_RECORDED["devices"][0]["memory"]
    torch_process = H200_RECORDED["devices"][0]["compute_processes"][0]["usedGpuMemory"]
    device["processes"] = []  # nothing else on the card when serve-tiny starts
    device["memory_free_bytes"] = memory["total"] - (memory["used"] - torch_process)
    device["uuid"] = "GPU-00000000-0000-0000-0000-000000000000"  # not a real serial
    return gpu


# nvidia-smi on the lent H100 (.library/device KINDS.md, nvidia-h100-x1, 2026-11-13).
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_TOTAL_BYTES = 81559 << 20
CARDS = ("H200", "H100")


def h100_gpu() -> dict:
    gpu = h200_gpu()
    device = gpu["devices"][0]
    reserve = device["memory_total_bytes"] - device["memory_free_bytes"]  # the H200's, assumed
    device.update(
        name=H100_NAME,
        memory_total_bytes=H100_TOTAL_BYTES,
        memory_free_bytes=H100_TOTAL_BYTES - reserve,
        pcie_gen_current=None,  # not recorded for the H100
        pcie_gen_max=None,
        pcie_width_current=None,
        pcie_width_max=None,
        persistence_mode=None,
        uuid="GPU-00000000-0000-0000-0000-000000000100",  # not a real serial
    )
    return gpu


def lent_gpu(card: str = "H200") -> dict:
    """The GPU section of the lent host with `card` (one of CARDS)."""
    return {"H200": h200_gpu, "H100": h100_gpu}[card]()


def h200_memory(probed: dict) -> dict:
    memory = dict(probed)
    memory.update(
        mem_total_bytes=125 * GIB,  # the brief: ~125 GiB of RAM
        mem_available_bytes=120 * GIB,  # an idle host: most of it available
        memlock_soft_bytes=None,  # the brief: memlock unlimited (None = unlimited)
        memlock_hard_bytes=None,
        cgroup_memory_limit_bytes=None,  # no limit, as in this workplace's VMs
        shm_total_bytes=125 * GIB,  # tmpfs /dev/shm the size of RAM, as here
        shm_free_bytes=125 * GIB,
        swap_total_bytes=0,
        swap_free_bytes=0,
        cpu_count=16,  # KINDS.md: 16 CPU cores
        error=None,
        unknown=[],
    )
    return memory


def h200_facts(
    model_dir: Path, table: Path, port: int, host: str = "127.0.0.1", card: str = "H200"
) -> dict:
    """Probe this machine for the paths and port, then make it the lent host with `card`."""
    probed = subprocess.run(
        [sys.executable, "-m", "flashnext", "facts", "--json", "--model", str(model_dir),
         "--table", str(table), "--host", host, "--port", str(port)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    facts = json.loads(probed)
    facts["gpu"] = lent_gpu(card)
    facts["memory"] = h200_memory(facts["memory"])
    return facts


def write_h200_facts(
    path: Path, model_dir: Path, table: Path, port: int, card: str = "H200"
) -> Path:
    facts = h200_facts(model_dir, table, port, card=card)
    path.write_text(json.dumps(facts, indent=2, sort_keys=True))
    return path
