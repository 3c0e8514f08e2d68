"""One engine command in its own session, killed with its whole process group.

Its own session: the engine's worker processes (vLLM's engine core, one per
rank) are in the same process group as the shell that starts them, so they go
with it however it ends: a clean exit, a crash that leaves workers behind, or
the harness's timeout. The next engine then finds the GPU free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def run_in_own_session(
    command: str, env: dict[str, str], log_path: Path, timeout: float
) -> int | str:
    """`bash -c command` with env, stdout and stderr into log_path; its exit code,
    or "timeout" when it ran past timeout seconds. Its process group is killed either way."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            ["bash", "-c", command],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return code
