"""Supervise `vllm serve`: start it, wait until it really serves, then watch it.

What it does, in order (TGI's launcher is the model):
1. start the child in its own process group, stream its output, keep a tail;
2. forward SIGINT/SIGTERM to the group; SIGTERM → `stop_timeout_s` → SIGKILL;
3. wait for `/health` (connection refused while vLLM loads) with a timeout and a
   "waiting for /health (Ns)" line every `progress_interval_s`;
4. read `/v1/models` (model name, context length) and send one smoke completion;
5. report ready, then keep watching: the child exiting, `/health` failing
   `health_failures_max` times in a row, a vLLM engine process (titled
   `VLLM::...` by vLLM's setproctitle) vanishing while HTTP still answers (seen
   within `poll_interval_s`, the dead pipeline rank named), or a hung engine (a
   process of it stopped, or requests in flight while /metrics shows no engine
   step, for `hang_timeout_s`; seen within that plus `health_interval_s`) all
   end the run with a non-zero exit, the child's output tail and, where its
   output says why (a worker's exit signal, a SIGBUS in the PLE table, a port
   taken), the cause and the fix (tools/serve_faults.py).
Under systemd (or a Quadlet unit with Notify=true) it reports READY=1 only after
the smoke completion, plus STATUS lines while waiting and STOPPING=1 on a signal.

This is the only module that execs (STYLE.md); it never imports vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from flashnext.tools.serve_faults import (
    NOTABLE,
    WORKER_DIED,
    Progress,
    TableStat,
    diagnose,
    lost_text,
    pick_lost,
    progress_reading,
    rank_text,
    table_change,
    table_path,
)

EXIT_OK = 0
EXIT_FAILED = 1


def stat_table(argv: list[str]) -> TableStat | None:
    """The PLE table vLLM maps (its --engram-config), as it is now; None without one."""
    path = table_path(argv)
    if path is None:
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return TableStat(error="missing")
    except OSError as exc:
        return TableStat(error=f"unreadable ({exc.strerror})")
    if not os.access(path, os.R_OK):
        return TableStat(size=st.st_size, inode=(st.st_dev, st.st_ino), error="unreadable")
    return TableStat(size=st.st_size, inode=(st.st_dev, st.st_ino))


def engine_title_prefix(env: Mapping[str, str]) -> str:
    """vLLM titles its engine and workers `VLLM::EngineCore_DP0`, `VLLM::Worker_PP1`, ...
    (setproctitle; the prefix is vLLM's VLLM_PROCESS_NAME_PREFIX, default "VLLM")."""
    return env.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"


SMOKE_PROMPT = "The capital of Japan is"


class ServeError(Exception):
    """A problem the user can fix before starting (bad key file, missing binary)."""


@dataclass(frozen=True)
class ReadyInfo:
    """What the server said about itself once it answered a completion."""

    base_url: str
    model_name: str
    max_model_len: int | None
    startup_s: float
    smoke_text: str


# ---------------------------------------------------------------- inputs


MAX_KEY_FILE_BYTES = 4096  # a key is tens of bytes; a device or a log is not a key file


def load_api_key(env: Mapping[str, str], key_file: str | Path | None = None) -> str | None:
    """The API key vLLM will demand: from `key_file` if given, else `VLLM_API_KEY`.

    A key file must hold the key on its first line (a regular file, or a pipe such as
    `<(pass show vllm)`, at most 4 KiB); an empty, unreadable or oversized file is an
    error rather than silently serving without a key.
    """
    from flashnext.facts.jsonfile import PIPE_DEADLINE_S, JsonFileError, read_bounded

    if key_file is None:
        return env.get("VLLM_API_KEY") or None
    fix = "pass --api-key-file with a readable file holding the key, or set VLLM_API_KEY"
    try:
        raw = read_bounded(key_file, "key file", MAX_KEY_FILE_BYTES,
                           pipe_deadline_s=PIPE_DEADLINE_S)  # fmt: skip
    except JsonFileError as exc:
        raise ServeError(f"the API key file {exc}; {fix}") from None
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ServeError(f"the API key file {key_file} is not UTF-8 text; {fix}") from None
    key = lines[0].strip() if lines else ""
    if not key:
        raise ServeError(f"the API key file {key_file} is empty; write the key on its first line")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        # An HTTP header cannot carry it: every request would be refused.
        raise ServeError(f"the API key in {key_file} holds control characters; {fix}")
    return key


def resolve_executable(argv: list[str], env: Mapping[str, str]) -> str:
    """Find argv[0] the way the child's exec will (the child's PATH), or say how to get it."""
    if not argv:
        raise ServeError("empty command line for the server")
    found = shutil.which(argv[0], path=env.get("PATH", os.defpath))
    if found is None:
        raise ServeError(
            f"{argv[0]!r} not found on the server's PATH; pass --vllm-env with the dir "
            "`pins/build-env` prints"
        )
    return found


BUILD_HEARTBEAT_S = 30.0


def build_vllm_env(
    build_env: Path,
    environ: Mapping[str, str],
    say: Callable[[str], None],
    heartbeat_s: float = BUILD_HEARTBEAT_S,
) -> str:
    """Run pins/build-env and return the env dir it prints (its last stdout line).

    Says first what a first build costs; pins/build-env's own progress goes to our
    stderr, and a line every `heartbeat_s` shows it is still working (its pip
    steps are quiet for minutes). A second run is a cache hit in about a second.
    """
    from flashnext.checkout import BUILD_CACHE_TEXT, BUILD_DOWNLOAD_TEXT, BUILD_INSTALLED_TEXT

    cache = environ.get("FLASHNEXT_CACHE") or str(Path.home() / ".cache" / "flashnext")
    say(
        f"no vLLM env yet: building the pinned, patched vLLM with {build_env}; the first "
        f"build downloads {BUILD_DOWNLOAD_TEXT}, {BUILD_INSTALLED_TEXT}: {BUILD_CACHE_TEXT} "
        f"in {cache} (10-25 minutes on the 2 cores pins/README.md measured; later runs reuse it)"
    )
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(build_env)],
        env=dict(environ),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # pins/build-env's progress, as it prints it
        text=True,
    )
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(heartbeat_s):
            say(f"still building the vLLM env ({time.monotonic() - started:.0f} s)")

    beat = threading.Thread(target=heartbeat, daemon=True)
    beat.start()
    try:
        out, _ = proc.communicate()
    except BaseException:
        proc.terminate()  # Ctrl-C reached it too; it cleans up its half-built dir
        proc.wait()
        raise
    finally:
        done.set()
    lines = [ln for ln in out.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise ServeError(
            f"{build_env} failed (exit {proc.returncode}); its output is above. Rerun "
            f"`{build_env}` alone to retry (it resumes from its cache), then serve again"
        )
    say(f"vLLM env ready in {time.monotonic() - started:.0f} s: {lines[-1]}")
    return lines[-1]


# ---------------------------------------------------------------- child process


class ChildOutput:
    """Copies the child's stdout/stderr lines to `sink`; keeps the last lines of each.

    vLLM logs to stdout (VLLM_LOGGING_STREAM) and tracebacks go to stderr, so the
    stderr tail is the one worth showing when the server dies; the combined tail is
    the fallback when stderr stayed empty.
    """

    def __init__(
        self, proc: subprocess.Popen[bytes], sink: IO[str], keep: int = 40, keep_err: int = 80
    ) -> None:
        self.tail: deque[str] = deque(maxlen=keep)
        self.err_tail: deque[str] = deque(maxlen=keep_err)
        # Lines that say why a server died, kept whatever scrolls past after them.
        self.notable: deque[str] = deque(maxlen=20)
        self._lock = threading.Lock()
        self._sink = sink
        self._threads = [
            threading.Thread(target=self._pump, args=(stream, stream is proc.stderr), daemon=True)
            for stream in (proc.stdout, proc.stderr)
            if stream is not None
        ]
        for t in self._threads:
            t.start()

    def _pump(self, stream: IO[bytes], is_err: bool) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._lock:
                self.tail.append(line)
                if is_err:
                    self.err_tail.append(line)
                if NOTABLE.search(line):
                    self.notable.append(line)
                self._sink.write(line + "\n")
                self._sink.flush()
        stream.close()

    def drain(self, timeout_s: float = 2.0) -> None:
        """Wait briefly for the pipes to empty after the child exits."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def tail_text(self) -> tuple[str, str]:
        """(which, text): the stderr tail if stderr said anything, else the combined one."""
        with self._lock:
            if self.err_tail:
                return "stderr", "\n".join(self.err_tail)
            return "output", "\n".join(self.tail)


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by {name} ({sig})"
    return f"exited with code {returncode}"


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_child(
    proc: subprocess.Popen[bytes], sig: int, timeout_s: float, say: Callable[[str], None]
) -> bool:
    """Send `sig` to the child's group; SIGKILL it after `timeout_s`. True if it stopped itself."""
    pgid = proc.pid  # start_new_session=True: the child leads its own group
    if proc.poll() is None:
        signal_group(pgid, sig)
        # A stopped process (SIGSTOP, a hung engine someone paused) acts on `sig` only
        # once resumed; SIGCONT is ignored by the running ones.
        signal_group(pgid, signal.SIGCONT)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            say(f"server did not stop within {timeout_s:g}s of {signal.Signals(sig).name}; SIGKILL")
            signal_group(pgid, signal.SIGKILL)
            proc.wait()
            return False
    # Engine/worker processes outlive a dead API server; leave none behind.
    signal_group(pgid, signal.SIGKILL)
    return True


# ---------------------------------------------------------------- the process tree


def engine_processes(root_pid: int, prefix: str = "VLLM::") -> dict[int, str]:
    """Descendants of `root_pid` that vLLM titled `VLLM::...` (engine core, workers)."""
    try:
        descendants = psutil.Process(root_pid).children(recursive=True)
    except psutil.Error:  # the root is gone: nothing of it is left to find
        return {}
    found: dict[int, str] = {}
    for proc in descendants:
        try:
            # vLLM retitles its processes (setproctitle): the title is argv[0].
            title = next(iter(proc.cmdline()), "")
        except psutil.Error:
            continue  # exited while we looked
        if title.startswith(prefix):
            found[proc.pid] = title
    return found


# ---------------------------------------------------------------- systemd


def sd_notify(state: str) -> bool:
    """Tell systemd (or podman's Quadlet with Notify=true) our state; no-op without a socket.

    The sd_notify(3) protocol: one datagram of newline-separated KEY=VALUE to the
    AF_UNIX socket named by NOTIFY_SOCKET ("@name" is an abstract socket).
    """
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(addr)
            sock.sendall(state.encode())
    except OSError:
        return False  # a vanished manager must not take the server down
    return True


# ---------------------------------------------------------------- HTTP


def _request(
    url: str, api_key: str | None, timeout_s: float, body: dict[str, Any] | None = None
) -> tuple[int, bytes]:
    """(status, body); status 0 when nothing answered (refused, reset, timed out)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if body is None:
            resp = httpx.get(url, headers=headers, timeout=timeout_s)
        else:
            resp = httpx.post(url, json=body, headers=headers, timeout=timeout_s)
    except (httpx.HTTPError, OSError):
        return 0, b""
    return resp.status_code, resp.content


def _error_text(status: int, body: bytes) -> str:
    if status == 0:
        return "no answer"
    try:
        error = json.loads(body)["error"]
        # vLLM's errors carry {"message": ...}; its auth middleware a bare string
        return f"HTTP {status}: {error if isinstance(error, str) else error['message']}"
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}"


def models_url_for(completion_url: str) -> str:
    base, sep, _ = completion_url.rpartition("/completions")
    if not sep:
        raise ServeError(f"completion URL {completion_url!r} does not end in /completions")
    return base + "/models"


def read_model_card(
    models_url: str, model_name: str, api_key: str | None, timeout_s: float
) -> tuple[int | None, str | None]:
    """(max_model_len, error) from /v1/models for `model_name`."""
    status, body = _request(models_url, api_key, timeout_s)
    if status != 200:
        return None, f"{models_url}: {_error_text(status, body)}"
    try:
        cards = json.loads(body)["data"]
    except (ValueError, KeyError, TypeError, RecursionError):
        cards = None
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        return None, f"{models_url}: not an OpenAI model list"
    for card in cards:
        if card.get("id") == model_name:
            max_len = card.get("max_model_len")
            if max_len is not None and (type(max_len) is not int or max_len <= 0):
                return None, f"{models_url}: max_model_len {max_len!r} is not a token count"
            return max_len, None
    names = ", ".join(str(c.get("id")) for c in cards) or "none"
    return None, f"{models_url}: model {model_name!r} not served (served: {names})"


def smoke_completion(
    completion_url: str, model_name: str, api_key: str | None, timeout_s: float
) -> tuple[str | None, str | None]:
    """(generated text, error) of one short greedy completion."""
    body = {"model": model_name, "prompt": SMOKE_PROMPT, "max_tokens": 8, "temperature": 0}
    status, raw = _request(completion_url, api_key, timeout_s, body)
    if status != 200:
        return None, f"{completion_url}: {_error_text(status, raw)}"
    try:
        doc = json.loads(raw)
        text = doc["choices"][0]["text"]
        generated = doc["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        text = generated = None
    if not isinstance(text, str) or type(generated) is not int:
        return None, f"{completion_url}: answer is not an OpenAI completion"
    if not generated:
        return None, f"{completion_url}: the completion generated no tokens"
    return text, None


def key_demanded(models_url: str, timeout_s: float) -> str | None:
    """None if the server refuses a request without the API key (HTTP 401), else why
    serving it would be a hole: a key was configured, so nothing may be served open."""
    status, body = _request(models_url, None, timeout_s)
    if status == 401:
        return None
    if status == 0:
        return (f"{models_url} did not answer a request without the API key, so whether "
                "the key is demanded is unknown")  # fmt: skip
    return (
        f"{models_url} answered a request without the API key ({_error_text(status, body)}): "
        "the server does not demand the key, so anyone who reaches it can use it; check that "
        "nothing in its environment or argv overrides VLLM_API_KEY"
    )


# ---------------------------------------------------------------- supervision


class _Signals:
    """Records SIGINT/SIGTERM for the main loop (which forwards them) while installed."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.received = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(
    argv: list[str],
    env: dict[str, str],
    *,
    health_url: str,
    completion_url: str,
    model_name: str,
    api_key: str | None,
    startup_timeout_s: float,
    executable: str | None = None,
    models_url: str | None = None,
    progress_interval_s: float = 10.0,
    poll_interval_s: float = 0.5,
    health_interval_s: float = 5.0,
    health_failures_max: int = 3,
    request_timeout_s: float = 10.0,
    smoke_timeout_s: float = 300.0,
    stop_timeout_s: float = 30.0,
    hang_timeout_s: float = 120.0,
    log_stream: IO[str] | None = None,
    on_ready: Callable[[ReadyInfo], None] | None = None,
) -> int:
    """Run `argv` with exactly `env`, supervise it until it ends or we are told to stop.

    `executable`: the binary to run as argv[0] (the chosen env's `vllm`); default:
    argv[0] looked up on env's PATH. Returns 0 when a forwarded SIGINT/SIGTERM stopped
    the server cleanly, 1 on any failure (startup timeout, smoke request failed, child
    died, health lost).
    """
    out = log_stream or sys.stderr

    def say(msg: str) -> None:
        out.write(f"flashnext: {msg}\n")
        out.flush()

    try:
        executable = executable or resolve_executable(argv, env)
        models_url = models_url or models_url_for(completion_url)
    except ServeError as exc:
        say(f"error: {exc}")
        return EXIT_FAILED

    # The notify socket is ours: vLLM must not report readiness before we checked it.
    child_env = {k: v for k, v in env.items() if k != "NOTIFY_SOCKET"}
    # vLLM takes its key from the environment (vllm/envs.py VLLM_API_KEY), never from
    # argv where `ps` shows it to every user; a key in `env` is never dropped.
    api_key = api_key or child_env.get("VLLM_API_KEY") or None
    if api_key:
        child_env["VLLM_API_KEY"] = api_key
    else:
        child_env.pop("VLLM_API_KEY", None)
    with _Signals() as signals:
        started = time.monotonic()
        say(f"starting: {' '.join(argv)}")
        sd_notify("STATUS=starting vLLM")
        proc = subprocess.Popen(
            argv,
            executable=executable,
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: signals reach engine and workers
        )
        output = ChildOutput(proc, out)
        watch = _Watch(proc, output, say, signals, stop_timeout_s, engine_title_prefix(env))
        watch.argv, watch.health_url, watch.hang_timeout_s = argv, health_url, hang_timeout_s
        watch.table_at_start = stat_table(argv)
        try:
            ready = watch.until_ready(
                health_url, models_url, completion_url, model_name, api_key,
                startup_timeout_s, progress_interval_s, poll_interval_s,
                request_timeout_s, smoke_timeout_s, started,
            )  # fmt: skip
            if ready is None:
                return watch.result
            auth = (
                "the API key demanded (a request without it got HTTP 401)"
                if api_key
                else "no API key (anyone who reaches the address can use it)"
            )
            say(
                f"ready: {ready.base_url} serving {ready.model_name!r}, context "
                f"{ready.max_model_len if ready.max_model_len is not None else 'unknown'} "
                f"tokens, started in {ready.startup_s:.1f}s, {auth}"
            )
            sd_notify(
                f"READY=1\nSTATUS=serving {ready.model_name} at {ready.base_url}, context "
                f"{ready.max_model_len} tokens"
            )
            if on_ready is not None:
                on_ready(ready)
            return watch.while_serving(
                health_url, api_key, poll_interval_s, health_interval_s,
                health_failures_max, request_timeout_s,
            )  # fmt: skip
        finally:
            if proc.poll() is None:  # an exception escaped: never leave vLLM behind
                stop_child(proc, signal.SIGTERM, stop_timeout_s, say)
            output.drain()


