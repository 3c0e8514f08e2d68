#!/usr/bin/env python3
"""Issue 41 on the GPU host: `flashnext serve` of the PP=3 tiny profile, a soak with
`flashnext bench --soak`, an idle stretch, then SIGKILL of pipeline rank 1 under load;
one results file in the issue's contract, checks/gpu/results/soak-<RUN>.json.

    . $KIT/env-patched.sh   # the patched vLLM first on PATH (checks/gpu/kit/README.md)
    python3 checks/gpu/soak/soak_pp3.py MODEL_DIR TABLE OUT_DIR RUN

MODEL_DIR must hold the tiny checkpoint (checks/gpu/tiny/tiny_model.py MODEL_DIR
--layers 12); TABLE is (re)made by `flashnext table prepare --force`. OUT_DIR gets
serve.log, soak/ (the soak's records, soak.json, soak.png) and the results file,
which is also written to checks/gpu/results/soak-RUN.json.

Env: PROFILE (default h200-tiny-pp3), PP_ONE_GPU (default 1: the profile's three
GPUs emulated on the host's one, checks/gpu/pp3/emulation.py), FLASHNEXT_MTP
(default 1: MTP K=1), PORT (8000), SOAK_S (300), SOAK_INTERVAL_S (10), IDLE_S (60: the
soak's --soak-idle), STARTUP_S (480), FLASHNEXT_FACTS (replayed host facts) and
RESULTS_DIR (instead of checks/gpu/results): for the CPU test of this script only.

Device time: PP=3 on one H200 starts in ~190 s, so 190 + SOAK_S + IDLE_S + ~30 s for
the fault: ~580 s with the defaults, near a device call's 600 s. Start it in the
background in a session of its own (`setsid nohup ... > /root/soak/run.log 2>&1 &`,
OUT_DIR outside $OUT, which the next call empties) and read the results in a second
call, or lower SOAK_S (the issue asks for at least 300).
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

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launcher" / "src"))
sys.path.insert(0, str(REPO / "checks" / "faults"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "common"))
from card import card as card_now  # noqa: E402
from fault_run import Clients, alive, gpu_bytes_of  # noqa: E402
from flashnext.atomic import write_text_atomic  # noqa: E402
from flashnext.facts import server_usage  # noqa: E402

ENV = os.environ
PROFILE = ENV.get("PROFILE", "h200-tiny-pp3")
EMULATED = ENV.get("PP_ONE_GPU", "1") == "1"
PORT = int(ENV.get("PORT", "8000"))
SOAK_S = float(ENV.get("SOAK_S", "300"))
IDLE_S = float(ENV.get("IDLE_S", "60"))
SOAK_INTERVAL_S = float(ENV.get("SOAK_INTERVAL_S", "10"))  # warm-up: the first interval
STARTUP_S = float(ENV.get("STARTUP_S", "480"))
MTP = ENV.get("FLASHNEXT_MTP", "1")
PREFIX = ENV.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::"
TOKEN_IDS = "1000,32000"  # the tiny checkpoint's vocabulary is 32768
# Before the soak, serve-tiny's short bench (c=1 and c=4, 64 decode tokens): issue 42
# item 2 reads from it whether c=4 rides the plan's decode graphs. BENCH=0 skips it.
BENCH = ENV.get("BENCH", "1") == "1"
BENCH_ARGS = ("--concurrency", "1,4", "--decode-tokens", "64", "--prompt-lengths", "3000",
              "--warmup", "1", "--runs", "2", "--token-id-range", TOKEN_IDS)  # fmt: skip


def say(msg: str) -> None:
    print(f"[soak-pp3 {time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def fx(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**ENV, "FLASHNEXT_MTP": MTP,
           "PYTHONPATH": os.pathsep.join([str(REPO / "launcher" / "src"),
                                          ENV.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("FLASHNEXT_FACTS", None)  # facts go by option: serve refuses the variable
    return subprocess.run([sys.executable, "-m", "flashnext", *args], env=env, text=True,
                          capture_output=True, cwd=REPO, **kw)  # fmt: skip


def step(name: str, proc: subprocess.CompletedProcess) -> str:
    if proc.returncode != 0:
        raise SystemExit(f"soak-pp3: {name} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")  # fmt: skip
    say(f"ok: {name}")
    return proc.stdout


def facts_file(model: Path, table: Path, out: Path) -> Path | None:
    """The facts serve judges: this host's (None), or with PP_ONE_GPU its one GPU as
    the profile's three (checks/gpu/pp3/emulation.py), replayed for testing."""
    host = ENV.get("FLASHNEXT_FACTS")
    if not EMULATED:
        return Path(host) if host else None
    if not host:
        host = str(out / "facts-host.json")
        probe = fx("facts", "--json", "--model", str(model), "--table", str(table),
                   "--port", str(PORT))  # fmt: skip
        Path(host).write_text(step("facts", probe))
    replayed = out / "facts-pp3.json"
    step("emulated facts", subprocess.run(
        [sys.executable, str(REPO / "checks/gpu/pp3/emulation.py"), "facts", host,
         str(replayed), "--gpus", "3"], text=True, capture_output=True))  # fmt: skip
    return replayed


