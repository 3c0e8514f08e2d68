"""Whole-host facts for preflight and plan tests.

The base is `checks/fixtures/facts/3x3090-nvme.json`: a 3x RTX 3090 host with
its PLE table on local NVMe, in the exact schema `flashnext facts --json`
writes (values synthetic: no real machine's serials). Each failure kind is one
named variant of it, so a test says which fact it changes.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable
from pathlib import Path

from flashnext.facts.schema import (
    BlockDevice,
    GpuFacts,
    GpuProcess,
    HostFacts,
    ManifestFacts,
    NumaFacts,
    PortFacts,
    host_facts_from_json,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"
BASE_FILE = FIXTURES / "3x3090-nvme.json"
GIB = 1 << 30


# The fixture file predates manifest recording (StorageFacts.manifest): this is what
# `flashnext facts --table` records now beside that packed table (without a manifest
# recorded, preflight cannot tell the layout vLLM will assume: table.size warns).
TABLE_MANIFEST = ManifestFacts(
    path="/nvme/flashnext/ple-table.bin.json",
    exists=True,
    doc={
        "format": "flashnext-ple-table",
        "version": 1,
        "layer": "model.language_model.layers.1.ple",
        "dtype": "BF16",
        "rows": 320_001_536,
        "dim": 160,
        "row_bytes": 320,
        "layout": "packed",
        "total_bytes": 102_400_491_520,
    },
)


# The fixture file predates NUMA facts (HostFacts.numa; without them gpu.numa warns):
# this is what `flashnext facts` records on a single-socket board, one node, whose
# GPUs report no NUMA affinity (sysfs numa_node -1).
SINGLE_NODE = NumaFacts(nodes=(0,), mems_allowed=(0,))


def base_facts() -> HostFacts:
    facts = host_facts_from_json(BASE_FILE.read_text(), source=str(BASE_FILE))
    return dataclasses.replace(_table(facts, manifest=TABLE_MANIFEST), numa=SINGLE_NODE)


def _two_sockets(gpu_nodes: tuple[int, ...], mems: tuple[int, ...]) -> Callable:
    """A two-socket host: the GPUs' nodes and the nodes this process may allocate on."""

    def change(f: HostFacts) -> HostFacts:
        f = dataclasses.replace(f, numa=NumaFacts(nodes=(0, 1), mems_allowed=mems))
        return _gpus(f, lambda d: dataclasses.replace(d, numa_node=gpu_nodes[d.index]))

    return change


def _memory(facts: HostFacts, **changes) -> HostFacts:
    return dataclasses.replace(facts, memory=dataclasses.replace(facts.memory, **changes))


def _gpus(facts: HostFacts, fn: Callable) -> HostFacts:
    devices = tuple(fn(d) for d in facts.gpu.devices)
    return dataclasses.replace(facts, gpu=dataclasses.replace(facts.gpu, devices=devices))


def _first_gpu(facts: HostFacts, **changes) -> HostFacts:
    return _gpus(facts, lambda d: dataclasses.replace(d, **changes) if d.index == 0 else d)


def _table(facts: HostFacts, **changes) -> HostFacts:
    storage = dict(facts.storage)
    storage["table"] = dataclasses.replace(storage["table"], **changes)
    return dataclasses.replace(facts, storage=storage)


def _table_on(transport: str, rotational: bool, fs: str = "ext4") -> Callable:
    disk = BlockDevice(name="sdb", rotational=rotational, transport=transport)
    return lambda f: _table(f, devices=(disk,), fs_type=fs)


