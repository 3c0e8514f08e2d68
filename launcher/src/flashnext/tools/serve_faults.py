"""What a dead or hung vLLM leaves for its supervisor, turned into a cause and a fix.

serve.py watches; this module only reads: the lines vLLM printed (its executor's
"Worker proc ... died unexpectedly (exit code: N)", a bind's "[Errno 98]"), the
argv it was started with (the PLE table is `--engram-config {"mmap_path": ...}`)
and its /metrics (whether in-flight work still moves). Pure, so tested exactly.
"""

from __future__ import annotations

import json
import re
import signal
import urllib.parse
from dataclasses import dataclass

# vLLM 0.33.0 v1/executor/multiproc_executor.py, MultiprocWorkerMonitor.
WORKER_DIED = re.compile(r"Worker proc (\S+) died unexpectedly \(exit code: (-?\d+)\)")
# create_server_socket's bind (entrypoints/launchers/launcher.py) or uvicorn's.
PORT_IN_USE = re.compile(r"\[Errno 98\]|address already in use", re.IGNORECASE)
# A fault in the mmap'd PLE table: the kernel's SIGBUS (faulthandler names it) or an
# EIO from a read of the file.
TABLE_READ = re.compile(r"Fatal Python error: Bus error|\[Errno 5\] Input/output error")
NOTABLE = re.compile(f"{WORKER_DIED.pattern}|{PORT_IN_USE.pattern}|{TABLE_READ.pattern}", re.I)
"""Lines worth keeping whatever scrolls past (ChildOutput keeps the last few)."""

PP_RANK = re.compile(r"_PP(\d+)")


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    fix: str | None = None


def signal_text(code: int) -> str:
    """A process exit code as vLLM logs it (multiprocessing: -N for signal N)."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"{signal.Signals(-code).name} ({-code})"
    except ValueError:
        return f"signal {-code}"


def rank_text(title: str) -> str:
    """`VLLM::Worker_PP1` -> "pipeline rank 1 (VLLM::Worker_PP1)"."""
    m = PP_RANK.search(title)
    return f"pipeline rank {m[1]} ({title})" if m else title


def pick_lost(lost: dict[int, str], lines: list[str] = ()) -> tuple[int, str]:
    """The process to name among those gone. vLLM's executor kills the other ranks once
    one died, so several may be gone by the next look: the one its worker monitor
    names (VllmWorker-N is pipeline rank N at TP=1) died first; else a worker before
    the engine core (a dead rank takes the engine down, not the other way round)."""
    for worker, _code in WORKER_DIED.findall("\n".join(lines)):
        rank = worker.rpartition("-")[2]
        named = [(p, t) for p, t in lost.items() if (m := PP_RANK.search(t)) and m[1] == rank]
        if named:
            return named[0]
    workers = {p: t for p, t in lost.items() if PP_RANK.search(t) or "Worker" in t}
    return sorted((workers or lost).items())[0]


def lost_text(pid: int, title: str) -> str:
    """ "pipeline rank 1 (VLLM::Worker_PP1, pid 42) died" or "engine process T (pid 42) exited"."""
    m = PP_RANK.search(title)
    if m:
        return f"pipeline rank {m[1]} ({title}, pid {pid}) died"
    return f"engine process {title} (pid {pid}) exited"


def table_path(argv: list[str]) -> str | None:
    """The PLE table file vLLM maps: --engram-config's mmap_path (patch 0012)."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--engram-config" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--engram-config="):
            value = arg.partition("=")[2]
        if value is not None:
            try:
                path = json.loads(value).get("mmap_path")
            except (ValueError, AttributeError):
                return None
            return path if isinstance(path, str) else None
    return None


def model_dir(argv: list[str]) -> str | None:
    """`vllm serve MODEL ...`: MODEL."""
    if "serve" in argv:
        i = argv.index("serve")
        if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return argv[i + 1]
    return None


