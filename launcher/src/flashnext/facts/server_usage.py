"""What a server running on this host uses now: its process tree's RSS and pinned
pages, and GPU memory. A probe gives a value or the reason it cannot; never raises.

The server is found by who listens on the URL's port (psutil), so bench needs no
pid; its tree is that process and its descendants (vLLM's engine core and
workers).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import psutil

from flashnext.facts.gpu import probe_gpus


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def find_listener(host: str, port: int) -> tuple[int | None, str | None]:
    """(pid, None) of the process listening on `port` here, or (None, why)."""
    if not is_loopback(host):
        return None, f"the server is not on this host's loopback ({host}): not sampled"
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError) as exc:
        return None, f"cannot list listening sockets: {exc}"
    for conn in conns:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid:
                return conn.pid, None
            return None, f"port {port} listens, but its process is not visible to this user"
    return None, f"nothing listens on port {port} here"


def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


_FLAG = re.compile(r"^--max-num-seqs(?:=(\d+))?$")


def max_num_seqs_of(pid: int) -> int | None:
    """--max-num-seqs from the server's command line (None when not given there)."""
    try:
        argv = psutil.Process(pid).cmdline()
    except psutil.Error:
        return None
    for i, arg in enumerate(argv):
        m = _FLAG.match(arg)
        if m and m[1]:
            return int(m[1])
        if m and i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
    return None


def _vm_pin_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmPin:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# Our QSA host pools (patch 0021's HostArena) are anonymous shared mmaps advised
# MADV_HUGEPAGE, then cudaHostRegister'ed: the driver pins them without counting
# VmPin (run h1 read 0 under a serving PP=3), so they are found by their mapping.
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ \S+ \S+ \S+ \d+\s*(.*)$")
_ANONYMOUS = ("", "/dev/zero (deleted)")


def _host_arena_bytes(pid: int) -> int | None:
    """Bytes of anonymous mappings advised MADV_HUGEPAGE (smaps VmFlags `hg`): the
    QSA pools as HostArena maps them; None when smaps cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            text = fh.read()
    except OSError:
        return None
    total = size = 0
    anonymous = False
    for line in text.splitlines():
        m = _MAPPING.match(line)
        if m:
            anonymous, size = m[1].strip() in _ANONYMOUS, 0
        elif line.startswith("Size:"):
            size = int(line.split()[1]) * 1024
        elif line.startswith("VmFlags:") and anonymous and "hg" in line.split()[1:]:
            total += size
    return total


@dataclass(frozen=True)
class Usage:
    """One sample. Bytes, or None with the reason in `unavailable`."""

    rss_bytes: int | None
    pinned_bytes: int | None
    """Pinned host bytes summed over the tree: kernel-pinned pages (VmPin) plus the QSA
    host pools (`_host_arena_bytes`), which CUDA pins without VmPin seeing them. Other
    cudaHostAlloc buffers (vLLM's staging) are pinned by the driver and not counted."""
    gpu_used_bytes: int | None
    """Memory in use on all GPUs (total - free): the server's and anything else's."""
    gpu_tree_bytes: int | None
    """GPU memory NVML attributes to the tree's pids (None in a container whose pids
    NVML does not see)."""
    processes: int
    unavailable: dict[str, str]


def sample(pid: int | None, why_not: str | None = None, gpus: bool = True) -> Usage:
    """The tree of `pid` now; with pid None every field is unavailable for `why_not`."""
    if pid is None:
        why = why_not or "no server process"
        return Usage(None, None, None, None, 0, dict.fromkeys(("rss", "pinned", "gpu"), why))
    procs = tree(pid)
    unavailable: dict[str, str] = {}
    rss = pinned = 0
    pids = set()
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            pids.add(proc.pid)
        except psutil.Error:
            continue  # exited while we looked
        pinned += (_vm_pin_bytes(proc.pid) or 0) + (_host_arena_bytes(proc.pid) or 0)
    if not pids:
        unavailable = dict.fromkeys(("rss", "pinned", "gpu"), f"process {pid} is gone")
        return Usage(None, None, None, None, 0, unavailable)
    gpu_used = gpu_tree = None
    if gpus:
        facts = probe_gpus()
        if not facts.nvml_available or not facts.devices:
            unavailable["gpu"] = facts.error or "NVML lists no GPU"
        else:
            gpu_used = sum(d.memory_total_bytes - d.memory_free_bytes for d in facts.devices)
            mine = [
                p.used_memory_bytes
                for d in facts.devices
                for p in d.processes
                if p.pid in pids and p.used_memory_bytes is not None
            ]
            gpu_tree = sum(mine) if mine else None
    else:
        unavailable["gpu"] = "not asked for"
    return Usage(rss, pinned, gpu_used, gpu_tree, len(pids), unavailable)