# name -> (facts variant, check id expected to fire, its level, other ids it causes)
VARIANTS: dict[str, tuple[Callable[[HostFacts], HostFacts], str, str, tuple[str, ...]]] = {
    "no_nvml": (
        lambda f: dataclasses.replace(
            f, gpu=GpuFacts(nvml_available=False, error="NVML Shared Library Not Found")
        ),
        "gpu.nvml",
        "fail",
        (),
    ),
    "two_gpus": (
        lambda f: dataclasses.replace(f, gpu=dataclasses.replace(f.gpu, devices=f.gpu.devices[:2])),
        "gpu.count",
        "fail",
        (),
    ),
    "wrong_model": (
        lambda f: _gpus(f, lambda d: dataclasses.replace(d, name="NVIDIA GeForce RTX 3080")),
        "gpu.count",
        "fail",
        (),
    ),
    "small_vram": (
        lambda f: _first_gpu(f, memory_total_bytes=12 * GIB, memory_free_bytes=12 * GIB),
        "gpu0.vram",
        "fail",
        ("kv.capacity", "rank0.vram", "rank1.vram", "rank2.vram", "rank0.start"),
    ),
    "old_arch": (
        lambda f: _first_gpu(f, compute_capability="7.5"),
        "gpu0.compute_capability",
        "fail",
        (),
    ),
    "busy_gpu": (
        lambda f: _first_gpu(
            f, processes=(GpuProcess(pid=4242, used_memory_bytes=GIB, name="python3"),)
        ),
        "gpu0.idle",
        "fail",
        (),
    ),
    "gpu_memory_taken": (
        lambda f: _first_gpu(f, memory_free_bytes=20 * GIB),
        "gpu0.idle",
        "fail",
        ("rank0.start",),
    ),
    # 25.05 GB free: enough for vLLM's utilization (0.97 x 24 GiB = 25.00 GB), not
    # for rank 0's predicted start (25.15 GB), e.g. a display server on the card.
    "gpu0_short_of_the_start_peak": (
        lambda f: _first_gpu(f, memory_free_bytes=25_050_000_000),
        "rank0.start",
        "warn",
        (),
    ),
    "pcie_x8": (lambda f: _first_gpu(f, pcie_width_max=8), "gpu0.pcie", "warn", ()),
    "pcie_gen3": (lambda f: _first_gpu(f, pcie_gen_max=3), "gpu0.pcie", "warn", ()),
    "low_ram": (lambda f: _memory(f, mem_available_bytes=32 * GIB), "host.ram", "fail", ()),
    "memlock_64k": (
        lambda f: _memory(f, memlock_soft_bytes=65536, memlock_hard_bytes=65536),
        "host.memlock",
        "fail",
        (),
    ),
    "cgroup_8g": (
        lambda f: _memory(f, cgroup_memory_limit_bytes=8 * GIB),
        "host.cgroup",
        "fail",
        (),
    ),
    "small_shm": (
        lambda f: _memory(f, shm_total_bytes=64 << 20, shm_free_bytes=64 << 20),
        "host.shm",
        "fail",
        (),
    ),
    "table_missing": (
        lambda f: _table(f, exists=False, is_regular_file=False, size_bytes=None),
        "table.path",
        "fail",
        (),
    ),
    "table_truncated": (lambda f: _table(f, size_bytes=50 * GIB), "table.size", "fail", ()),
    "table_unreadable": (lambda f: _table(f, readable=False), "table.readable", "fail", ()),
    "table_on_nfs": (
        lambda f: _table(f, network=True, fs_type="nfs4", devices=()),
        "table.medium",
        "fail",
        (),
    ),
    "table_on_tmpfs": (
        lambda f: _table(f, fs_type="tmpfs", devices=()),
        "table.medium",
        "fail",
        (),
    ),
    "table_on_overlay": (
        lambda f: _table(f, fs_type="overlay", devices=()),
        "table.medium",
        "fail",
        (),
    ),
    "table_on_hdd": (_table_on("sata", rotational=True), "table.medium", "fail", ()),
    "table_on_sata_ssd": (_table_on("sata", rotational=False), "table.medium", "warn", ()),
    "table_on_usb": (_table_on("usb", rotational=False), "table.medium", "warn", ()),
    "two_sockets_unbound": (_two_sockets((0, 0, 0), (0, 1)), "gpu.numa", "warn", ()),
    "gpus_on_two_sockets": (_two_sockets((0, 0, 1), (0, 1)), "gpu.numa", "warn", ()),
    "p2p_not_recorded": (
        lambda f: dataclasses.replace(f, gpu=dataclasses.replace(f.gpu, p2p=())),
        "gpu.p2p",
        "warn",
        (),
    ),
    "gpu_unreadable": (
        lambda f: dataclasses.replace(
            f, gpu=dataclasses.replace(f.gpu, error="GPU 2: NVML_ERROR_GPU_IS_LOST")
        ),
        "gpu.nvml",
        "warn",
        (),
    ),
    "port_unbindable": (
        lambda f: dataclasses.replace(
            f,
            ports=(PortFacts(host="127.0.0.1", port=8000, free=False, error="permission denied"),),
        ),
        "port",
        "fail",
        (),
    ),
    "port_busy": (
        lambda f: dataclasses.replace(
            f, ports=(PortFacts(host="127.0.0.1", port=8000, free=False),)
        ),
        "port",
        "fail",
        (),
    ),
}


def split_shell_line(line: str) -> tuple[dict[str, str], list[str]]:
    """`env K=V ... vllm serve ...` (what serve --dry-run prints) -> (env, argv)."""
    words = shlex.split(line)
    assert words[0] == "env"
    env, i = {}, 1
    while "=" in words[i] and not words[i].startswith("-"):
        key, value = words[i].split("=", 1)
        env[key] = value
        i += 1
    return env, words[i:]
