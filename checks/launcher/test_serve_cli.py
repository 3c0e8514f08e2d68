"""`flashnext serve` end to end as a real process: preflight, plan, exec, supervise.

The plan's own argv (`vllm serve ...`) and env are executed; PATH finds the
stand-in `vllm` first, exactly where the pinned env's would be.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from harness import finish, free_port, read_until, standin_env  # noqa: E402

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"
TABLE = "/nvme/flashnext/ple-table.bin"  # replayed facts say it is there, on NVMe


def start_serve(model_dir: Path, port: int, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(FACTS),
         "--model", str(model_dir), "--table", TABLE, "--port", str(port),
         "--startup-timeout", "60"],
        env=standin_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def test_serve_runs_the_plan_supervised_and_stops_on_sigterm(full_skeleton):
    port = free_port()
    proc = start_serve(full_skeleton, port)
    seen = read_until(proc, r"flashnext: watching engine processes", timeout_s=90)
    # the child got the plan's command line: PP=3, the planned context, our port
    started = re.search(r"flashnext: starting: (vllm serve .*)\n", seen).group(1)
    assert "--pipeline-parallel-size 3" in started and f"--port {port}" in started
    assert re.search(
        rf"flashnext: ready: http://127\.0\.0\.1:{port}/v1 serving 'qwen3\.8-flash-next', "
        r"context 262144 tokens",
        seen,
    ), seen
    proc.send_signal(signal.SIGTERM)
    rest = finish(proc, 60)
    assert proc.returncode == 0, rest
    assert "flashnext: received SIGTERM, stopping the server\n" in rest


def test_serve_exits_non_zero_when_the_engine_dies(full_skeleton):
    proc = start_serve(full_skeleton, free_port(), STANDIN_ENGINE_DIE_AFTER_S="2")
    out = finish(proc, 120)
    assert proc.returncode == 1, out
    assert "exited while the HTTP server still answers (/health: 200)" in out


def test_serve_reads_the_api_key_file(full_skeleton, tmp_path):
    key = tmp_path / "key"
    key.write_text("sekret\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(FACTS),
         "--model", str(full_skeleton), "--table", TABLE, "--port", str(port),
         "--api-key-file", str(key)],
        env={**standin_env(), "VLLM_API_KEY": "sekret"},  # the server demands it
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    read_until(proc, r"flashnext: ready: ", timeout_s=90)
    os.kill(proc.pid, signal.SIGINT)
    out = finish(proc, 60)
    assert proc.returncode == 0, out