@dataclass(frozen=True)
class TableStat:
    """The table file as the supervisor saw it (os.stat), or why it could not."""

    size: int | None = None
    inode: tuple[int, int] | None = None
    error: str | None = None


def table_change(before: TableStat | None, after: TableStat | None) -> str | None:
    """What happened to the table since vLLM started, or None (unchanged, or no table).
    At PP=1 the PLE gather runs in the engine core, whose SIGBUS vLLM does not log
    (no worker monitor, no faulthandler): the file itself says it was the table."""
    if before is None or after is None or before.error:
        return None
    if after.error:
        return f"it is now {after.error}"
    if after.inode != before.inode:
        return "it was replaced by another file"
    if after.size != before.size:
        return f"it was truncated from {before.size:,} to {after.size:,} bytes"
    return None


def diagnose(
    lines: list[str], argv: list[str], health_url: str, table_changed: str | None = None
) -> Diagnosis | None:
    """Why the server failed, from what it printed and what became of the table since
    the start (`table_change`); None when nothing is recognised."""
    text = "\n".join(lines)
    died = WORKER_DIED.findall(text)
    table = table_path(argv)
    read_fault = TABLE_READ.search(text) or any(code == "-7" for _, code in died)
    if table and (read_fault or table_changed):
        worker = next((w for w, code in died if code == "-7"), "a worker")
        model = model_dir(argv) or "MODEL"
        what = (
            f"{worker} died of SIGBUS/EIO reading the PLE table {table}"
            if read_fault
            else f"the engine died after its PLE table {table} changed: {table_changed}"
        )
        return Diagnosis(
            f"a table fault: {what} (the file was truncated, replaced or unreadable under "
            "the running server; its rows are read through mmap on every step)",
            f"flashnext table verify --model {model} --table {table}  # then serve again; "
            "if it fails, rebuild it with `flashnext table prepare`",
        )
    if died:
        worker, code = died[0]
        return Diagnosis(f"vLLM's worker monitor: {worker} died first ({signal_text(int(code))})")
    if PORT_IN_USE.search(text):
        port = urllib.parse.urlsplit(health_url).port
        return Diagnosis(
            f"vLLM could not bind port {port}: another process took it after preflight "
            "found it free ([Errno 98] Address already in use)",
            f"ss -ltnp 'sport = :{port}'  # find who holds it; stop it or serve with --port N",
        )
    return None


# vLLM 0.33.0's series that move while the engine steps (v1/metrics/loggers.py): every
# step observes iteration_tokens_total (a histogram: its _count), tokens count as made.
PROGRESS = (
    "vllm:iteration_tokens_total_count",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)
BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def progress_reading(text: str) -> tuple[float, float] | None:
    """(requests in flight, progress sum) from /metrics; None without the series."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m[1] in PROGRESS + BUSY:
            try:
                sums[m[1]] = sums.get(m[1], 0.0) + float(m[2])
            except ValueError:
                continue
    if not any(k in sums for k in BUSY) or not any(k in sums for k in PROGRESS):
        return None
    return sum(sums.get(k, 0.0) for k in BUSY), sum(sums.get(k, 0.0) for k in PROGRESS)


class Progress:
    """Whether in-flight work moves: hung once requests are in flight and no step
    happened for `stall_s` (a prefill chunk or a decode step takes seconds at most)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.last: float | None = None
        self.since: float | None = None

    def update(self, reading: tuple[float, float] | None, now: float) -> str | None:
        """Why the engine is hung, or None."""
        if reading is None:
            self.last = self.since = None
            return None
        busy, progress = reading
        if busy == 0:  # nothing in flight: nothing that should move
            self.last, self.since = progress, None
            return None
        if progress != self.last or self.since is None:  # moved, or work just arrived
            self.last, self.since = progress, now
            return None
        if now - self.since >= self.stall_s:
            return (
                f"{busy:.0f} request(s) in flight and no engine step for "
                f"{now - self.since:.0f} s (/metrics: {', '.join(PROGRESS)} unchanged)"
            )
        return None
