"""checks/gpu/soak/soak_pp3.py here, with the stand-in `vllm` for the kit's and replayed
H200 facts: the harness serves the PP=3 tiny profile through `flashnext serve`, soaks
it with `flashnext bench --soak`, SIGKILLs pipeline rank 1 under load and writes issue
41's results file; on the GPU host the same run uses the patched vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from h200_tiny_facts import write_h200_facts
from test_serve_tiny_script import skeleton_with_table
from vllm_env_fixtures import checkout_stamp, write_vllm_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "checks" / "gpu" / "soak" / "soak_pp3.py"
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
from harness import STANDIN_DIR, free_port  # noqa: E402

CONTRACT = {"pp_size", "emulated", "duration_s", "requests", "outcomes", "lost", "memory",
            "pool_pressure", "faults"}  # fmt: skip
FAULT_KEYS = {"what", "where", "detected_s", "exit_code", "message", "leftover_processes",
              "leftover_gpu_bytes"}  # fmt: skip


def gpu_host_env(tmp_path, model, table, port: int, **more: str) -> dict[str, str]:
    """What a GPU harness sees on the lent host, here: the stand-in `vllm` first on PATH,
    a patched vLLM tree on PYTHONPATH (as `. KIT/env-patched.sh` puts the kit's) and
    replayed H200 facts; nothing of this process's STANDIN_/FLASHNEXT_ settings."""
    patched = tmp_path / "patched"
    write_vllm_tree(patched, stamp=checkout_stamp())
    facts = write_h200_facts(tmp_path / "facts.json", model, table, port)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "FLASHNEXT_"))}
    env.pop("VLLM_API_KEY", None)
    env.update(PATH=os.pathsep.join([str(STANDIN_DIR), env["PATH"]]), PYTHONPATH=str(patched),
               PORT=str(port), FLASHNEXT_FACTS=str(facts), STANDIN_PP_WORKERS="1",
               **more)  # fmt: skip
    return env


def test_the_gpu_soak_harness_runs_end_to_end_on_the_standin(tmp_path):
    model, table = skeleton_with_table(tmp_path, "tiny12", num_hidden_layers=12)
    port = free_port()
    env = gpu_host_env(
        tmp_path, model, table, port, SOAK_S="3", IDLE_S="2", SOAK_INTERVAL_S="1",
        STARTUP_S="30", RESULTS_DIR=str(tmp_path / "results"),
        VLLM_PROCESS_NAME_PREFIX=f"SOAK{port}", STANDIN_TOKEN_INTERVAL_S="0.01",
    )  # fmt: skip
    out = tmp_path / "out"
    argv = [sys.executable, str(SCRIPT), str(model), str(table), str(out), "t1"]
    proc = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((tmp_path / "results" / "soak-t1.json").read_text())
    assert doc == json.loads((out / "soak-t1.json").read_text())
    assert doc.keys() >= CONTRACT
    assert doc["pp_size"] == 3 and doc["emulated"] is True
    assert doc["card"].keys() >= {"name", "memory_total_bytes", "source"}  # which card ran
    assert "PP=3 emulated on one GPU" in doc["setup"] and "torch 2.11" in doc["setup"]
    assert doc["lost"] == 0 and doc["requests"] > 0
    assert sum(doc["outcomes"].values()) == doc["requests"]
    rss = doc["memory"]["rss"]
    assert rss["before"] and rss["after"] and rss["peak"] and rss["at_ready"]
    # the soak's growth verdict, its levels the contract's before and after
    growth = doc["memory"]["growth"]
    assert growth["idle_s"] == 2 and growth["rss"]["verdict"] == "ok", growth
    assert (rss["before"], rss["after"]) == (growth["rss"]["after_warmup"],
                                             growth["rss"]["after_idle"])  # fmt: skip
    assert {growth[k]["verdict"] for k in ("pinned", "gpu")} <= {"ok", "unknown"}
    (fault,) = doc["faults"]
    assert fault.keys() >= FAULT_KEYS
    assert fault["exit_code"] == 1 and fault["leftover_processes"] == 0
    assert fault["clients"]["hung"] == 0 and fault["clients"]["errored"] == 3
    assert f"flashnext: error: pipeline rank 1 (SOAK{port}::Worker_PP1" in fault["message"]
    assert (out / "soak" / "soak.png").exists() and (out / "serve.log").exists()
    # before the soak: the plan serve ran, and the c=1/c=4 bench read per concurrency
    plan = json.loads((out / "plan.json").read_text())
    assert doc["memory"]["plan_pinned_bytes"] == plan["pinned_bytes_needed"] > 0
    bench = doc["bench"]
    assert bench["exit_code"] == 0, bench
    assert bench["c=1"]["stream_tok_s"] > 0 and bench["c=4"]["aggregate_tok_s"] > 0
    assert bench["c4_over_c1_stream"] == round(
        bench["c=4"]["stream_tok_s"] / bench["c=1"]["stream_tok_s"], 3
    )
    assert "soak_pp3.py MODEL TABLE OUT t1" in doc["command"]
