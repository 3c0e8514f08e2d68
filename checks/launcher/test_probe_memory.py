"""Memory probe: real procfs values checked against other tools, and synthetic cgroup trees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from flashnext.facts.host import (
    CGROUP_V1_UNLIMITED_THRESHOLD,
    parse_meminfo,
    parse_proc_cgroup,
    probe_memory,
)
from flashnext.facts.schema import MemoryFacts

# Runs probe_memory() in a fresh interpreter and prints it as JSON (limits are per process).
CHILD = textwrap.dedent(
    """
    import dataclasses, json
    from flashnext.facts.host import probe_memory
    print(json.dumps(dataclasses.asdict(probe_memory())))
    """
)


def child_facts(prefix: list[str] | None = None, **kwargs) -> dict:
    out = subprocess.run(
        [*(prefix or []), sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        check=True,
        **kwargs,
    )
    return json.loads(out.stdout)


# ---------------------------------------------------------------- this machine


def test_mem_total_matches_free():
    facts = probe_memory()
    assert facts.error is None
    free = subprocess.run(["free", "-b"], capture_output=True, text=True, check=True).stdout
    mem = next(line.split() for line in free.splitlines() if line.startswith("Mem:"))
    swap = next(line.split() for line in free.splitlines() if line.startswith("Swap:"))
    assert facts.mem_total_bytes == int(mem[1])
    assert facts.swap_total_bytes == int(swap[1])
    assert 0 < facts.mem_available_bytes <= facts.mem_total_bytes


def test_memlock_follows_prlimit_in_a_child():
    if shutil.which("prlimit") is None:
        pytest.skip("util-linux prlimit not installed")
    limits = ["prlimit", "--memlock=65536:131072"]
    facts = child_facts(limits)
    assert (facts["memlock_soft_bytes"], facts["memlock_hard_bytes"]) == (65536, 131072)
    # `ulimit -l` under the same limits reports KiB: the probe agrees with the shell.
    shell = subprocess.run(
        [*limits, "bash", "-c", "ulimit -Sl; ulimit -Hl"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert [int(v) * 1024 for v in shell] == [65536, 131072]


def test_memlock_unlimited_is_none():
    # Raising the hard limit needs CAP_SYS_RESOURCE: skip where this is not root.
    proc = subprocess.run(
        ["prlimit", "--memlock=unlimited:unlimited", "true"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot raise RLIMIT_MEMLOCK here: {proc.stderr.strip()}")
    facts = child_facts(["prlimit", "--memlock=unlimited:unlimited"])
    assert facts["memlock_soft_bytes"] is None
    assert facts["memlock_hard_bytes"] is None


def test_dev_shm_matches_statvfs_and_df():
    facts = probe_memory()
    df = subprocess.run(
        ["df", "-B1", "--output=size", "/dev/shm"], capture_output=True, text=True, check=True
    ).stdout.split()
    assert facts.shm_total_bytes == int(df[1])
    assert 0 <= facts.shm_free_bytes <= facts.shm_total_bytes


def test_cpu_count_follows_affinity():
    assert probe_memory().cpu_count == int(
        subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout
    )
    if shutil.which("taskset"):
        assert child_facts(["taskset", "-c", "0"])["cpu_count"] == 1


def test_ptrace_scope_matches_procfs():
    path = Path("/proc/sys/kernel/yama/ptrace_scope")
    expected = int(path.read_text()) if path.exists() else None
    assert probe_memory().ptrace_scope == expected


def _own_memory_cgroup() -> tuple[str, Path] | None:
    """(version, directory) of this process's memory cgroup, found the way the probe finds it."""
    from flashnext.facts.host import _cgroup_dir
    from flashnext.facts.storage import read_mountinfo

    v1, v2 = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    for m in read_mountinfo():
        if v1 and m.fs_type == "cgroup" and "memory" in m.super_options.split(","):
            return "v1", Path(_cgroup_dir(m, v1, "/"))
        if v2 and not v1 and m.fs_type == "cgroup2":
            return "v2", Path(_cgroup_dir(m, v2, "/"))
    return None


def test_real_cgroup_limit_in_a_child_cgroup():
    """A child process in a new cgroup sees the tightest limit on its path (the parent's)."""
    found = _own_memory_cgroup()
    if found is None:
        pytest.skip("this process is in no memory cgroup")
    version, own = found
    limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
    if version == "v2" and "memory" not in (own / "cgroup.subtree_control").read_text():
        pytest.skip("cgroup v2 memory controller not delegated to child cgroups here")
    outer = own / f"flashnext-probe-test-{os.getpid()}"
    inner = outer / "inner"
    try:
        inner.mkdir(parents=True)
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup here: {exc}")
    try:
        (outer / limit_file).write_text(str(3 << 30))
        (inner / limit_file).write_text(str(5 << 30))
        facts = child_facts(
            ["sh", "-c", f'echo $$ > "{inner}/cgroup.procs" && exec "$@"', "sh"],
        )
        assert facts["cgroup_version"] == version
        assert facts["cgroup_memory_limit_bytes"] == 3 << 30
        assert facts["error"] is None
    finally:
        for d in (inner, outer):
            if d.exists():
                d.rmdir()


# ---------------------------------------------------------------- synthetic trees