class _Watch:
    """The two phases of supervision, sharing the child and the shutdown path."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        output: ChildOutput,
        say: Callable[[str], None],
        signals: _Signals,
        stop_timeout_s: float,
        title_prefix: str,
    ) -> None:
        self.proc = proc
        self.output = output
        self.say = say
        self.signals = signals
        self.stop_timeout_s = stop_timeout_s
        self.title_prefix = title_prefix
        self.result = EXIT_FAILED
        self.argv: list[str] = []
        self.health_url = ""
        self.hang_timeout_s = 120.0
        self.table_at_start: TableStat | None = None

    def fail(self, why: str) -> int:
        """Stop the child (if alive), print why with its output tail, return 1."""
        still_running = self.proc.poll() is None
        if still_running:
            stop_child(self.proc, signal.SIGTERM, self.stop_timeout_s, self.say)
        self.output.drain()
        which, tail = self.output.tail_text()
        self.say(f"error: {why}")
        sd_notify(f"STATUS=failed: {why}")
        if tail:
            self.say(f"last lines of the server's {which}:\n{tail}")
        changed = table_change(self.table_at_start, stat_table(self.argv))
        found = diagnose(list(self.output.notable), self.argv, self.health_url, changed)
        if found is not None:
            self.say(f"cause: {found.cause}")
            if found.fix:
                self.say(f"fix: {found.fix}")
        self.result = EXIT_FAILED
        return EXIT_FAILED

    def check_child_and_signals(self) -> int | None:
        """An exit code if the run is over (we were told to stop, or the child died)."""
        if self.signals.received is not None:
            sig = self.signals.received
            name = signal.Signals(sig).name
            self.say(f"received {name}, stopping the server")
            sd_notify(f"STOPPING=1\nSTATUS=stopping on {name}")
            clean = stop_child(self.proc, sig, self.stop_timeout_s, self.say)
            self.output.drain()
            self.result = EXIT_OK if clean else EXIT_FAILED
            return self.result
        rc = self.proc.poll()
        if rc is not None:
            signal_group(self.proc.pid, signal.SIGKILL)  # orphaned engine/workers
            return self.fail(f"the server {describe_exit(rc)}")
        return None

    def until_ready(
        self,
        health_url: str,
        models_url: str,
        completion_url: str,
        model_name: str,
        api_key: str | None,
        startup_timeout_s: float,
        progress_interval_s: float,
        poll_interval_s: float,
        request_timeout_s: float,
        smoke_timeout_s: float,
        started: float,
    ) -> ReadyInfo | None:
        next_progress = started + progress_interval_s
        while True:
            if self.check_child_and_signals() is not None:
                return None
            now = time.monotonic()
            status, _ = _request(health_url, None, min(request_timeout_s, poll_interval_s * 4))
            if status == 200:
                break
            if now - started >= startup_timeout_s:
                self.fail(
                    f"{health_url} did not answer 200 within {startup_timeout_s:g}s "
                    f"(last: {_error_text(status, b'') if status else 'no answer'}); "
                    "raise --startup-timeout if loading is just slow"
                )
                return None
            if now >= next_progress:
                self.say(f"waiting for /health ({now - started:.0f}s)")
                sd_notify(f"STATUS=waiting for /health ({now - started:.0f}s)")
                next_progress += progress_interval_s
            time.sleep(poll_interval_s)

        def probe() -> tuple[int | None, str | None, str | None]:
            max_len, err = read_model_card(models_url, model_name, api_key, request_timeout_s)
            if err is not None:
                return None, None, err
            text, err = smoke_completion(completion_url, model_name, api_key, smoke_timeout_s)
            if err is None and api_key:
                err = key_demanded(models_url, request_timeout_s)
            return max_len, text, err

        # The first completion can take minutes (or crash the engine): keep watching the
        # child and our signals while it runs.
        box: list[tuple[int | None, str | None, str | None]] = []

        def probe_into_box() -> None:
            try:
                box.append(probe())
            except Exception as exc:  # noqa: BLE001 (a reply we failed to foresee)
                box.append((None, None, f"the readiness probe failed: {exc!r}"))

        worker = threading.Thread(target=probe_into_box, daemon=True)
        worker.start()
        while worker.is_alive():
            if self.check_child_and_signals() is not None:
                return None
            worker.join(poll_interval_s)
        max_model_len, text, err = box[0]
        if err is not None:
            # A dying server drops the connection a moment before it exits: when that is
            # what happened, its exit (code, signal, output) is the report to give.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=2.0)
            if self.check_child_and_signals() is not None:
                return None
            self.fail(f"smoke test failed: {err}")
            return None
        if self.check_child_and_signals() is not None:
            return None
        base_url = completion_url.rpartition("/completions")[0]
        return ReadyInfo(base_url, model_name, max_model_len, time.monotonic() - started, text)

    def while_serving(
        self,
        health_url: str,
        api_key: str | None,
        poll_interval_s: float,
        health_interval_s: float,
        health_failures_max: int,
        request_timeout_s: float,
    ) -> int:
        engines = engine_processes(self.proc.pid, self.title_prefix)
        if engines:
            names = ", ".join(f"{t} ({p})" for p, t in sorted(engines.items()))
            self.say(f"watching engine processes: {names}")
        else:
            self.say(f"no {self.title_prefix} engine processes found; watching /health only")
        failures = 0
        next_health = time.monotonic() + health_interval_s
        metrics_url = health_url.rpartition("/health")[0] + "/metrics"
        progress = Progress(self.hang_timeout_s)
        stopped_since: dict[int, float] = {}
        while True:
            done = self.check_child_and_signals()
            if done is not None:
                return done
            alive = engine_processes(self.proc.pid, self.title_prefix)
            lost = {p: t for p, t in engines.items() if p not in alive}
            if lost and self.proc.poll() is not None:
                continue  # the server itself exited (its children were reparented): say that
            if lost:
                # vLLM's worker monitor says which rank died first, and of what (a SIGBUS
                # in the table): give it a moment to speak before we judge.
                workers = any("Worker" in t for t in lost.values())
                said_by = time.monotonic() + (1.0 if workers else 0.0)
                while time.monotonic() < said_by and not any(
                    WORKER_DIED.search(x) for x in self.output.notable
                ):
                    time.sleep(0.05)
                pid, title = pick_lost(lost, list(self.output.notable))
                status, _ = _request(health_url, None, min(request_timeout_s, 2.0))
                http = "still answers" if status else "does not answer"
                return self.fail(
                    f"{lost_text(pid, title)} while the HTTP server {http} "
                    f"(/health: {status or 'no answer'})"
                )
            now = time.monotonic()
            for pid in [p for p in engines if p in alive]:
                if _stopped(pid):
                    stopped_since.setdefault(pid, now)
                else:
                    stopped_since.pop(pid, None)
            hung = [p for p, t in stopped_since.items() if now - t >= self.hang_timeout_s]
            if hung:
                pid = hung[0]
                return self.fail(
                    f"the engine is hung: {rank_text(engines[pid])} (pid {pid}) has been stopped "
                    f"(state T) for {now - stopped_since[pid]:.0f} s while the HTTP server "
                    "answers; taking the server down"
                )
            if now >= next_health:
                next_health += health_interval_s
                status, body = _request(health_url, None, request_timeout_s)
                if status == 200:
                    failures = 0
                else:
                    failures += 1
                    self.say(
                        f"/health failed ({_error_text(status, body)}), "
                        f"{failures} of {health_failures_max} in a row"
                    )
                    if failures >= health_failures_max:
                        return self.fail(
                            f"{health_url} failed {failures} times in a row; the engine is "
                            "not serving"
                        )
                status, body = _request(metrics_url, api_key, request_timeout_s)
                reading = (
                    progress_reading(body.decode("utf-8", "replace")) if status == 200 else None
                )
                why = progress.update(reading, time.monotonic())
                if why is not None:
                    return self.fail(f"the engine is hung: {why}; taking the server down")
            time.sleep(poll_interval_s)


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, a debugger): it answers nothing until resumed."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
