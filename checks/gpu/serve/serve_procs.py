"""What /proc says about the server serve-tiny started: its process tree, the
pipeline workers by title, the environment vLLM got, and what is left of it
after the stop (stdlib only: the GPU host's python runs it).

A title is argv[0] as vLLM's setproctitle writes it (`VLLM::Worker_PP0`);
zombies hold nothing and are never counted as left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator


def _stat(pid: int) -> list[str]:
    """The fields after "(comm)" of /proc/PID/stat: state ppid pgrp session ..."""
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rpartition(")")[2].split()


def _argv(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]


def _pids() -> Iterator[int]:
    # Sorted as the numbers are: a report lists the oldest processes first.
    for name in sorted(os.listdir("/proc"), key=lambda n: (len(n), n)):
        if name.isdigit():
            yield int(name)


def _parents() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            ppid = int(_stat(pid)[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(pid)
    return kids


def first_child(pid: int) -> int | None:
    """A child of `pid` (serve starts one: `vllm serve`), or None."""
    children = _parents().get(pid, [])
    return children[0] if children else None


def descendants(root: int) -> list[int]:
    """Every process under `root` (itself excluded), sorted."""
    kids = _parents()
    found, todo = [], list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(kids.get(pid, ()))
    return sorted(found)


def pp_workers(prefix: str, pids: list[int]) -> str:
    """The pipeline workers among `pids`, as vLLM's multiproc executor titles them
    (PREFIX Worker_PP<r>): "TITLE (pid) ...", sorted by title."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                title = fh.read().split(b"\0")[0].decode("utf-8", "replace").strip()
        except OSError:
            continue
        if title.startswith(prefix + "Worker"):
            found.append((title, pid))
    return " ".join(f"{title} ({pid})" for title, pid in sorted(found))


def environ(pid: int | None) -> dict[str, str]:
    """/proc/PID/environ; raises OSError when it cannot be read."""
    with open(f"/proc/{'' if pid is None else pid}/environ", "rb") as fh:
        return dict(
            kv.decode("utf-8", "replace").partition("=")[::2] for kv in fh.read().split(b"\0") if kv
        )


def env_differences(pid: int | None, wanted: list[str]) -> tuple[bool, str]:
    """(ok, what differs): each KEY=VALUE of `wanted` as the process has it, PYTHONPATH
    by its first entry only (the shim folder first). Nothing wanted is not ok."""
    try:
        env = environ(pid)
    except (OSError, ValueError) as exc:
        return False, f"cannot read /proc/{'' if pid is None else pid}/environ ({exc})"
    wrong = []
    for key, _, value in (w.partition("=") for w in wanted):
        have = env.get(key)
        if key == "PYTHONPATH":
            first = (have or "").split(":")[0]
            if first != value.split(":")[0]:
                wrong.append(
                    f"PYTHONPATH starts with {first or 'nothing'}, not {value.split(':')[0]}"
                )
        elif have != value:
            wrong.append(f"{key}={have if have is not None else '(unset)'}, not {value}")
    return bool(wanted) and not wrong, "; ".join(wrong)


def leftovers(session: int | None, port: int | str, prefix: str, known: list[int]) -> list[str]:
    """Processes of our vLLM still running, one line each ("PID (why): argv"): the pids
    seen under serve, vLLM's session, the engine titles, `vllm serve ... --port P`."""
    sid = -1 if session is None else session
    me = os.getpid()
    lines = []
    for pid in _pids():
        if pid == me:
            continue
        try:
            fields, argv = _stat(pid), _argv(pid)
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        line = " ".join(argv)
        serve_on_port = (
            any(os.path.basename(a) == "vllm" for a in argv)
            and "serve" in argv
            and f"--port {port}" in line
        )
        why = (
            "seen under serve"
            if pid in known
            else "in vLLM's session"
            if int(fields[3]) == sid
            else f"titled {prefix}"
            if line.startswith(prefix)
            else f"vllm serve on port {port}"
            if serve_on_port
            else None
        )
        if why:
            lines.append(f"{pid} ({why}): {line[:160]}")
    return lines
