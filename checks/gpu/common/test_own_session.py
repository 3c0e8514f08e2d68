"""own_session.run_in_own_session: a real shell whose background child stands in
for an engine's workers; the child goes with it, on a timeout and on an exit."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from own_session import run_in_own_session  # noqa: E402


def alive(pid: int) -> bool:
    """A zombie counts as gone: once its parent is killed, whoever adopts it reaps it
    (or, in a container whose init reaps nothing, never does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone_soon(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_timeout_kills_the_command_and_its_children(tmp_path):
    pid_file, log = tmp_path / "worker.pid", tmp_path / "engine.log"
    command = f"sleep 300 & echo $! > {pid_file}; sleep 300"
    started = time.monotonic()
    assert run_in_own_session(command, dict(os.environ), log, timeout=3) == "timeout"
    assert time.monotonic() - started < 60
    worker = int(pid_file.read_text())
    assert gone_soon(worker)


def test_an_exit_code_is_returned_its_output_logged_and_its_children_killed(tmp_path):
    pid_file, log = tmp_path / "worker.pid", tmp_path / "engine.log"
    command = f'sleep 300 & echo $! > {pid_file}; echo "out $GREETING"; echo err >&2; exit 3'
    env = dict(os.environ) | {"GREETING": "from the env"}
    assert run_in_own_session(command, env, log, timeout=60) == 3
    assert log.read_text().splitlines() == ["out from the env", "err"]
    assert gone_soon(int(pid_file.read_text()))
