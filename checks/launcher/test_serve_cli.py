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


def test_serve_hands_the_key_file_to_vllm_and_it_is_demanded(full_skeleton, tmp_path):
    """The key in --api-key-file reaches vLLM (before the fix vLLM served open: the key
    was only sent by the supervisor); never through argv, which `ps` shows to all."""
    import httpx
    import psutil

    key = tmp_path / "key"
    key.write_text("sekret\n")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(FACTS),
         "--model", str(full_skeleton), "--table", TABLE, "--port", str(port),
         "--api-key-file", str(key)],
        env={**standin_env(), "VLLM_API_KEY": "another-key"},  # the file's key wins
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        seen = read_until(proc, r"flashnext: ready: ", timeout_s=90)
        assert "the API key demanded (a request without it got HTTP 401)" in seen
        models = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(models, timeout=10).status_code == 401
        bearer = {"Authorization": "Bearer another-key"}
        assert httpx.get(models, headers=bearer, timeout=10).status_code == 401
        bearer = {"Authorization": "Bearer sekret"}
        assert httpx.get(models, headers=bearer, timeout=10).status_code == 200
        for child in psutil.Process(proc.pid).children(recursive=True):
            assert not any("sekret" in arg for arg in child.cmdline()), child.cmdline()
    finally:
        os.kill(proc.pid, signal.SIGINT)
    out = finish(proc, 60)
    assert proc.returncode == 0, out
    assert "sekret" not in seen + out


def test_serve_refuses_an_unreadable_key_file_before_starting(full_skeleton, tmp_path):
    key = tmp_path / "key"
    key.write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(FACTS),
         "--model", str(full_skeleton), "--table", TABLE, "--port", str(free_port()),
         "--api-key-file", str(key)],
        env=standin_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"the API key file {key} is empty; write the key on its first line" in proc.stderr
    assert "starting:" not in proc.stderr + proc.stdout
