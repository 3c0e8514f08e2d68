"""server_usage reads a live process tree: the QSA host pools count as pinned bytes
by their mapping (patch 0021's HostArena: an anonymous mmap advised MADV_HUGEPAGE),
since CUDA's registration leaves VmPin at 0 (run h1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from flashnext.facts import server_usage

MIB = 1 << 20
# A child mapping memory the way HostArena does (8 MiB, advised) and a plain one
# (4 MiB, not advised), touched so both are resident; it waits on stdin.
CHILD = """
import mmap, sys
arena = mmap.mmap(-1, 8 << 20)
try:
    arena.madvise(mmap.MADV_HUGEPAGE)
except (AttributeError, OSError) as exc:
    print("no-thp", exc, flush=True); sys.exit(0)
plain = mmap.mmap(-1, 4 << 20)
arena.write(b"x" * (8 << 20)); plain.write(b"y" * (4 << 20))
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stdout.readline()
    if line.startswith("no-thp"):
        proc.wait(10)
        pytest.skip(f"this kernel has no MADV_HUGEPAGE: {line.strip()}")
    assert line.strip() == "ready"
    yield proc
    proc.stdin.close()
    proc.wait(10)


def test_an_advised_anonymous_mapping_counts_once_a_plain_one_not(child):
    assert server_usage._host_arena_bytes(child.pid) == 8 * MIB


def test_sample_counts_the_pools_as_pinned(child):
    usage = server_usage.sample(child.pid, gpus=False)
    assert usage.pinned_bytes == 8 * MIB + (server_usage._vm_pin_bytes(child.pid) or 0)
    assert usage.rss_bytes >= 12 * MIB


def test_a_gone_process_reads_as_unknown_not_zero():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    assert server_usage._host_arena_bytes(proc.pid) is None
