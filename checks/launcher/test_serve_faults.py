"""Issue 41's faults under load, against the stand-in `vllm` supervised by serve in a
process of its own: a rank SIGKILLed, the engine stopped or deadlocked while HTTP
answers, the PLE table truncated under the server, SIGTERM, and a port taken before
vLLM binds it. Each ends in a verdict in the results contract's `faults` shape."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
import standin_faults as sf  # noqa: E402
from flashnext.tools import serve_faults  # noqa: E402
from standin_faults import HANG_S, POLL_S, STOP_S  # noqa: E402


def assert_taken_down(v: dict, bound_s: float) -> None:
    assert v["exit_code"] == 1, v
    assert v["detected_s"] is not None and v["detected_s"] <= bound_s, v
    assert v["leftover_processes"] == 0, v
    assert v["clients"]["hung"] == 0 and v["clients"]["completed"] == 0, v


def test_a_pipeline_rank_sigkilled_under_load_is_named_and_taken_down(tmp_path):
    v = sf.sigkill_rank(tmp_path)
    # the bound: one poll, plus a /health probe (2 s at most), plus stopping the group
    assert_taken_down(v, POLL_S + 2.0 + STOP_S)
    assert "flashnext: error: pipeline rank 1 (VLLM::Worker_PP1" in v["message"], v["message"]
    assert "died while the HTTP server" in v["message"]
    assert (
        "flashnext: cause: vLLM's worker monitor: VllmWorker-1 died first (SIGKILL (9))"
        in v["message"]
    )


def test_a_stopped_engine_while_http_answers_is_a_hang(tmp_path):
    v = sf.sigstop_engine(tmp_path)
    assert_taken_down(v, HANG_S + POLL_S + 1.0 + STOP_S)
    assert v["detected_s"] >= HANG_S
    assert "the engine is hung: VLLM::EngineCore_DP0" in v["message"]
    assert "has been stopped (state T)" in v["message"]


def test_a_deadlocked_engine_is_seen_by_its_metrics_not_moving(tmp_path):
    v = sf.deadlocked_engine(tmp_path)
    assert_taken_down(v, HANG_S + 2 * 0.5 + STOP_S + 1.0)
    assert "the engine is hung: 3 request(s) in flight and no engine step for" in v["message"]
    assert "vllm:iteration_tokens_total_count" in v["message"]


def test_a_table_truncated_under_the_server_is_a_table_fault_with_a_fix(tmp_path):
    v = sf.table_truncated(tmp_path)
    table = v["table"]
    assert_taken_down(v, POLL_S + 2.0 + STOP_S)
    assert "pipeline rank 0 (VLLM::Worker_PP0" in v["message"]  # the rank holding the PLE
    assert (
        f"flashnext: cause: a table fault: VllmWorker-0 died of SIGBUS/EIO reading the PLE "
        f"table {table}"
    ) in v["message"]
    assert (
        f"flashnext: fix: flashnext table verify --model /models/flash-next --table {table}"
        in v["message"]
    )


def test_a_table_truncated_at_pp1_is_named_from_the_file_itself(tmp_path):
    # vLLM at PP=1 dies of the SIGBUS in its engine core and logs no worker line
    v = sf.table_truncated_pp1(tmp_path)
    table = v["table"]
    assert_taken_down(v, POLL_S + 2.0 + STOP_S)
    assert "engine process VLLM::EngineCore_DP0" in v["message"], v["message"]
    assert (
        f"flashnext: cause: a table fault: the engine died after its PLE table {table} "
        "changed: it was truncated from 1,048,576 to 0 bytes"
    ) in v["message"]
    assert (
        f"flashnext: fix: flashnext table verify --model /models/flash-next --table {table}"
        in v["message"]
    )


def test_table_change_says_what_became_of_the_file():
    seen = serve_faults.TableStat(size=100, inode=(1, 2))
    assert serve_faults.table_change(seen, seen) is None
    assert serve_faults.table_change(None, seen) is None  # no table in argv
    assert serve_faults.table_change(seen, serve_faults.TableStat(size=0, inode=(1, 2))) == (
        "it was truncated from 100 to 0 bytes"
    )
    assert serve_faults.table_change(seen, serve_faults.TableStat(size=100, inode=(1, 3))) == (
        "it was replaced by another file"
    )
    assert serve_faults.table_change(seen, serve_faults.TableStat(error="missing")) == (
        "it is now missing"
    )
    # a change alone names no table fault without a table in argv
    argv = ["vllm", "serve", "/m"]
    assert serve_faults.diagnose([], argv, "http://h/health", "it is now missing") is None


def test_sigterm_under_load_stops_cleanly_within_the_stop_timeout(tmp_path):
    v = sf.sigterm(tmp_path)
    assert v["exit_code"] == 0, v
    assert v["detected_s"] <= STOP_S + 1.0
    assert v["leftover_processes"] == 0
    assert v["clients"]["hung"] == 0
    assert "flashnext: received SIGTERM, stopping the server" in v["message"]


def test_a_port_taken_before_vllm_binds_it_is_a_clear_error(tmp_path):
    v = sf.port_taken(tmp_path)
    port = v["port"]
    assert v["exit_code"] == 1 and v["leftover_processes"] == 0, v
    assert "flashnext: error: the server exited with code 1" in v["message"]
    assert (
        f"flashnext: cause: vLLM could not bind port {port}: another process took it after "
        "preflight found it free ([Errno 98] Address already in use)"
    ) in v["message"]
    assert f"flashnext: fix: ss -ltnp 'sport = :{port}'" in v["message"]


# ---------------------------------------------------------------- the pure parts


def test_diagnosis_reads_vllms_worker_monitor_line():
    line = ("ERROR 12-07 14:00:00 [multiproc_executor.py:381] Worker proc VllmWorker-2 died "
            "unexpectedly (exit code: -9), shutting down executor.")  # fmt: skip
    assert serve_faults.NOTABLE.search(line)
    found = serve_faults.diagnose([line], ["vllm", "serve", "/m"], "http://127.0.0.1:8000/health")
    assert found == serve_faults.Diagnosis("vLLM's worker monitor: VllmWorker-2 died first "
                                           "(SIGKILL (9))")  # fmt: skip


def test_an_eio_from_the_table_is_a_table_fault_too():
    argv = ["vllm", "serve", "/m", "--engram-config", '{"mmap_path":"/nvme/ple.bin"}']
    found = serve_faults.diagnose(
        ["OSError: [Errno 5] Input/output error"], argv, "http://h/health"
    )
    assert found.cause.startswith("a table fault: a worker died of SIGBUS/EIO reading the PLE "
                                  "table /nvme/ple.bin")  # fmt: skip
    # without a table in argv, a SIGBUS is a worker's death, not a table fault
    bus = "Worker proc VllmWorker-0 died unexpectedly (exit code: -7)"
    assert serve_faults.diagnose([bus], ["vllm", "serve", "/m"], "http://h/health").cause == (
        "vLLM's worker monitor: VllmWorker-0 died first (SIGBUS (7))"
    )


@pytest.mark.parametrize(
    ("readings", "hung_at"),
    [
        ([(2, 10), (2, 11), (2, 12)], None),  # moving
        ([(0, 10), (0, 10), (0, 10)], None),  # idle: nothing to move
        ([(2, 10), (2, 10), (2, 10)], 2),  # busy and still for 2 s
        ([(2, 10), (2, 10), (0, 10), (2, 10), (2, 10)], None),  # went idle between
        ([None, None, None], None),  # no /metrics: no verdict
    ],
)
def test_progress_is_judged_only_while_work_is_in_flight(readings, hung_at):
    prog = serve_faults.Progress(stall_s=2.0)
    verdicts = [prog.update(r, float(t)) for t, r in enumerate(readings)]
    first = next((i for i, v in enumerate(verdicts) if v), None)
    assert first == hung_at, verdicts


def test_stat_table_never_opens_or_blocks_on_a_hostile_table_path(tmp_path):
    from flashnext.serve import stat_table

    def argv(path) -> list[str]:
        return ["vllm", "serve", "/m", "--engram-config", json.dumps({"mmap_path": str(path)})]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # stat only: a FIFO as the table must not block the supervisor
    assert stat_table(argv(fifo)).error is None
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert stat_table(argv(loop)).error.startswith("unreadable (")
    assert stat_table(argv(tmp_path / "gone")).error == "missing"
    assert stat_table(["vllm", "serve", "/m"]) is None  # no table in argv
    assert stat_table(["vllm", "serve", "--engram-config", "{not json"]) is None
    # a table replaced under the server by a loop reads as a change, not a crash
    real = tmp_path / "ple.bin"
    real.write_bytes(b"x" * 4096)
    before = stat_table(argv(real))
    real.unlink()
    real.symlink_to(real)
    assert serve_faults.table_change(before, stat_table(argv(real))).startswith(
        "it is now unreadable ("
    )
