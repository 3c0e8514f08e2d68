"""checks/gpu/soak/faults_pp1.py here, with the stand-in `vllm` for the kit's and replayed
H200 facts: the API key, the pool under pressure and SIGTERM in one start, then SIGSTOP,
a port taken and the table truncated, each through the supervisor as serve runs it, and
the verdicts merged into a soak results file. On the GPU host the same run uses the
patched vLLM at PP=1."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from test_serve_tiny_script import skeleton_with_table
from test_soak_pp3_script import gpu_host_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "checks" / "gpu" / "soak" / "faults_pp1.py"
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
from harness import free_port  # noqa: E402

FAULT_KEYS = {"what", "where", "detected_s", "exit_code", "message", "leftover_processes",
              "leftover_gpu_bytes"}  # fmt: skip


def four_free_ports() -> int:
    """A port with the three above it free too: each fault has a port of its own."""
    for _ in range(50):
        port = free_port()
        if port + 3 < 65536 and all(_free(port + i) for i in range(1, 4)):
            return port
    raise AssertionError("no four free ports in a row")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_gpu_faults_harness_runs_end_to_end_on_the_standin(tmp_path):
    model, table = skeleton_with_table(tmp_path, "tiny")
    port = four_free_ports()
    env = gpu_host_env(
        tmp_path, model, table, port, READY_S="30", HANG_S="2", PRESSURE_LEN="2048",
        PRESSURE_TOKENS="4", STANDIN_ENGINE_STEPS="1", STANDIN_TOKEN_INTERVAL_S="0.02",
        STANDIN_KV_CACHE_TOKENS="3000",
    )  # fmt: skip
    soak = tmp_path / "soak-t1.json"
    soak.write_text(json.dumps({"faults": [{"what": "SIGKILL", "where": "GPU PP=3"}]}))
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), str(model), str(table), str(out), "t1",
            "--merge-into", str(soak)]  # fmt: skip
    proc = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "faults-pp1-t1.json").read_text())
    assert "PP=1 on one GPU" in doc["setup"] and "torch 2.11" in doc["setup"]
    assert doc["card"].keys() >= {"name", "memory_total_bytes", "source"}  # which card ran

    key = doc["api_key"]
    assert (key["without_key"], key["other_key"], key["with_key"]) == (401, 401, 200)
    assert key["key_on_a_command_line"] == []

    pressure = doc["pool_pressure"]
    assert pressure["capacity_tokens"] == 3000 and pressure["demand_tokens"] == 4 * (2048 - 8)
    assert pressure["demand_over_capacity"] == round(4 * 2040 / 3000, 3)
    assert pressure["equal_to_serial"] is True and pressure["outcomes_together"] == ["length"] * 4
    assert pressure["host_available_low_bytes"] > 0

    sigterm, sigstop, port_taken, table_fault = doc["faults"]
    for f in doc["faults"]:
        assert f.keys() >= FAULT_KEYS and f["where"] == "GPU PP=1", f
        assert f["leftover_processes"] == 0, f
    assert sigterm["exit_code"] == 0 and sigterm["clients"]["hung"] == 0
    assert sigstop["exit_code"] == 1 and "the engine is hung" in sigstop["message"]
    assert port_taken["exit_code"] == 1 and "could not bind port" in port_taken["message"]
    assert table_fault["exit_code"] == 1
    assert "a table fault: the engine died after its PLE table" in table_fault["message"]
    for name in ("sigterm", "sigstop", "port", "table"):  # written as each ended
        assert json.loads((out / f"{name}.json").read_text())["what"]
        assert "flashnext: " in (out / f"{name}.log").read_text()
    # the truncated table was a copy of its own, gone with its manifest; the table stays
    assert table.stat().st_size > 0 and not list(table.parent.glob("*-truncated*"))

    merged = json.loads(soak.read_text())
    assert [f["where"] for f in merged["faults"]] == ["GPU PP=3"] + ["GPU PP=1"] * 4
    assert merged["pool_pressure"] == pressure and merged["api_key"] == key
    assert merged["faults_run"] == "t1" and merged["faults_card"] == doc["card"]
    # the same merge later, from the faults file (as the campaign does after the soak)
    later = tmp_path / "soak-later.json"
    later.write_text(json.dumps({"faults": [{"what": "SIGKILL", "where": "GPU PP=3"}]}))
    merge = [sys.executable, str(SCRIPT), "merge", str(out / "faults-pp1-t1.json"), str(later)]
    subprocess.run(merge, env=env, check=True, timeout=60)
    assert json.loads(later.read_text()) == merged


def test_a_refused_plan_is_named_by_its_failed_checks(tmp_path):
    """Run h3's faults, started beside the PP=3 soak, stopped at `serve --dry-run`: the
    card held another server's processes (preflight's gpu.idle). The harness printed
    only the report's tail, which never holds the failed check; now it names it."""
    model, table = skeleton_with_table(tmp_path, "tiny")
    env = gpu_host_env(tmp_path, model, table, free_port())
    facts = json.loads(Path(env["FLASHNEXT_FACTS"]).read_text())
    facts["gpu"]["devices"][0]["processes"] = [
        {"pid": 4242, "used_memory_bytes": 7 << 30, "name": "VLLM::Worker_PP0"}
    ]
    Path(env["FLASHNEXT_FACTS"]).write_text(json.dumps(facts))
    argv = [sys.executable, str(SCRIPT), str(model), str(table), str(tmp_path / "out"), "t2"]
    proc = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "serve --dry-run failed" in proc.stderr, proc.stderr
    assert "gpu0.idle: " in proc.stderr and "kill 4242" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
