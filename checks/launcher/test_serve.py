"""serve.supervise against the stand-in `vllm`, started through PATH like the real one."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext import serve  # noqa: E402
from harness import (  # noqa: E402
    MODEL_NAME,
    finish,
    free_port,
    read_until,
    serve_argv,
    standin_env,
    urls,
)

FAST = {"poll_interval_s": 0.05, "progress_interval_s": 0.5, "stop_timeout_s": 5.0}


def stop_when_ready(ready: list) -> callable:
    """on_ready that records the info, then SIGINTs us: supervise's handler forwards it."""

    def on_ready(info: serve.ReadyInfo) -> None:
        ready.append(info)
        os.kill(os.getpid(), signal.SIGINT)

    return on_ready


def run_supervise(env_overrides: dict[str, str] | None = None, stop_ready=False, **kwargs):
    port = free_port()
    log = io.StringIO()
    ready: list[serve.ReadyInfo] = []
    options = {
        "model_name": MODEL_NAME,
        "api_key": None,
        "startup_timeout_s": 20.0,
        "health_interval_s": 0.2,
        **FAST,
        **urls(port),
        **kwargs,
    }
    # A supervisor that misses a failure would watch forever: SIGINT it after a minute
    # (it then returns 0, which the failure tests reject) instead of hanging the suite.
    watchdog = threading.Timer(60, os.kill, (os.getpid(), signal.SIGINT))
    watchdog.start()
    try:
        rc = serve.supervise(
            serve_argv(port, max_model_len=131072),
            standin_env(**(env_overrides or {})),
            log_stream=log,
            on_ready=stop_when_ready(ready) if stop_ready else ready.append,
            **options,
        )
    finally:
        watchdog.cancel()
    return rc, log.getvalue(), ready