def test_parse_meminfo_units():
    text = (
        "MemTotal:       32768000 kB\nMemAvailable:   16384000 kB\nSwapTotal: 0 kB\n"
        "SwapFree: 0 kB\nHugePages_Total:      64\nHugePages_Free:       60\n"
        "Hugepagesize:       2048 kB\nCached: 1 kB\n"
    )
    assert parse_meminfo(text) == {
        "mem_total_bytes": 32768000 * 1024,
        "mem_available_bytes": 16384000 * 1024,
        "swap_total_bytes": 0,
        "swap_free_bytes": 0,
        "hugepages_total": 64,  # counts, not kB
        "hugepages_free": 60,
        "hugepage_size_bytes": 2 << 20,
    }


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def synthetic_host(
    tmp_path: Path, proc_cgroup: str, mountinfo: str, files: dict[str, str]
) -> tuple[str, str]:
    """A /proc and a / root under tmp_path; returns (proc, root) for probe_memory."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    _write(proc / "meminfo", "MemTotal: 1000 kB\nMemAvailable: 500 kB\n")
    _write(proc / "self" / "cgroup", proc_cgroup)
    _write(proc / "self" / "mountinfo", mountinfo)
    (root / "dev").mkdir(parents=True)
    for rel, text in files.items():
        _write(root / rel, text)
    return str(proc), str(root)


V2_MOUNT = "35 27 0:30 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"


def test_v2_tightest_limit_on_the_path(tmp_path):
    proc, root = synthetic_host(
        tmp_path,
        "0::/system.slice/vllm.service\n",
        V2_MOUNT,
        {
            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
            "sys/fs/cgroup/system.slice/memory.max": str(16 << 30) + "\n",
            "sys/fs/cgroup/system.slice/vllm.service/memory.max": "max\n",
        },
    )
    facts = probe_memory(proc, root)
    assert (facts.cgroup_version, facts.cgroup_memory_limit_bytes) == ("v2", 16 << 30)
    assert facts.mem_total_bytes == 1000 * 1024
    assert facts.shm_total_bytes is None  # no /dev/shm in this root: a fact, not an error
    assert facts.error is None


def test_v2_namespaced_mount_root(tmp_path):
    # Inside a container with a cgroup namespace the mount shows only the container's subtree.
    proc, root = synthetic_host(
        tmp_path,
        "0::/\n",
        "35 27 0:30 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
        {
            "sys/fs/cgroup/cgroup.controllers": "memory pids\n",
            "sys/fs/cgroup/memory.max": str(40 << 30) + "\n",
        },
    )
    assert probe_memory(proc, root).cgroup_memory_limit_bytes == 40 << 30


def test_v2_without_memory_controller_is_no_cgroup(tmp_path):
    proc, root = synthetic_host(
        tmp_path, "0::/user.slice\n", V2_MOUNT, {"sys/fs/cgroup/cgroup.controllers": "cpu pids\n"}
    )
    facts = probe_memory(proc, root)
    assert (facts.cgroup_version, facts.cgroup_memory_limit_bytes, facts.error) == (
        None,
        None,
        None,
    )


HYBRID = (
    "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
)


@pytest.mark.parametrize(
    ("leaf", "parent", "expected"),
    [
        ("9223372036854771712", "9223372036854771712", None),  # v1's "unlimited" sentinel
        (str(8 << 30), "9223372036854771712", 8 << 30),
        ("9223372036854771712", str(6 << 30), 6 << 30),
    ],
)
def test_v1_hybrid_host(tmp_path, leaf, parent, expected):
    # This machine's layout: memory on a v1 hierarchy, an empty cgroup2 at /sys/fs/cgroup/unified.
    proc, root = synthetic_host(
        tmp_path,
        "4:memory:/process_api/job1\n1:cpu:/\n0::/\n",
        HYBRID,
        {
            "sys/fs/cgroup/memory/process_api/job1/memory.limit_in_bytes": leaf + "\n",
            "sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": parent + "\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
            "sys/fs/cgroup/unified/cgroup.controllers": "\n",
        },
    )
    facts = probe_memory(proc, root)
    assert (facts.cgroup_version, facts.cgroup_memory_limit_bytes) == ("v1", expected)
    assert int("9223372036854771712") >= CGROUP_V1_UNLIMITED_THRESHOLD


def test_invisible_cgroup_dir_is_reported(tmp_path):
    proc, root = synthetic_host(tmp_path, "4:memory:/docker/abc\n", HYBRID, {})
    facts = probe_memory(proc, root)
    assert facts.cgroup_version == "v1"
    assert facts.cgroup_memory_limit_bytes is None
    assert "cgroup directory" in facts.error and "not visible" in facts.error


def test_unreadable_proc_is_an_error_not_a_crash(tmp_path):
    facts = probe_memory(str(tmp_path / "no-proc"), str(tmp_path))
    assert isinstance(facts, MemoryFacts)
    assert facts.mem_total_bytes is None
    assert "meminfo" in facts.error and "cgroup" in facts.error
    assert facts.cpu_count >= 1  # what does not depend on /proc is still filled in


def test_rlim_infinity_maps_to_none(monkeypatch):
    # Where the real limit cannot be raised (no CAP_SYS_RESOURCE), check the mapping itself.
    import resource

    monkeypatch.setattr(
        resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    )
    facts = probe_memory()
    assert (facts.memlock_soft_bytes, facts.memlock_hard_bytes) == (None, None)
