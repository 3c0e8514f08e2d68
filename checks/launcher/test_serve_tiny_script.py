"""checks/gpu/serve/serve-tiny end to end here, with the stand-in `vllm` and replayed H200 facts.

The script runs on the GPU host once; here its control flow is proven: the kit's env
is sourced (a stand-in KIT/env-patched.sh puts the stand-in `vllm` first on PATH),
preflight, plan and the dry run pass on the h200-tiny profile, serve starts the
plan's own command and reports ready, bench and report run against it, SIGTERM
stops it, and nothing of it is left. Each failure path names the step that failed
and still stops the server. The checkpoint is the skeleton's tiny variant (no torch
needed); with FLASHNEXT_VLLM_PY set, the script also writes the real tiny one.

PROFILE=h200-tiny-pp3 PP_ONE_GPU=1: the replayed one-H200 facts stand in for the
host's probe and become three H200s (checks/gpu/pp3/emulation.py) that every step
judges; the stand-in runs a worker per pipeline rank, titled as vLLM titles them;
KIT/bin/vllm records the environment it was started with, so the shim's env is
seen reaching vLLM while the plan's argv stays the shipped one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from h200_tiny_facts import H100_NAME, H100_TOTAL_BYTES, write_h200_facts
from test_probe_gpu import H200_PROBED
from vllm_env_fixtures import checkout_stamp, write_vllm_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "checks" / "gpu" / "serve" / "serve-tiny"
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "pp3"))
from emulation import ONE_GPU_ENV, SHIM_DIR  # noqa: E402
from harness import STANDIN_DIR, free_port  # noqa: E402

OUT_FILES = {"serve.log", "preflight.json", "plan.json", "bench.json", "report.json",
             "serve-tiny.json"}  # fmt: skip
SERVE_KEYS = {"health", "smoke", "bench_c1_tok_s", "bench_c4_tok_s", "clean_stop"}
PP3 = {"PROFILE": "h200-tiny-pp3", "PP_ONE_GPU": "1", "STANDIN_PP_WORKERS": "1"}


def skeleton_with_table(root, name, **skeleton):
    """The tiny skeleton (metadata as `checkpoint fix` leaves it) at root/name
    and its PLE table from `flashnext table prepare`."""
    from flashnext.skeleton import write_skeleton

    model = root / name
    write_skeleton(model, "tiny", fixed_metadata=True, **skeleton)
    table = root / "tables" / f"{name}.bin"
    table.parent.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(model),
         "--out", str(table), "--force"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return model, table


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-tiny")
    model, table = skeleton_with_table(root, "tiny")
    kit = root / "kit"
    kit.mkdir()
    # What KIT/env-patched.sh sets that matters here: PYTHONPATH with the patched
    # tree (stamped with this checkout's series, as the kit's overlay is) and PATH
    # with `vllm` first, whose Python preflight asks (no venv, as on the GPU host).
    write_vllm_tree(kit / "patched", stamp=checkout_stamp())
    (kit / "env-patched.sh").write_text(
        f"export PYTHONPATH={kit / 'patched'}\n"
        f'export PATH={STANDIN_DIR}:"$PATH"\n'
        "export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1\n"
    )
    return root, model, table, kit


@pytest.fixture(scope="module")
def pp3_inputs(inputs, tmp_path_factory):
    """The 12-layer tiny skeleton (4 layers a rank), its table, and a kit whose
    `vllm` writes the environment it was started with to $TEST_VLLM_ENV_LOG (less
    $TEST_VLLM_DROP_ENV, to see the script notice) before it becomes the stand-in."""
    root = tmp_path_factory.mktemp("serve-tiny-pp3")
    model, table = skeleton_with_table(root, "tiny12", num_hidden_layers=12)
    kit = root / "kit"
    (kit / "bin").mkdir(parents=True)
    vllm = kit / "bin" / "vllm"
    standin = str(STANDIN_DIR / "vllm")
    vllm.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "if os.environ.get('TEST_VLLM_ENV_LOG'):\n"
        "    with open(os.environ['TEST_VLLM_ENV_LOG'], 'w') as fh:\n"
        "        json.dump(dict(os.environ), fh)\n"
        "os.environ.pop(os.environ.get('TEST_VLLM_DROP_ENV') or '-', None)\n"
        f"os.execv(sys.executable, [sys.executable, {standin!r}, *sys.argv[1:]])\n"
    )
    vllm.chmod(0o755)
    patched = inputs[3] / "patched"
    (kit / "env-patched.sh").write_text(
        f"export PYTHONPATH={patched}\n"
        f'export PATH={kit / "bin"}:"$PATH"\n'
        "export VLLM_USE_FLASHINFER_SAMPLER=0 NCCL_NVLS_ENABLE=0 HF_HUB_OFFLINE=1\n"
    )
    return root, model, table, kit


def script_env(inputs, port: int, card: str = "H200", **extra: str) -> dict[str, str]:
    """The script's environment, with replayed facts of the lent host with `card`."""
    root, model, table, kit = inputs
    facts = write_h200_facts(root / f"facts-{port}.json", model, table, port, card=card)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "FLASHNEXT_"))}
    env.pop("VLLM_API_KEY", None)
    env.update(
        KIT=str(kit),
        PORT=str(port),
        STARTUP_S="30",
        FLASHNEXT_PYTHON=sys.executable,
        FLASHNEXT_FACTS=str(facts),
        # Engine titles unique to this run: other stand-ins on the machine are not ours.
        VLLM_PROCESS_NAME_PREFIX=f"TINY{port}",
        STANDIN_TOKEN_INTERVAL_S="0.002",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def run_script(inputs, out: Path, timeout_s: float = 180, card: str = "H200", **extra: str):
    port = free_port()
    _, model, table, _ = inputs
    proc = subprocess.run(
        [str(SCRIPT), str(model), str(table), str(out)],
        env=script_env(inputs, port, card, **extra), cwd="/",
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    summary = json.loads((out / "serve-tiny.json").read_text())
    verdicts = {s["step"]: s["verdict"] for s in summary["steps"]}
    return proc, summary, verdicts, port


def alive_with_prefix(prefix: str) -> list[int]:
    """Processes whose title starts with `prefix` (zombies excluded)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            state = Path(f"/proc/{name}/stat").read_text().rpartition(")")[2].split()[0]
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if state != "Z" and cmd.startswith(prefix.encode()):
            found.append(int(name))
    return found


def test_the_whole_run_passes(inputs, tmp_path):
    out = tmp_path / "out"
    proc, summary, verdicts, port = run_script(inputs, out)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert summary["ok"] is True
    assert verdicts == {
        "model": "ok", "kit": "ok", "table": "ok", "preflight": "ok", "plan": "ok",
        "dry-run": "ok", "serve": "ok", "bench": "ok", "report": "ok", "stop": "ok",
        "processes": "ok",
        "gpu": "skipped" if not _has_nvidia_smi() else verdicts["gpu"],
    }  # fmt: skip
    # What comes back from the GPU host: at most 8 files, plain names.
    names = {p.name for p in out.iterdir()}
    assert names == OUT_FILES and all(re.fullmatch(r"[A-Za-z0-9._-]+", n) for n in names)
    log = (out / "serve.log").read_text()
    started = re.search(r"^flashnext: starting: (vllm serve .*)$", log, re.M).group(1)
    plan = json.loads((out / "plan.json").read_text())
    assert started == " ".join(plan["argv"])
    assert "--additional-config" in started and f"--port {port}" in started
    assert re.search(rf"^flashnext: ready: http://127\.0\.0\.1:{port}/v1 .* context 24576 tokens",
                     log, re.M)  # fmt: skip
    assert "flashnext: received SIGTERM, stopping the server" in log
    bench = json.loads((out / "bench.json").read_text())
    assert [d["concurrency"] for d in bench["summary"]["decode"]] == [1, 4]
    assert bench["rejected"] == [] and bench["config"]["token_id_range"] == [1000, 32760]
    assert bench["config"]["decode_tokens"] == 64 and bench["config"]["prompt_lengths"] == [3000]
    report = json.loads((out / "report.json").read_text())
    assert report["preflight"]["profile"] == "h200-tiny"
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["result"] == "warn" and preflight["profile"] == "h200-tiny"
    # the kit's vLLM: `vllm` on PATH, its Python asked with the kit's PYTHONPATH
    env_check = next(f for f in preflight["findings"] if f["id"] == "vllm.env")
    assert env_check["level"] == "ok", env_check
    assert env_check["message"].startswith(f"{STANDIN_DIR / 'vllm'} (PATH); stamp equal")
    assert alive_with_prefix(f"TINY{port}::") == []
    # the summary table names every step
    assert re.search(r"^serve +ok ", proc.stdout, re.M) and "PASSED in" in proc.stdout
    # issue 24's results contract, from the steps
    assert set(summary["serve"]) == SERVE_KEYS
    assert summary["serve"]["health"] is True and summary["serve"]["smoke"] is True
    assert summary["serve"]["clean_stop"] is True
    medians = {d["concurrency"]: d["aggregate_tok_s"]["median"] for d in bench["summary"]["decode"]}
    assert summary["serve"]["bench_c1_tok_s"] == medians[1] > 0
    assert summary["serve"]["bench_c4_tok_s"] == medians[4] > 0
    assert (summary["profile"], summary["pp_size"], summary["emulated"]) == ("h200-tiny", 1, False)
    assert summary["devices"] == 1 and summary["mtp"] is None and summary["emulation"] is None
    assert summary["replayed_facts"]["file"].endswith(f"facts-{port}.json")
    assert summary["replayed_facts"]["gpus"] == 1
    # which card ran, as the facts every step judged have it
    assert summary["card"] == {
        "name": "NVIDIA H200",
        "memory_total_bytes": H200_PROBED["devices"][0]["memory_total_bytes"],
        "source": f"preflight.json's facts: FLASHNEXT_FACTS={summary['replayed_facts']['file']}",
    }


def _has_nvidia_smi() -> bool:
    from shutil import which

    return which("nvidia-smi") is not None


def test_a_failed_smoke_completion_fails_the_run_and_leaves_nothing(inputs, tmp_path):
    proc, summary, verdicts, port = run_script(
        inputs, tmp_path / "out", STANDIN_COMPLETION_FAIL="1"
    )
    assert proc.returncode == 1
    assert verdicts["serve"] == "FAILED" and summary["ok"] is False
    serve = next(s for s in summary["steps"] if s["step"] == "serve")
    assert "smoke test failed" in serve["detail"] and "HTTP 500" in serve["detail"]
    assert verdicts["bench"] == verdicts["report"] == verdicts["stop"] == "skipped"
    assert verdicts["processes"] == "ok"
    assert alive_with_prefix(f"TINY{port}::") == []
    # /health answered (serve sends the smoke completion only then); no SIGTERM stop
    assert summary["serve"] == {"health": True, "smoke": False, "bench_c1_tok_s": None,
                                "bench_c4_tok_s": None, "clean_stop": False}  # fmt: skip


def test_a_rejected_bench_fails_the_run_and_still_stops_the_server(inputs, tmp_path):
    proc, summary, verdicts, port = run_script(inputs, tmp_path / "out", STANDIN_TRUNCATE_AFTER="3")
    assert proc.returncode == 1
    assert verdicts["bench"] == "FAILED"
    bench = next(s for s in summary["steps"] if s["step"] == "bench")
    assert "stream ended without [DONE]" in bench["detail"]
    assert verdicts["report"] == verdicts["stop"] == verdicts["processes"] == "ok"


def test_a_process_left_behind_is_named(inputs, tmp_path):
    port = free_port()
    prefix = f"TINY{port}::"
    decoy = subprocess.Popen([f"{prefix}Decoy", "120"], executable="sleep")
    try:
        _, model, table, _ = inputs
        out = tmp_path / "out"
        proc = subprocess.run(
            [str(SCRIPT), str(model), str(table), str(out)],
            env=script_env(inputs, port), capture_output=True, text=True, timeout=180,
        )  # fmt: skip
    finally:
        decoy.kill()
        decoy.wait()
    summary = json.loads((out / "serve-tiny.json").read_text())
    step = next(s for s in summary["steps"] if s["step"] == "processes")
    assert proc.returncode == 1 and step["verdict"] == "FAILED"
    assert f"{decoy.pid} (titled {prefix})" in step["detail"]
    assert {s["step"]: s["verdict"] for s in summary["steps"]}["stop"] == "ok"


def test_sigterm_to_the_script_stops_the_server(inputs, tmp_path):
    port = free_port()
    _, model, table, _ = inputs
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [str(SCRIPT), str(model), str(table), str(out)],
        env=script_env(inputs, port, STANDIN_TOKEN_INTERVAL_S="0.01"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            if "bench: decode c=1" in line:  # the server is up, bench is running
                break
        assert any("ok: serve" in s for s in seen), "".join(seen)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, rest
    assert "interrupted" in rest and "cleanup: stopping serve" in rest
    summary = json.loads((out / "serve-tiny.json").read_text())
    assert summary["ok"] is False
    deadline = time.monotonic() + 10
    while alive_with_prefix(f"TINY{port}::") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_with_prefix(f"TINY{port}::") == []
    log = (out / "serve.log").read_text()
    assert "flashnext: received SIGTERM, stopping the server" in log


def test_without_the_kit_it_says_how_to_get_it(inputs, tmp_path):
    out = tmp_path / "out"
    _, model, table, _ = inputs
    proc, summary, verdicts, _ = run_script(inputs, out, KIT=str(tmp_path / "no-kit"))
    assert proc.returncode == 1 and verdicts == {"model": "ok", "kit": "FAILED"}
    kit = next(s for s in summary["steps"] if s["step"] == "kit")
    assert "env-patched.sh is missing" in kit["detail"] and "assemble" in kit["detail"]


def test_it_writes_the_tiny_checkpoint_when_missing(inputs, tmp_path):
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.skip("FLASHNEXT_VLLM_PY is not set: checks/gpu/tiny/tiny_model.py needs torch")
    model = tmp_path / "ab" / "tiny"
    out = tmp_path / "out"
    env = script_env(inputs, free_port(), KIT=str(tmp_path / "no-kit"), TINY_PYTHON=py)
    proc = subprocess.run(
        [str(SCRIPT), str(model), str(tmp_path / "t.bin"), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = json.loads((out / "serve-tiny.json").read_text())
    assert summary["steps"][0] == {
        "step": "model", "verdict": "ok", "seconds": summary["steps"][0]["seconds"],
        "detail": f"written: {model}",
    }  # fmt: skip
    assert (model / "config.json").is_file() and proc.returncode == 1  # then: no kit


def test_pp3_on_one_gpu_serves_with_three_replayed_h200s_and_the_shim(inputs, pp3_inputs, tmp_path):
    out = tmp_path / "out"
    env_log = tmp_path / "vllm-env.json"
    proc, summary, verdicts, port = run_script(
        pp3_inputs, out, FLASHNEXT_MTP="1", STANDIN_SPEC_ACCEPT="0.5",
        TEST_VLLM_ENV_LOG=str(env_log), **PP3,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert summary["ok"] is True and verdicts["facts"] == "ok"
    assert all(v == "ok" for k, v in verdicts.items() if k != "gpu"), verdicts
    assert {p.name for p in out.iterdir()} == OUT_FILES | {"facts-pp3.json"}
    # the facts: the host's one H200 (the replayed recording stands in for the
    # probe), three times; serve was handed that file, loudly
    replayed = out / "facts-pp3.json"
    three = json.loads(replayed.read_text())
    host = json.loads((pp3_inputs[0] / f"facts-{port}.json").read_text())
    assert [d["index"] for d in three["gpu"]["devices"]] == [0, 1, 2]
    assert {d["name"] for d in three["gpu"]["devices"]} == {host["gpu"]["devices"][0]["name"]}
    assert {k: v for k, v in three.items() if k != "gpu"} == {
        k: v for k, v in host.items() if k != "gpu"
    }
    log = (out / "serve.log").read_text()
    assert re.search(rf"TESTING ONLY: judging the facts replayed from {re.escape(str(replayed))} ",
                     log)  # fmt: skip
    preflight = json.loads((out / "preflight.json").read_text())
    assert preflight["profile"] == "h200-tiny-pp3"
    assert len(preflight["facts"]["gpu"]["devices"]) == 3
    assert {f["id"]: f["level"] for f in preflight["findings"]}["gpu.count"] == "ok"
    report = json.loads((out / "report.json").read_text())
    assert len(report["facts"]["gpu"]["devices"]) == 3
    # the plan's command, PP=3 with MTP K=1, is what serve ran: nothing of the shim in it
    plan = json.loads((out / "plan.json").read_text())
    argv = plan["argv"]
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "3"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 1
    started = re.search(r"^flashnext: starting: (vllm serve .*)$", log, re.M).group(1)
    assert started == " ".join(argv) and "ONE_GPU" not in started + json.dumps(plan["env"])
    # the shim's env reached vLLM through serve's environment, the shim folder first
    vllm_env = json.loads(env_log.read_text())
    assert {k: vllm_env.get(k) for k in ONE_GPU_ENV} == ONE_GPU_ENV
    assert vllm_env["PYTHONPATH"].split(":")[0] == str(SHIM_DIR)
    assert summary["emulation"] == {
        "shim_env": ONE_GPU_ENV | {"PYTHONPATH": vllm_env["PYTHONPATH"]},
        "shim_env_in_vllm": True,
    }
    # three pipeline workers under serve, none left after SIGTERM
    serve = next(s for s in summary["steps"] if s["step"] == "serve")
    for rank in range(3):
        assert f"TINY{port}::Worker_PP{rank} (" in serve["detail"]
    assert alive_with_prefix(f"TINY{port}::") == []
    # what the result says
    assert summary["profile"] == "h200-tiny-pp3" and summary["pp_size"] == 3
    assert summary["emulated"] is True and summary["devices"] == 1
    assert summary["replayed_facts"]["file"] == str(replayed)
    assert summary["replayed_facts"]["gpus"] == 3
    assert summary["replayed_facts"]["from"].startswith("FLASHNEXT_FACTS=")
    bench = json.loads((out / "bench.json").read_text())
    assert summary["mtp"]["k"] == 1
    acceptance = bench["spec_decode"]["acceptance_rate"]
    assert summary["mtp"]["acceptance_rate"] == acceptance and 0.4 < acceptance < 0.6
    assert summary["mtp"]["draft_tokens"] == bench["spec_decode"]["draft_tokens"] > 0
    assert set(summary["serve"]) == SERVE_KEYS
    assert summary["serve"]["health"] is summary["serve"]["smoke"] is True
    assert summary["serve"]["clean_stop"] is True
    assert summary["serve"]["bench_c1_tok_s"] > 0 and summary["serve"]["bench_c4_tok_s"] > 0


def test_pp3_serves_on_an_h100_too(pp3_inputs, tmp_path):
    """A call for the H200 may get an H100: the same run passes on its facts (three
    of it, replayed), and the result says which card ran."""
    out = tmp_path / "out"
    proc, summary, verdicts, _ = run_script(pp3_inputs, out, card="H100", **PP3)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert all(v == "ok" for k, v in verdicts.items() if k != "gpu"), verdicts
    assert (summary["card"]["name"], summary["card"]["memory_total_bytes"]) == (
        H100_NAME,
        H100_TOTAL_BYTES,
    )
    assert summary["card"]["source"].endswith("its GPU replayed x3 (checks/gpu/pp3/emulation.py)")
    three = json.loads((out / "facts-pp3.json").read_text())
    assert {d["name"] for d in three["gpu"]["devices"]} == {H100_NAME}
    preflight = json.loads((out / "preflight.json").read_text())
    levels = {f["id"]: f["level"] for f in preflight["findings"]}
    assert levels["gpu.count"] == "ok" and levels["gpu0.vram"] == "ok"
    assert summary["serve"]["clean_stop"] is True and summary["serve"]["bench_c4_tok_s"] > 0


def test_pp3_fails_when_the_shim_env_does_not_reach_vllm(pp3_inputs, tmp_path):
    proc, summary, verdicts, port = run_script(
        pp3_inputs, tmp_path / "out", TEST_VLLM_DROP_ENV="FLASHNEXT_PP_ONE_GPU", **PP3
    )
    assert proc.returncode == 1 and verdicts["serve"] == "FAILED"
    serve = next(s for s in summary["steps"] if s["step"] == "serve")
    assert "the shim's env did not reach vLLM" in serve["detail"]
    assert "FLASHNEXT_PP_ONE_GPU=(unset), not 1" in serve["detail"]
    assert summary["emulation"]["shim_env_in_vllm"] is False
    assert verdicts["stop"] == verdicts["processes"] == "ok"
    assert alive_with_prefix(f"TINY{port}::") == []


def test_pp3_without_pp_workers_fails_the_serve_step(pp3_inputs, tmp_path):
    env = {k: v for k, v in PP3.items() if k != "STANDIN_PP_WORKERS"}
    proc, summary, verdicts, port = run_script(pp3_inputs, tmp_path / "out", **env)
    assert proc.returncode == 1 and verdicts["serve"] == "FAILED"
    serve = next(s for s in summary["steps"] if s["step"] == "serve")
    assert f"PP=3, but no process titled TINY{port}::Worker_PP0 under serve" in serve["detail"]


def test_pp_one_gpu_needs_a_profile_of_several_gpus(inputs, tmp_path):
    proc, summary, verdicts, _ = run_script(inputs, tmp_path / "out", PP_ONE_GPU="1")
    assert proc.returncode == 1 and verdicts["facts"] == "FAILED"
    assert list(verdicts) == ["model", "kit", "table", "facts"]
    facts = next(s for s in summary["steps"] if s["step"] == "facts")
    assert "h200-tiny is 1 GPU(s)" in facts["detail"]
    assert summary["emulated"] is True and summary["replayed_facts"]["gpus"] == 1


def test_usage():
    proc = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=30)
    usage = "usage: checks/gpu/serve/serve-tiny MODEL_DIR TABLE OUT_DIR"
    assert proc.returncode == 2 and usage in proc.stderr


def test_pp_one_gpu_takes_1_or_0():
    proc = subprocess.run(
        [str(SCRIPT), "m", "t", "o"], env=os.environ | {"PP_ONE_GPU": "yes"},
        capture_output=True, text=True, timeout=30, cwd="/tmp",
    )  # fmt: skip
    assert proc.returncode == 2 and "PP_ONE_GPU=yes: expected 1 (emulate) or 0" in proc.stderr