def shim_env() -> dict[str, str]:
    if not EMULATED:
        return {}
    lines = step("shim env", subprocess.run(
        [sys.executable, str(REPO / "checks/gpu/pp3/emulation.py"), "env"],
        text=True, capture_output=True, env=dict(ENV)))  # fmt: skip
    return dict(line.split("=", 1) for line in lines.splitlines() if "=" in line)


def gpu_used() -> int | None:
    return server_usage.sample(os.getpid()).gpu_used_bytes


def memory_now(pid: int | None) -> dict:
    u = server_usage.sample(pid, None if pid else "no server")
    return {"rss": u.rss_bytes, "pinned": u.pinned_bytes, "gpu": u.gpu_used_bytes,
            "unavailable": u.unavailable}  # fmt: skip


def wait_line(log: Path, pattern: str, timeout_s: float, proc: subprocess.Popen) -> str | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"), re.M)
        if found:
            return found[0]
        if proc.poll() is not None:
            return None
        time.sleep(0.5)
    return None


def sigkill_rank(serve: subprocess.Popen, log: Path, tree: dict[int, str], baseline_gpu):
    """SIGKILL Worker_PP1 while 3 long streams run; serve must name it, exit 1, and
    leave no process and no GPU memory behind; every client must end in an error."""
    body = {"model": "qwen3.8-flash-next", "prompt": list(range(1000, 1064)),
            "max_tokens": 4000, "ignore_eos": True, "stream": True}  # fmt: skip
    clients = Clients(f"http://127.0.0.1:{PORT}/v1/completions", body)
    clients.start(3)
    time.sleep(3.0)
    victim = next(p for p, t in tree.items() if t.startswith(PREFIX + "Worker_PP1"))
    seen = len(log.read_text(errors="replace"))
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    say(f"SIGKILL {PREFIX}Worker_PP1 (pid {victim})")
    detected = None  # when serve said what failed, else when it exited
    while detected is None and time.monotonic() - t0 < 120:
        if (
            "flashnext: error:" in log.read_text(errors="replace")[seen:]
            or serve.poll() is not None
        ):
            detected = time.monotonic() - t0
        time.sleep(0.1)
    try:
        rc = serve.wait(60)
    except subprocess.TimeoutExpired:
        rc = None
    time.sleep(2.0)
    leftover = [p for p in tree if alive(p)]
    after = gpu_used()  # the whole card's: other processes on it count here
    # NVML's bytes of any process the server had: nothing, or the ranks' leftovers
    own = gpu_bytes_of([*tree, serve.pid])
    text = log.read_text(errors="replace")[seen:]
    message = "\n".join(x for x in text.splitlines()
                        if x.startswith(("flashnext: error:", "flashnext: cause:")))  # fmt: skip
    return {
        "what": "SIGKILL of pipeline rank 1 under load",
        "where": "GPU PP=3" if not EMULATED else "GPU PP=3 (emulated on one GPU)",
        "detected_s": None if detected is None else round(detected, 3),
        "exit_code": rc,
        "message": message or "(no error line)",
        "leftover_processes": len(leftover),
        "leftover_gpu_bytes": own,
        "gpu_used_after_minus_before": None
        if after is None or baseline_gpu is None
        else after - baseline_gpu,
        "clients": clients.summary(30.0),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    model, table, out = (Path(a).resolve() for a in argv[1:4])
    run = argv[4]
    out.mkdir(parents=True, exist_ok=True)
    step("table", fx("table", "prepare", "--model", str(model), "--out", str(table), "--force"))
    facts = facts_file(model, table, out)
    baseline_gpu = gpu_used()
    common = ["--profile", PROFILE, "--model", str(model), "--table", str(table),
              "--port", str(PORT)]  # fmt: skip
    replay = ["--replay-facts-for-testing", str(facts)] if facts else []
    log = out / "serve.log"
    shim = shim_env()  # its PYTHONPATH: the shim folder first, then ours
    env = {**ENV, **shim, "FLASHNEXT_MTP": MTP, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "launcher" / "src"), shim.get("PYTHONPATH", ENV.get("PYTHONPATH", ""))]
    )
    env.pop("FLASHNEXT_FACTS", None)
    with log.open("w") as fh:
        serve = subprocess.Popen(
            [sys.executable, "-m", "flashnext", "serve", *common, *replay,
             "--startup-timeout", str(STARTUP_S)],
            env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    verdict: dict = {}
    bench: dict = {}
    soak: dict = {}
    memory: dict = {}
    try:
        ready = wait_line(log, r"^flashnext: ready: .*$", STARTUP_S + 120, serve)
        if ready is None:
            raise SystemExit(f"soak-pp3: serve did not become ready; see {log}")
        say(ready)
        time.sleep(1.0)
        pid, _ = server_usage.find_listener("127.0.0.1", PORT)
        tree = server_usage.tree(pid) if pid else []
        titles = {}
        for p in tree:
            try:
                titles[p.pid] = next(iter(p.cmdline()), "")
            except Exception:  # noqa: BLE001 (exited while we looked)
                continue
        memory["ready"] = memory_now(pid)
        plan = plan_json(common, replay, out)
        memory["plan_pinned_bytes"] = plan.get("pinned_bytes_needed")
        if BENCH:
            url = f"http://127.0.0.1:{PORT}"
            bench = decode_reading(fx("bench", "--url", url, *BENCH_ARGS, "--plan",
                                      str(out / "plan.json"), "--out", str(out / "bench"),
                                      "--json", timeout=900))  # fmt: skip
            say(f"bench: {json.dumps(bench)}")
        # the idle stretch is the soak's own (--soak-idle): it samples it and judges growth
        say(f"soak: starting ({SOAK_S:g} s, then {IDLE_S:g} s idle)")
        res = fx("bench", "--url", f"http://127.0.0.1:{PORT}", "--soak", str(SOAK_S),
                 "--soak-idle", str(IDLE_S), "--soak-interval", str(SOAK_INTERVAL_S),
                 "--token-id-range", TOKEN_IDS,
                 "--out", str(out / "soak"), "--json", timeout=SOAK_S + IDLE_S + 900)  # fmt: skip
        say(f"soak: exit {res.returncode}")
        soak = json.loads(res.stdout) if res.stdout.strip().startswith("{") else {}
        say(f"growth: {json.dumps({k: g.get('verdict') for k, g in growth_of(soak).items()})}")
        verdict = sigkill_rank(serve, log, titles, baseline_gpu)
        say(f"fault: {json.dumps({k: verdict[k] for k in ('exit_code', 'detected_s')})}")
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()
    doc = results(run, soak, memory, verdict)
    doc["bench"] = bench
    doc["command"] = (
        f"FLASHNEXT_MTP={MTP} PP_ONE_GPU={int(EMULATED)} SOAK_S={SOAK_S:g} "
        f"IDLE_S={IDLE_S:g} checks/gpu/soak/soak_pp3.py MODEL TABLE OUT {run}"
    )
    text = json.dumps(doc, sort_keys=True, indent=2) + "\n"
    write_text_atomic(out / f"soak-{run}.json", text)
    results_dir = Path(ENV.get("RESULTS_DIR") or REPO / "checks" / "gpu" / "results")
    results_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(results_dir / f"soak-{run}.json", text)
    ok = (doc["lost"] == 0 and verdict.get("exit_code") == 1
          and verdict.get("leftover_processes") == 0
          and not verdict.get("clients", {}).get("hung"))  # fmt: skip
    say(f"{'PASSED' if ok else 'FAILED'}: results in checks/gpu/results/soak-{run}.json")
    return 0 if ok else 1


def plan_json(common: list[str], replay: list[str], out: Path) -> dict:
    """The plan serve runs (its pinned bytes, decode graphs), saved as out/plan.json."""
    facts = ["--facts", replay[1]] if replay else []
    args = [a for i, a in enumerate(common) if a != "--port" and common[i - 1] != "--port"]
    text = step("plan", fx("plan", *args, *facts, "--json"))
    (out / "plan.json").write_text(text)
    return json.loads(text)


def decode_reading(proc: subprocess.CompletedProcess) -> dict:
    """Per concurrency: aggregate and per-stream decode tok/s, TTFT (medians). A
    batch that rides a captured graph costs about one request's step, so per-stream
    tok/s at c=4 stays near c=1's; an eager batch divides it (s2: 54.0 vs 13.4)."""
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}
    rows = {}
    for d in doc.get("summary", {}).get("decode", []):
        med = {k: (d.get(k) or {}).get("median") for k in ("aggregate_tok_s", "stream_tok_s",
                                                           "ttft_s")}  # fmt: skip
        rows[f"c={d['concurrency']}"] = med
    c1, c4 = rows.get("c=1", {}), rows.get("c=4", {})
    if c1.get("stream_tok_s") and c4.get("stream_tok_s"):
        rows["c4_over_c1_aggregate"] = round(c4["aggregate_tok_s"] / c1["aggregate_tok_s"], 3)
        rows["c4_over_c1_stream"] = round(c4["stream_tok_s"] / c1["stream_tok_s"], 3)
    rows["spec_decode"] = doc.get("spec_decode")
    rows["exit_code"] = proc.returncode
    return rows


