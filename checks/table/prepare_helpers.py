"""Helpers the prepare tests share: the --force this disk may need, and a
`table prepare` killed mid-copy in a real subprocess."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from flashnext.facts.storage import probe_storage
from flashnext.table.storage_policy import storage_refusal
from ple_checkpoint import Checkpoint

CLI = "from flashnext.cli import main; main()"
# The same CLI with each commit (fdatasync) held 20 ms: a 64 MiB copy in 1 MiB
# syncs then takes > 1 s, so a signal sent after 4 MiB lands mid-copy even on
# a fast disk or a loaded machine, where the unpaced copy can finish between
# two polls of the journal.
PACED_CLI = (
    "import os, time; _sync = os.fdatasync; "
    "os.fdatasync = lambda fd: (time.sleep(0.02), _sync(fd))[1]; " + CLI
)


def force_if_needed(out_dir: Path) -> list[str]:
    """This disk may be one prepare refuses (CI VMs report virtio disks as rotational)."""
    return ["--force"] if storage_refusal(probe_storage(str(out_dir))) else []


def journal_bytes(journal: Path) -> int:
    """Bytes the resume journal says are committed (0 while it does not exist yet)."""
    try:
        return json.loads(journal.read_text())["committed_bytes"]
    except (OSError, ValueError, KeyError):
        return 0


def kill_mid_copy(ckpt: Checkpoint, out: Path, *extra: str) -> int:
    """Start prepare in a subprocess, SIGKILL it after >= 4 MiB are committed;
    return the committed bytes (chunks and syncs of 1 MiB, so the kill lands mid-copy)."""
    journal = out.with_name(out.name + ".partial.json")
    argv = [sys.executable, "-c", PACED_CLI, "table", "prepare", "--model", str(ckpt.path),
            "--out", str(out), "--chunk-bytes", str(1 << 20), "--sync-bytes", str(1 << 20),
            *extra, *force_if_needed(out.parent)]  # fmt: skip
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while journal_bytes(journal) < (4 << 20) and child.poll() is None:
        assert time.monotonic() < deadline, "prepare made no progress"
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "prepare finished before the kill"
    assert not out.exists()
    return journal_bytes(journal)
