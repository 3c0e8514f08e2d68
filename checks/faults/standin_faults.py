"""Issue 41's faults under load against the stand-in `vllm`: one function per fault,
each returning its verdict (fault_run.run_fault). The CPU tests assert on them
(checks/launcher/test_serve_faults.py) and cpu_verdicts.py records them."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "fixtures" / "standin_vllm"))
from fault_run import Clients, run_fault  # noqa: E402
from harness import MODEL_NAME, free_port, serve_argv, standin_env, urls  # noqa: E402

WHERE = "CPU stand-in"
POLL_S = 0.1
HANG_S = 2.0
STOP_S = 5.0


def options(port: int, **more) -> dict:
    return {"model_name": MODEL_NAME, "api_key": None, "startup_timeout_s": 30.0,
            "poll_interval_s": POLL_S, "progress_interval_s": 1.0, "health_interval_s": 0.5,
            "stop_timeout_s": STOP_S, "hang_timeout_s": HANG_S, **urls(port), **more}  # fmt: skip


def load(port: int) -> Clients:
    """Streams long enough to be in flight when the fault comes (200 tokens x 50 ms)."""
    body = {"model": MODEL_NAME, "prompt": [11, 12, 13], "max_tokens": 200, "stream": True}
    return Clients(f"http://127.0.0.1:{port}/v1/completions", body)


def _fault(what: str, inject, *, env: dict | None = None, argv_extra=(), port=None, **kw):
    port = port or free_port()
    env = standin_env(STANDIN_PP_WORKERS="1", STANDIN_TOKEN_INTERVAL_S="0.05", **(env or {}))
    return run_fault(what, WHERE, argv=serve_argv(port) + list(argv_extra), env=env,
                     options=options(port), inject=inject, clients=load(port), **kw)  # fmt: skip


def sigkill_rank(tmp: Path) -> dict:
    return _fault("SIGKILL of pipeline rank 1 under load",
                  lambda s: os.kill(s.pid_of("Worker_PP1"), signal.SIGKILL))  # fmt: skip


def sigstop_engine(tmp: Path) -> dict:
    return _fault("SIGSTOP of the engine core under load",
                  lambda s: os.kill(s.pid_of("EngineCore"), signal.SIGSTOP),
                  env={"STANDIN_ENGINE_STEPS": "1"})  # fmt: skip


def deadlocked_engine(tmp: Path) -> dict:
    # The engine runs (state S) but no step ends: only the /metrics progress check sees it.
    return _fault("engine deadlocked (steps stop, process runs) under load",
                  lambda s: os.kill(s.pid_of("EngineCore"), signal.SIGUSR1),
                  env={"STANDIN_ENGINE_STEPS": "1"})  # fmt: skip


def table_truncated(tmp: Path) -> dict:
    table = tmp / "ple.bin"
    table.write_bytes(os.urandom(1 << 20))
    engram = json.dumps({"mmap_path": str(table)})
    verdict = _fault("PLE table truncated under the running server",
                     lambda s: os.truncate(table, 0),
                     argv_extra=["--engram-config", engram])  # fmt: skip
    verdict["table"] = str(table)
    return verdict


def table_truncated_pp1(tmp: Path) -> dict:
    """At PP=1 the engine core reads the table and dies of the SIGBUS without a word:
    the supervisor finds the cause in the file (shorter than when vLLM started)."""
    table = tmp / "ple-pp1.bin"
    table.write_bytes(os.urandom(1 << 20))
    engram = json.dumps({"mmap_path": str(table)})
    port = free_port()
    argv = serve_argv(port)
    argv[argv.index("--pipeline-parallel-size") + 1] = "1"
    env = standin_env(STANDIN_PP_WORKERS="1", STANDIN_TOKEN_INTERVAL_S="0.05")
    verdict = run_fault("PLE table truncated under the running server (PP=1)", WHERE,
                        argv=argv + ["--engram-config", engram], env=env,
                        options=options(port), inject=lambda s: os.truncate(table, 0),
                        clients=load(port))  # fmt: skip
    verdict["table"] = str(table)
    return verdict


def sigterm(tmp: Path) -> dict:
    return _fault("SIGTERM to serve under load", lambda s: s.driver.send_signal(signal.SIGTERM))


def port_taken(tmp: Path) -> dict:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    try:
        verdict = run_fault("port taken between preflight and vLLM's bind", WHERE,
                            argv=serve_argv(port), env=standin_env(), options=options(port),
                            inject=None, bound_s=30)  # fmt: skip
    finally:
        squatter.close()
    verdict["port"] = port
    return verdict


FAULTS = (sigkill_rank, sigstop_engine, deadlocked_engine, table_truncated, table_truncated_pp1,
          sigterm, port_taken)  # fmt: skip
