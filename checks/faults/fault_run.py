"""A fault under load against a supervised server, ending in a verdict.

The supervisor runs in its own process (supervise_driver.py: flashnext.serve.supervise,
as `flashnext serve` runs it), the server is the stand-in `vllm` on CPU or the real
patched vLLM on a GPU host, and clients stream completions when the fault is injected.
The verdict has issue 41's results-contract fields (`faults` entries):
{what, where, detected_s, exit_code, message, leftover_processes, leftover_gpu_bytes},
plus how the in-flight clients ended (`clients`: errored, completed, hung).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

DRIVER = Path(__file__).resolve().parent / "supervise_driver.py"


@dataclass
class Server:
    """What a fault may act on once the server is ready."""

    driver: subprocess.Popen
    tree: dict[int, str]
    """pid -> argv[0] (vLLM's process title) of every process under the supervisor."""

    def pid_of(self, title_part: str) -> int:
        found = [p for p, t in self.tree.items() if title_part in t]
        if not found:
            raise LookupError(f"no process titled *{title_part}* under the supervisor: "
                              f"{sorted(self.tree.values())}")  # fmt: skip
        return found[0]


@dataclass
class Clients:
    """Streaming clients: each ends as completed, errored (HTTP error, error chunk,
    reset, refused) or is still running (hung) when asked."""

    url: str
    body: dict
    api_key: str | None = None
    ended: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, n: int) -> None:
        for _ in range(n):
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        outcome = "errored"
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=headers,
                              timeout=120) as resp:  # fmt: skip
                if resp.status_code == 200:
                    for line in resp.iter_lines():
                        if line.startswith('data: {"error"'):
                            break
                        if line == "data: [DONE]":
                            outcome = "completed"
        except (httpx.HTTPError, OSError):
            pass
        self.ended.append(outcome)

    def summary(self, wait_s: float) -> dict[str, int]:
        deadline = time.monotonic() + wait_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        return {"errored": self.ended.count("errored"),
                "completed": self.ended.count("completed"), "hung": hung}  # fmt: skip


def driver_env() -> dict[str, str]:
    """This environment with flashnext importable: the driver runs the supervisor, and
    on the GPU host flashnext is this checkout's source, not an installed package (the
    child's env, the plan's, is the config's and stays as it is)."""
    import flashnext

    src = str(Path(flashnext.__file__).resolve().parents[1])
    path = [src, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gpu_bytes_of(pids: list[int]) -> int | None:
    """GPU memory NVML attributes to `pids`; None where there is no NVML (CPU hosts)."""
    from flashnext.facts.gpu import probe_gpus

    facts = probe_gpus()
    if not facts.nvml_available:
        return None
    return sum(
        p.used_memory_bytes or 0 for d in facts.devices for p in d.processes if p.pid in pids
    )


def run_fault(
    what: str,
    where: str,
    *,
    argv: list[str],
    env: dict[str, str],
    options: dict,
    inject: Callable[[Server], None] | None,
    clients: Clients | None = None,
    n_clients: int = 3,
    executable: str | None = None,
    ready_timeout_s: float = 60.0,
    bound_s: float = 60.0,
    before_start: Callable[[], None] | None = None,
    on_ready: Callable[[Server], dict] | None = None,
    log_path: Path | None = None,
) -> dict:
    """Start the supervisor, wait until ready (unless `inject` is None: a fault of the
    start), run `on_ready` (checks of the ready server, kept as the verdict's `on_ready`),
    stream `n_clients` requests, inject, and judge what followed within `bound_s`.
    `log_path`: the supervisor's output, appended as it comes (a run cut short keeps it)."""
    cfg = {"argv": argv, "env": env, "executable": executable, "options": options}
    if before_start:
        before_start()
    # The config goes by stdin: its env may hold an API key, which argv would show.
    driver = subprocess.Popen([sys.executable, str(DRIVER), "-"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              env=driver_env(), text=True)  # fmt: skip
    driver.stdin.write(json.dumps(cfg))
    driver.stdin.close()
    lines: list[tuple[float, str]] = []
    ready = threading.Event()

    def read() -> None:
        log = open(log_path, "a") if log_path else None  # noqa: SIM115 (closed below)
        for line in driver.stderr:
            lines.append((time.monotonic(), line.rstrip("\n")))
            if log:
                log.write(line)
                log.flush()
            if line.startswith("flashnext: ready:"):
                ready.set()
        if log:
            log.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.monotonic()
    tree: dict[int, str] = {}
    checked = None
    if inject is not None:
        deadline = time.monotonic() + ready_timeout_s
        while not ready.wait(0.5) and driver.poll() is None and time.monotonic() < deadline:
            pass
        if not ready.is_set():  # the supervisor gave up or died: no need to wait it out
            driver.kill()
            reader.join(5)
            raise AssertionError(f"not ready (supervisor exit {driver.poll()}):\n"
                                 + "\n".join(x for _, x in lines))  # fmt: skip
        time.sleep(0.3)  # the supervisor lists the engine processes once ready
        tree = _tree(driver.pid)
        try:
            if on_ready is not None:
                checked = on_ready(Server(driver, tree))
            if clients is not None:
                clients.start(n_clients)
                time.sleep(1.0)  # streaming
            t0 = time.monotonic()
            inject(Server(driver, tree))
        except Exception as exc:  # checks or a fault that failed: no verdict, no leftovers
            _stop(driver, tree)
            log = "\n".join(x for _, x in lines)
            raise AssertionError(f"could not inject: {exc}\n{log}") from exc

    try:
        rc = driver.wait(bound_s)
    except subprocess.TimeoutExpired:
        rc = None
        driver.terminate()
        driver.wait(30)
    exited = time.monotonic()
    reader.join(5)
    # Detected: when serve said what failed, else (a clean stop) when it exited.
    ended = next((t for t, x in lines if x.startswith("flashnext: error:")), exited)
    time.sleep(1.0)  # SIGKILL delivery is not instant
    leftover = [p for p in tree if alive(p)]
    message = "\n".join(
        x for _, x in lines if x.startswith(("flashnext: error:", "flashnext: cause:",
                                              "flashnext: fix:", "flashnext: received"))
    )  # fmt: skip
    verdict = {
        "what": what,
        "where": where,
        "detected_s": round(ended - t0, 3) if rc is not None else None,
        "exit_code": rc,
        "message": message or "(no error line)",
        "leftover_processes": len(leftover),
        "leftover_gpu_bytes": gpu_bytes_of(leftover + [driver.pid]) if leftover else 0,
        "log": [x for _, x in lines][-60:],
    }
    if clients is not None:
        verdict["clients"] = clients.summary(30.0)
    if checked is not None:
        verdict["on_ready"] = checked
    for p in leftover:  # never leave a process behind, whatever the verdict
        with contextlib.suppress(OSError):
            os.kill(p, 9)
    return verdict


def _stop(driver: subprocess.Popen, tree: dict[int, str]) -> None:
    driver.terminate()
    try:
        driver.wait(30)
    except subprocess.TimeoutExpired:
        driver.kill()
    for p in tree:
        with contextlib.suppress(OSError):
            os.kill(p, 9)


def _tree(pid: int) -> dict[int, str]:
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for proc in procs:
        try:
            out[proc.pid] = next(iter(proc.cmdline()), "")
        except psutil.Error:
            continue
    return out