def pid_alive(pid: int, grace_s: float = 5.0) -> bool:
    """Whether `pid` still runs after up to `grace_s` (SIGKILL delivery is not instant)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return False
        if state == "Z":  # a zombie still answers kill(0); it is gone for our purposes
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)


# ---------------------------------------------------------------- failures after ready


def test_child_exit_reports_code_and_output_tail():
    rc, log, ready = run_supervise({"STANDIN_EXIT_AFTER_S": "3", "STANDIN_EXIT_CODE": "3"})
    assert rc == 1
    assert len(ready) == 1  # it was ready first
    assert "flashnext: error: the server exited with code 3\n" in log
    # vLLM logs to stdout; the traceback on stderr is what the tail shows
    tail = log.split("last lines of the server's stderr:\n", 1)[1]
    assert tail.startswith("Traceback (most recent call last):\n")
    assert "RuntimeError: stand-in told to exit" in tail
    assert "Starting vLLM API server" not in tail
    # the engine the dead server left behind is reaped with its process group
    engine_pid = int(re.search(r"VLLM::EngineCore_DP0 \((\d+)\)", log).group(1))
    assert not pid_alive(engine_pid)


def test_child_killed_by_signal_names_the_signal():
    rc, log, _ = run_supervise({"STANDIN_EXIT_AFTER_S": "0.3", "STANDIN_EXIT_SIGNAL": "9"})
    assert rc == 1
    assert "flashnext: error: the server was killed by SIGKILL (9)\n" in log


def test_engine_death_while_http_answers_is_fatal():
    rc, log, ready = run_supervise({"STANDIN_ENGINE_DIE_AFTER_S": "1.5"})
    assert rc == 1 and ready
    m = re.search(r"watching engine processes: VLLM::EngineCore_DP0 \((\d+)\)", log)
    assert m, log
    pid = m.group(1)
    assert (
        f"flashnext: error: engine process VLLM::EngineCore_DP0 (pid {pid}) exited while the "
        "HTTP server still answers (/health: 200)\n"
    ) in log
    assert "EngineCore encountered a fatal error (stand-in)" in log


def test_engine_titles_follow_vllm_process_name_prefix():
    rc, log, _ = run_supervise(
        {"STANDIN_ENGINE_DIE_AFTER_S": "1.0", "VLLM_PROCESS_NAME_PREFIX": "FLASH"}
    )
    assert rc == 1
    assert re.search(r"watching engine processes: FLASH::EngineCore_DP0 \(\d+\)", log), log
    assert "engine process FLASH::EngineCore_DP0 (pid " in log


def test_health_failing_n_times_in_a_row_is_fatal():
    rc, log, ready = run_supervise(
        {"STANDIN_HEALTH_FAIL_AFTER_S": "0.5"}, health_interval_s=0.1, health_failures_max=3
    )
    assert rc == 1 and ready
    assert "/health failed (HTTP 503: ), 1 of 3 in a row" in log
    assert "/health failed (HTTP 503: ), 2 of 3 in a row" in log
    assert "flashnext: error: http://127.0.0.1:" in log
    assert "/health failed 3 times in a row; the engine is not serving\n" in log


# ---------------------------------------------------------------- failures before ready


def test_startup_timeout_prints_progress_and_stops_the_child():
    t0 = time.monotonic()
    rc, log, ready = run_supervise({"STANDIN_HANG": "1"}, startup_timeout_s=1.6)
    assert rc == 1 and not ready
    assert time.monotonic() - t0 < 10
    assert re.search(r"^flashnext: waiting for /health \(\d+s\)$", log, re.M), log
    assert "/health did not answer 200 within 1.6s (last: no answer); raise --startup-timeout" in (
        log
    )
    assert "loading weights (told to hang)" in log  # the child's own output is streamed


def test_child_dying_during_startup_is_reported():
    rc, log, ready = run_supervise({"STANDIN_LOAD_S": "abc"})  # the stand-in crashes on it
    assert rc == 1 and not ready
    assert "flashnext: error: the server exited with code 1\n" in log
    assert "ValueError: could not convert string to float: 'abc'" in log


def test_server_death_during_a_slow_smoke_request_is_seen_at_once():
    t0 = time.monotonic()
    rc, log, ready = run_supervise(
        {"STANDIN_TTFT_S": "60", "STANDIN_EXIT_AFTER_S": "0.5", "STANDIN_EXIT_CODE": "4"}
    )
    assert rc == 1 and not ready
    assert "flashnext: error: the server exited with code 4\n" in log
    assert time.monotonic() - t0 < 15  # not after the 60 s first token


def test_smoke_failure_is_fatal():
    rc, log, ready = run_supervise({"STANDIN_COMPLETION_FAIL": "1"})
    assert rc == 1 and not ready
    assert "smoke test failed: http://127.0.0.1:" in log
    assert "/v1/completions: HTTP 500: stand-in told to fail completions\n" in log


def test_wrong_model_name_is_reported_with_what_is_served():
    rc, log, _ = run_supervise(model_name="other-model")
    assert rc == 1
    assert f"model 'other-model' not served (served: {MODEL_NAME})" in log


def test_a_key_in_the_environment_is_handed_on_and_demanded():
    # VLLM_API_KEY in the environment: the supervisor sends it, and proves it is demanded
    rc, log, ready = run_supervise({"VLLM_API_KEY": "sekret"}, stop_ready=True, api_key=None)
    assert rc == 0 and ready[0].model_name == MODEL_NAME, log
    assert "the API key demanded (a request without it got HTTP 401)" in log


def test_the_key_reaches_vllm_through_its_environment_not_argv():
    # The stand-in, like vLLM, reads VLLM_API_KEY; the supervisor's env has none: only
    # supervise can have put the key there, and a request without it must be refused.
    rc, log, ready = run_supervise(stop_ready=True, api_key="sekret")
    assert rc == 0 and ready, log
    assert "the API key demanded (a request without it got HTTP 401)" in log
    started = next(ln for ln in log.splitlines() if ln.startswith("flashnext: starting: "))
    assert "sekret" not in started


def test_a_server_that_serves_open_despite_the_key_is_not_reported_ready():
    rc, log, ready = run_supervise({"STANDIN_IGNORE_API_KEY": "1"}, api_key="sekret")
    assert rc == 1 and not ready
    assert "/v1/models answered a request without the API key (HTTP 200" in log
    assert "the server does not demand the key" in log


def test_without_a_key_ready_says_the_api_is_open():
    rc, log, _ = run_supervise(stop_ready=True)
    assert rc == 0
    assert "no API key (anyone who reaches the address can use it)" in log


def test_missing_binary_says_how_to_get_it():
    log = io.StringIO()
    env = standin_env()
    env["PATH"] = "/nonexistent"
    rc = serve.supervise(
        ["vllm", "serve", "m"], env, model_name="m", api_key=None, startup_timeout_s=1,
        log_stream=log, **urls(1),
    )  # fmt: skip
    assert rc == 1
    assert log.getvalue() == (
        "flashnext: error: 'vllm' not found on the server's PATH; pass --vllm-env with the "
        "dir `pins/build-env` prints\n"
    )


# ---------------------------------------------------------------- ready report


def test_ready_reports_url_model_and_context_length():
    rc, log, ready = run_supervise(stop_ready=True)
    assert rc == 0
    assert "flashnext: received SIGINT, stopping the server\n" in log
    (info,) = ready
    assert info.model_name == MODEL_NAME
    assert info.max_model_len == 131072
    assert info.base_url.endswith("/v1")
    assert info.smoke_text == "".join(f" tok{i}" for i in range(8))
    assert re.search(
        rf"flashnext: ready: {re.escape(info.base_url)} serving '{MODEL_NAME}', "
        r"context 131072 tokens, started in \d+\.\ds, no API key \(anyone who reaches the "
        r"address can use it\)\n",
        log,
    )


# ---------------------------------------------------------------- signals (supervisor as a process)

DRIVER = textwrap.dedent(
    """
    import json, sys
    from flashnext import serve
    argv, env, kw = json.loads(sys.argv[1])
    sys.exit(serve.supervise(argv, env, **kw))
    """
)


def start_driver(env_overrides: dict[str, str], stop_timeout_s: float = 5.0):
    import json

    port = free_port()
    kw = {
        "model_name": MODEL_NAME, "api_key": None, "startup_timeout_s": 20.0,
        "poll_interval_s": 0.05, "stop_timeout_s": stop_timeout_s, **urls(port),
    }  # fmt: skip
    arg = json.dumps([serve_argv(port), standin_env(**env_overrides), kw])
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, arg],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded_and_the_group_stops(sig, notify_socket):
    proc = start_driver({})
    seen = read_until(proc, "watching engine processes")
    engine_pid = int(re.search(r"VLLM::EngineCore_DP0 \((\d+)\)", seen).group(1))
    proc.send_signal(sig)
    rest = finish(proc, 20)
    assert proc.returncode == 0, rest
    assert f"flashnext: received {sig.name}, stopping the server\n" in rest
    assert f"received signal {int(sig)}, shutting down" in rest  # the child got the same signal
    assert not pid_alive(engine_pid)
    assert f"STOPPING=1\nSTATUS=stopping on {sig.name}" in notify_socket()


def test_sigterm_escalates_to_sigkill_after_the_timeout():
    proc = start_driver({"STANDIN_IGNORE_SIGTERM": "1"}, stop_timeout_s=1.0)
    seen = read_until(proc, "watching engine processes")
    engine_pid = int(re.search(r"VLLM::EngineCore_DP0 \((\d+)\)", seen).group(1))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = finish(proc, 20)
    assert proc.returncode == 1, rest
    assert "ignoring signal 15" in rest
    assert "flashnext: server did not stop within 1s of SIGTERM; SIGKILL\n" in rest
    assert 1.0 <= time.monotonic() - t0 < 10
    assert not pid_alive(engine_pid)


# ---------------------------------------------------------------- inputs


def test_api_key_from_file_beats_env(tmp_path):
    key = tmp_path / "key"
    key.write_text("from-file\n")
    assert serve.load_api_key({"VLLM_API_KEY": "from-env"}, key) == "from-file"
    assert serve.load_api_key({"VLLM_API_KEY": "from-env"}) == "from-env"
    assert serve.load_api_key({}) is None


def test_api_key_file_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(serve.ServeError, match="is empty; write the key on its first line"):
        serve.load_api_key({}, empty)
    with pytest.raises(serve.ServeError, match=r"the API key file .*missing: cannot read it "
                       r"\(no such file\); pass --api-key-file"):  # fmt: skip
        serve.load_api_key({}, tmp_path / "missing")


def test_api_key_files_are_read_bounded_and_never_block(tmp_path, monkeypatch):
    from flashnext.facts import jsonfile

    with pytest.raises(serve.ServeError, match="/dev/zero: not a regular file"):
        serve.load_api_key({}, "/dev/zero")  # a device: never read to its end
    with pytest.raises(serve.ServeError, match="a directory, not a key file"):
        serve.load_api_key({}, tmp_path)
    big = tmp_path / "big"
    big.write_text("k" * (serve.MAX_KEY_FILE_BYTES + 1))
    with pytest.raises(serve.ServeError, match="over 4096 bytes, so not a key file"):
        serve.load_api_key({}, big)
    ctl = tmp_path / "ctl"
    ctl.write_bytes(b"se\x00cret\n")
    with pytest.raises(serve.ServeError, match="holds control characters"):
        serve.load_api_key({}, ctl)
    # A FIFO nobody writes (a forgotten `mkfifo`): an error within the deadline, no hang.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(jsonfile, "PIPE_DEADLINE_S", 0.3)
    started = time.monotonic()
    with pytest.raises(serve.ServeError, match="a pipe that wrote nothing to its end within"):
        serve.load_api_key({}, fifo)
    assert time.monotonic() - started < 5


def test_api_key_from_a_pipe(tmp_path):
    # `--api-key-file <(pass show vllm)`: a pipe whose writer answers at once
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as fh:
            fh.write("from-pipe\n")

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert serve.load_api_key({"VLLM_API_KEY": "from-env"}, fifo) == "from-pipe"
    finally:
        writer.join(5)


def test_describe_exit():
    assert serve.describe_exit(0) == "exited with code 0"
    assert serve.describe_exit(-15) == "was killed by SIGTERM (15)"
    assert serve.describe_exit(-signal.SIGSEGV) == "was killed by SIGSEGV (11)"


# ---------------------------------------------------------------- sd_notify


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    import socket

    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))

    def messages() -> list[str]:
        out = []
        while True:
            try:
                out.append(sock.recv(4096).decode())
            except BlockingIOError:
                return out

    yield messages
    sock.close()


def test_ready_is_notified_only_after_the_smoke_completion(notify_socket):
    rc, log, ready = run_supervise({"STANDIN_EXIT_AFTER_S": "3", "STANDIN_LOAD_S": "1.2"})
    msgs = notify_socket()
    assert msgs[0] == "STATUS=starting vLLM"
    assert any(re.fullmatch(r"STATUS=waiting for /health \(\d+s\)", m) for m in msgs), msgs
    (ready_msg,) = [m for m in msgs if m.startswith("READY=1")]
    assert ready_msg == (
        f"READY=1\nSTATUS=serving {MODEL_NAME} at {ready[0].base_url}, context 131072 tokens"
    )
    assert msgs.index(ready_msg) < len(msgs) - 1
    assert msgs[-1] == "STATUS=failed: the server exited with code 1"
    assert rc == 1


def test_the_child_does_not_inherit_the_notify_socket(notify_socket):
    # vLLM must not tell systemd it is ready before the smoke request passed
    env = standin_env(NOTIFY_SOCKET="/should/not/leak")
    log = io.StringIO()
    rc = serve.supervise(
        ["sh", "-c", 'echo "NOTIFY_SOCKET=${NOTIFY_SOCKET-unset}"; exit 3'],
        env, model_name=MODEL_NAME, api_key=None, startup_timeout_s=5,
        log_stream=log, **urls(free_port()), **FAST,
    )  # fmt: skip
    assert rc == 1
    assert "NOTIFY_SOCKET=unset\n" in log.getvalue()
    assert "flashnext: error: the server exited with code 3\n" in log.getvalue()


def test_sd_notify_without_a_socket_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert serve.sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "/nonexistent/socket")
    assert serve.sd_notify("READY=1") is False