def growth_of(soak: dict) -> dict:
    """The soak's verdict per quantity (launcher/src/flashnext/tools/growth.py)."""
    g = soak.get("growth") or {}
    return {k: g[k] for k in ("rss", "pinned", "gpu") if isinstance(g.get(k), dict)}


def results(run: str, soak: dict, memory: dict, verdict: dict) -> dict:
    """Issue 41's contract: memory before = the level after warm-up (the soak's second
    interval), after = the level after the idle stretch, peak = the highest sample of
    the soak and its idle stretch; growth = the soak's verdict per quantity, its bounds
    and windows (docs/soak.md), and `at_ready` the sample before the first request."""
    mem: dict = {}
    judged = growth_of(soak)
    for key in ("rss", "pinned", "gpu"):
        peak = soak.get("memory", {}).get(key, {}).get("peak")
        g = judged.get(key, {})
        mem[key] = {"before": g.get("after_warmup"), "after": g.get("after_idle"), "peak": peak,
                    "at_ready": memory.get("ready", {}).get(key)}  # fmt: skip
    # the pools the plan pins: what `pinned` should read once serving (VmPin + pools)
    mem["plan_pinned_bytes"] = memory.get("plan_pinned_bytes")
    mem["growth"] = soak.get("growth") or {
        "verdict": "unknown", "why": "the soak gave no result (see its output above)"
    }  # fmt: skip
    return {
        "run": run,
        "setup": "our pinned vLLM 0.33.0 (patched, the kit) on the host's torch 2.11, the tiny "
        f"checkpoint, profile {PROFILE}, MTP K={MTP}, the QSA offload as the profile plans it; "
        + ("PP=3 emulated on one GPU" if EMULATED else "PP=3 on three GPUs"),
        "card": card_now(),  # which card ran: an H200 call may get an H100
        "pp_size": 3,
        "emulated": EMULATED,
        "duration_s": soak.get("duration_s"),
        "requests": soak.get("requests"),
        "outcomes": soak.get("outcomes"),
        "lost": soak.get("lost") if soak else None,
        "soak_checks": soak.get("checks"),
        "overall": soak.get("overall"),
        "memory": mem,
        "idle_s": IDLE_S,
        "pool_pressure": {
            "requests": None,
            "demand_over_capacity": None,
            "equal_to_serial": None,
            "note": "not run by this harness",
        },  # fmt: skip
        "faults": [verdict] if verdict else [],
    }


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main(sys.argv))
