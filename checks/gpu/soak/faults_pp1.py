#!/usr/bin/env python3
"""Issue 41 items 4 and 5 on the GPU host, at PP=1 (the issue allows it, to save device
time): the supervisor of `flashnext serve` against the real patched vLLM, one start per
fault, each ending in a verdict of the results contract.

    . $KIT/env-patched.sh   # the patched vLLM first on PATH (checks/gpu/kit/README.md)
    python3 checks/gpu/soak/faults_pp1.py MODEL_DIR TABLE OUT_DIR RUN [--merge-into FILE]
    python3 checks/gpu/soak/faults_pp1.py merge FAULTS_JSON SOAK_JSON

1. The API key, the host pool under pressure, then SIGTERM under load (one start):
   serve's plan with `--max-model-len` PRESSURE_LEN and `--kv-cache-memory-bytes` cut
   so that about PRESSURE_FIT requests of that length fit (the QSA host pools are sized
   from the same blocks), and a key handed as serve hands it (VLLM_API_KEY). Ready, it
   must refuse /v1/models without the key and with another (401), answer with it, and
   no process may show the key on its command line. Then 4 greedy requests whose
   blocks add up to at least twice what vLLM allocated run at once, then one at a
   time: each must finish, with the same text. Then SIGTERM under load: exit 0.
2. SIGSTOP of the engine core under load: serve must call it hung (HANG_S) and exit 1.
3. The port taken before vLLM binds it: a clear error, exit 1.
4. The PLE table truncated under the running server: a table fault with its fix.

The supervisor runs as `flashnext serve` runs it (flashnext.serve.supervise, in a
process of its own: checks/faults/fault_run.py) with the plan's argv and env from
`flashnext serve --dry-run --json`; its hang bound is HANG_S (serve's own is 120 s)
to save device time. Writes OUT_DIR/faults-pp1-RUN.json; with --merge-into (or later
with `merge`), adds its faults, `pool_pressure` and `api_key` to that soak results file
(soak_pp3.py's).

Each on its own port (PORT to PORT+3), the truncated table a copy of its own; one after
the other, never side by side: each start's `serve --dry-run` refuses a card that another
server's processes hold (preflight's gpu.idle, as run h3 showed). Each fault's
supervisor output goes to OUT_DIR/NAME.log as it comes and its verdict to
OUT_DIR/NAME.json once in (sigterm, sigstop, port, table).

Env: PROFILE (h200-tiny), PORT (8010), READY_S (420: a cold PP=1 start), HANG_S (30),
PRESSURE_LEN (8192), PRESSURE_FIT (1.3), PRESSURE_TOKENS (16: new tokens a request).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launcher" / "src"))
sys.path.insert(0, str(REPO / "checks" / "faults"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "common"))
from card import card as card_now  # noqa: E402
from fault_run import Clients, Server, run_fault  # noqa: E402
from flashnext.atomic import write_text_atomic  # noqa: E402

ENV = os.environ
PROFILE = ENV.get("PROFILE", "h200-tiny")
PORT = int(ENV.get("PORT", "8010"))
READY_S = float(ENV.get("READY_S", "420"))
HANG_S = float(ENV.get("HANG_S", "30"))
PRESSURE_LEN = int(ENV.get("PRESSURE_LEN", "8192"))
PRESSURE_FIT = float(ENV.get("PRESSURE_FIT", "1.3"))
PRESSURE_TOKENS = int(ENV.get("PRESSURE_TOKENS", "16"))
OUT = Path(".")  # main() sets it: where each fault's log and verdict go
PRESSURE_REQUESTS = 4  # the profile's max_num_seqs: all four can be scheduled at once
MODEL_NAME = "qwen3.8-flash-next"
WHERE = "GPU PP=1"


def say(msg: str) -> None:
    print(f"[faults-pp1 {time.monotonic() - T0:5.0f}s] {msg}", flush=True)


def fx(*args: str) -> subprocess.CompletedProcess:
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(REPO / "launcher" / "src"),
                                                 ENV.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("FLASHNEXT_FACTS", None)
    return subprocess.run([sys.executable, "-m", "flashnext", *args], env=env, text=True,
                          capture_output=True, cwd=REPO)  # fmt: skip


def failed_findings(stdout: str) -> str:
    """The failed checks of a `--json` report, one line each; "" when there is none to
    read. (Run h3 printed only the report's tail, which never holds the findings.)"""
    try:
        findings = json.loads(stdout).get("findings") or []
    except (ValueError, AttributeError):
        return ""
    return "\n".join(f"  {f.get('id')}: {f.get('message')} (fix: {f.get('fix')})"
                     for f in findings if f.get("level") == "fail")  # fmt: skip


def ok(name: str, proc: subprocess.CompletedProcess) -> str:
    if proc.returncode != 0:
        said = failed_findings(proc.stdout) or proc.stdout[-3000:]
        raise SystemExit(f"faults-pp1: {name} failed (exit {proc.returncode}):\n"
                         f"{said}\n{proc.stderr[-3000:]}")  # fmt: skip
    return proc.stdout


def split_command(line: str) -> tuple[list[str], dict[str, str]]:
    """`env K=V ... vllm serve ...` (serve --dry-run's line) -> (argv, env)."""
    words = shlex.split(line)
    if not words or words[0] != "env":
        raise SystemExit(f"faults-pp1: not an `env ...` command line: {line[:200]}")
    env: dict[str, str] = {}
    i = 1
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        key, _, value = words[i].partition("=")
        env[key] = value
        i += 1
    return words[i:], env


class Target:
    """The model, its table and what serve would run for them."""

    def __init__(self, model: Path, table: Path, facts: Path | None, port: int) -> None:
        self.model, self.table, self.port = model, table, port
        self.base = f"http://127.0.0.1:{port}"
        self.facts = ["--facts", str(facts)] if facts else []
        self.replay = ["--replay-facts-for-testing", str(facts)] if facts else []

    def settings(self, *extra: str) -> list[str]:
        return ["--profile", PROFILE, "--model", str(self.model), "--table", str(self.table),
                *extra]  # fmt: skip

    def plan(self, *extra: str) -> dict:
        return json.loads(ok("plan", fx("plan", *self.settings(*extra), *self.facts, "--json")))

    def command(self, *extra: str) -> tuple[list[str], dict[str, str]]:
        doc = json.loads(ok("serve --dry-run", fx("serve", "--dry-run", "--json",
                                                  *self.settings("--port", str(self.port), *extra),
                                                  *self.replay)))  # fmt: skip
        argv, env = split_command(doc["command"])
        return argv, {**ENV, **env}


def options(base: str, api_key: str | None = None) -> dict:
    return {"model_name": MODEL_NAME, "api_key": api_key, "startup_timeout_s": READY_S,
            "poll_interval_s": 0.5, "progress_interval_s": 30.0, "health_interval_s": 2.0,
            "stop_timeout_s": 30.0, "hang_timeout_s": HANG_S,
            "health_url": f"{base}/health", "completion_url": f"{base}/v1/completions"}  # fmt: skip


def load(base: str, api_key: str | None = None) -> Clients:
    body = {"model": MODEL_NAME, "prompt": list(range(1000, 1064)), "max_tokens": 4000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    return Clients(f"{base}/v1/completions", body, api_key=api_key)


def fault(what: str, inject, *, name, base, argv, env, api_key=None, **kw) -> dict:
    """One start, one fault: the supervisor's output in OUT/NAME.log as it comes, the
    verdict in OUT/NAME.json as soon as it is in (a device call cut short keeps both).
    Leftover GPU bytes are NVML's for the server's own pids (fault_run.py)."""
    try:
        verdict = run_fault(what, WHERE, argv=argv, env=env, options=options(base, api_key),
                            inject=inject, clients=load(base, api_key) if inject else None,
                            ready_timeout_s=READY_S + 60, log_path=OUT / f"{name}.log",
                            **kw)  # fmt: skip
    except AssertionError as exc:  # never ready: the verdict says so, the run goes on
        say(f"{what}: no verdict: {str(exc)[-6000:]}")
        text = str(exc)  # its first line says why; then the supervisor's output
        verdict = {"what": what, "where": WHERE, "error": text[:500] + "\n...\n" + text[-2500:]}
    write_text_atomic(OUT / f"{name}.json", json.dumps(verdict, indent=2) + "\n")
    if "error" in verdict:
        return verdict
    say(f"{what}: exit {verdict['exit_code']}, detected {verdict['detected_s']} s, "
        f"left {verdict['leftover_processes']} processes")  # fmt: skip
    return verdict


# --- the API key -------------------------------------------------------------------


def key_check(base: str, server: Server, key: str) -> dict:
    """401 without the key and with another, 200 with it; the key on no command line."""

    def status(headers: dict) -> int:
        return httpx.get(f"{base}/v1/models", headers=headers, timeout=30).status_code

    shown = []
    for pid in [server.driver.pid, *server.tree]:
        try:
            if any(key in a for a in psutil.Process(pid).cmdline()):
                shown.append(pid)
        except psutil.Error:
            continue
    return {"without_key": status({}),
            "other_key": status({"Authorization": f"Bearer {secrets.token_hex(16)}"}),
            "with_key": status({"Authorization": f"Bearer {key}"}),
            "key_on_a_command_line": shown}  # fmt: skip


# --- the host pool under pressure --------------------------------------------------


def pressure_kv_bytes(target: Target) -> tuple[int, dict]:
    """KV bytes holding about PRESSURE_FIT requests of PRESSURE_LEN tokens, as the plan
    counts blocks (its kv_capacity): bytes per block from the profile's own plan."""
    base = target.plan("--max-model-len", str(PRESSURE_LEN))
    cap = base["kv_capacity"]
    per_block = base["kv_cache_memory_bytes"]["value"] / cap["num_blocks"]
    blocks = math.ceil(cap["blocks_per_request"] * PRESSURE_FIT) + 1
    kv = int(math.ceil(blocks * per_block))
    cut = target.plan("--max-model-len", str(PRESSURE_LEN), "--kv-cache-memory-bytes", str(kv))
    return kv, cut["kv_capacity"]


def cache_info(base: str, api_key: str) -> dict:
    """vLLM's cache_config_info labels (its KV capacity as it counts it) and counters."""
    text = httpx.get(f"{base}/metrics", timeout=30,
                     headers={"Authorization": f"Bearer {api_key}"}).text  # fmt: skip
    info: dict = {}
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\}", text, re.M)
    if m:
        info = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
    pre = re.findall(r"^vllm:num_preemptions_total(?:\{[^}]*\})?\s+(\S+)", text, re.M)
    return {"kv_cache_size_tokens": _num(info.get("kv_cache_size_tokens")),
            "num_gpu_blocks": _num(info.get("num_gpu_blocks")),
            "block_size": _num(info.get("block_size")),
            "preemptions": sum(float(x) for x in pre) if pre else None}  # fmt: skip


def _num(text: str | None) -> float | None:
    try:
        return float(text) if text not in (None, "None") else None
    except ValueError:
        return None


def complete(base: str, prompt: list[int], api_key: str) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": PRESSURE_TOKENS,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    try:
        resp = httpx.post(f"{base}/v1/completions", json=body, timeout=600,
                          headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if resp.status_code != 200:
        return {"error": f"HTTP {resp.status_code}: {resp.text[:300]}"}
    choice = resp.json()["choices"][0]
    return {"text": choice["text"], "finish_reason": choice.get("finish_reason")}


def host_available_low(stop: threading.Event, low: list[int]) -> None:
    while not stop.is_set():
        low[0] = min(low[0], psutil.virtual_memory().available)
        time.sleep(0.2)


def pool_pressure(base: str, api_key: str, planned: dict) -> dict:
    """4 greedy requests at once whose K/V needs at least twice what vLLM allocated,
    then the same one at a time: all finish, with equal text, and no host OOM."""
    length = PRESSURE_LEN - PRESSURE_TOKENS - 8
    prompts = [[1000 + (7919 * (i + 1) * j) % 31000 for j in range(length)]
               for i in range(PRESSURE_REQUESTS)]  # fmt: skip
    before = cache_info(base, api_key)
    capacity = before["kv_cache_size_tokens"]
    demand = PRESSURE_REQUESTS * (length + PRESSURE_TOKENS)
    low, stop = [psutil.virtual_memory().available], threading.Event()
    sampler = threading.Thread(target=host_available_low, args=(stop, low), daemon=True)
    sampler.start()
    results: list[dict | None] = [None] * PRESSURE_REQUESTS

    def one(i: int) -> None:
        results[i] = complete(base, prompts[i], api_key)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(PRESSURE_REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    together_s = time.monotonic() - t0
    stop.set()
    during = cache_info(base, api_key)
    serial = [complete(base, p, api_key) for p in prompts]
    equal = [bool(a and "text" in a and a.get("text") == b.get("text"))
             for a, b in zip(results, serial, strict=True)]  # fmt: skip
    return {
        "requests": PRESSURE_REQUESTS,
        "prompt_tokens": length,
        "max_tokens": PRESSURE_TOKENS,
        "demand_tokens": demand,
        "capacity_tokens": capacity,
        "capacity_source": "vLLM's /metrics cache_config_info kv_cache_size_tokens "
        "(group-aware); the QSA host pools hold the same blocks' K/V",
        "planned": {k: planned.get(k) for k in ("num_blocks", "usable_blocks",
                                                "blocks_per_request", "max_concurrency")},
        "demand_over_capacity": round(demand / capacity, 3) if capacity else None,
        "preempted": None if before["preemptions"] is None or during["preemptions"] is None
        else during["preemptions"] - before["preemptions"],
        "together_s": round(together_s, 1),
        "outcomes_together": [r.get("finish_reason") or r.get("error") for r in results],
        "outcomes_serial": [r.get("finish_reason") or r.get("error") for r in serial],
        "equal_per_request": equal,
        "equal_to_serial": all(equal),
        "host_available_low_bytes": low[0],
    }  # fmt: skip


# --- the faults ---------------------------------------------------------------------


def key_pressure_sigterm(target: Target) -> tuple[dict, dict, dict]:
    kv, planned = pressure_kv_bytes(target)
    say(f"pressure: --max-model-len {PRESSURE_LEN} --kv-cache-memory-bytes {kv} "
        f"(plan: {planned.get('max_concurrency')} requests of that length)")  # fmt: skip
    argv, env = target.command("--max-model-len", str(PRESSURE_LEN),
                               "--kv-cache-memory-bytes", str(kv))  # fmt: skip
    key = secrets.token_hex(24)
    env = {**env, "VLLM_API_KEY": key}  # as serve hands it (serve.supervise keeps it)

    def ready_checks(server: Server) -> dict:
        checked = {"api_key": key_check(target.base, server, key)}
        say(f"api key: {json.dumps(checked['api_key'])}")
        checked["pool_pressure"] = pool_pressure(target.base, key, planned)
        say(f"pressure: {json.dumps(checked['pool_pressure'])}")
        return checked

    verdict = fault(
        "SIGTERM to serve under load",
        lambda s: s.driver.send_signal(signal.SIGTERM),
        name="sigterm",
        base=target.base,
        argv=argv,
        env=env,
        api_key=key,
        on_ready=ready_checks,
        bound_s=90,
    )
    checked = verdict.pop("on_ready", {})
    return verdict, checked.get("pool_pressure") or {"error": "not run"}, checked.get("api_key", {})


def sigstop(target: Target) -> dict:
    argv, env = target.command()
    verdict = fault("SIGSTOP of the engine core under load",
                    lambda s: os.kill(s.pid_of("EngineCore"), signal.SIGSTOP),
                    name="sigstop", base=target.base, argv=argv, env=env,
                    bound_s=HANG_S + 90)  # fmt: skip
    verdict["hang_timeout_s"] = HANG_S
    return verdict


def port_taken(target: Target) -> dict:
    argv, env = target.command()
    squatter = socket.socket()
    # past the last server's TIME_WAIT; vLLM's bind still fails while this one listens
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", target.port))
    squatter.listen()
    try:
        return fault("port taken between preflight and vLLM's bind", None, name="port",
                     base=target.base, argv=argv, env=env, bound_s=READY_S)  # fmt: skip
    finally:
        squatter.close()


def table_truncated(target: Target) -> dict:
    """On a table of its own (a copy prepared beside the table), which it truncates."""
    ok("table prepare (the copy)", fx("table", "prepare", "--model", str(target.model),
                                      "--out", str(target.table), "--force"))  # fmt: skip
    argv, env = target.command()
    verdict = fault(
        "PLE table truncated under the running server",
        lambda s: os.truncate(target.table, 0),
        name="table",
        base=target.base,
        argv=argv,
        env=env,
        bound_s=120,
    )
    for path in (target.table, target.table.with_name(target.table.name + ".json")):
        path.unlink(missing_ok=True)  # the truncated copy and its manifest
    return verdict


def merge_into(doc: dict, soak_path: Path) -> None:
    """The soak's results file (soak_pp3.py's) with these faults, the pool under
    pressure and the key check added, and the run and card they came from; faults of an
    earlier PP=1 merge replaced."""
    soak = json.loads(soak_path.read_text())
    soak["faults"] = [f for f in soak.get("faults", []) if f.get("where") != WHERE]
    soak["faults"] += doc["faults"]
    soak["pool_pressure"] = doc["pool_pressure"]
    soak["api_key"] = doc["api_key"]
    soak["faults_command"] = doc["command"]
    # a later session may run them on another machine than the soak's (run h3's were refused)
    soak["faults_run"], soak["faults_card"] = doc.get("run"), doc.get("card")
    write_text_atomic(soak_path, json.dumps(soak, sort_keys=True, indent=2) + "\n")


def main(argv: list[str]) -> int:
    args = argv[1:]
    if args[:1] == ["merge"] and len(args) == 3:  # merge FAULTS.json SOAK.json
        merge_into(json.loads(Path(args[1]).read_text()), Path(args[2]))
        return 0
    merge = None
    if "--merge-into" in args:
        i = args.index("--merge-into")
        merge = Path(args[i + 1])
        del args[i : i + 2]
    if len(args) != 4:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    global OUT
    model, table, out = (Path(a).resolve() for a in args[:3])
    run = args[3]
    out.mkdir(parents=True, exist_ok=True)
    OUT = out
    ok("table", fx("table", "prepare", "--model", str(model), "--out", str(table), "--force"))
    facts = Path(ENV["FLASHNEXT_FACTS"]) if ENV.get("FLASHNEXT_FACTS") else None
    copy = table.with_name(f"{table.stem}-truncated{table.suffix}")
    # one after the other (see above), a port each and the truncation on a table of its own
    sigterm, pressure, key = key_pressure_sigterm(Target(model, table, facts, PORT))
    rest = ((sigstop, table), (port_taken, table), (table_truncated, copy))
    faults = [sigterm] + [one(Target(model, t, facts, PORT + i))
                          for i, (one, t) in enumerate(rest, start=1)]  # fmt: skip
    for f in faults:  # the log tail stays only where the verdict is not 0 or 1
        if f.get("exit_code") in (0, 1):
            f.pop("log", None)
    doc = {
        "run": run,
        "setup": "our pinned vLLM 0.33.0 (patched, the kit) on the host's torch 2.11, the "
        f"tiny checkpoint, profile {PROFILE}, PP=1 on one GPU, the QSA offload as the "
        f"profile plans it; the supervisor's hang bound {HANG_S:g} s (serve's is 120 s)",
        "command": f"HANG_S={HANG_S:g} checks/gpu/soak/faults_pp1.py MODEL TABLE OUT {run}",
        "card": card_now(),  # which card ran: an H200 call may get an H100
        "api_key": key,
        "pool_pressure": pressure,
        "faults": faults,
    }
    text = json.dumps(doc, sort_keys=True, indent=2) + "\n"
    write_text_atomic(out / f"faults-pp1-{run}.json", text)
    if merge is not None and merge.exists():
        merge_into(doc, merge)
    good = (
        key.get("without_key") == 401 and key.get("other_key") == 401
        and key.get("with_key") == 200 and not key.get("key_on_a_command_line")
        and pressure.get("equal_to_serial") is True
        and (pressure.get("demand_over_capacity") or 0) >= 2
        and all(f.get("leftover_processes") == 0 for f in faults)
        and [f.get("exit_code") for f in faults] == [0, 1, 1, 1]
        and all(said in f.get("message", "") for f, said in zip(faults[1:], (
            "the engine is hung", "could not bind port", "a table fault"), strict=True))
    )  # fmt: skip
    say(f"{'PASSED' if good else 'FAILED'}: {out / f'faults-pp1-{run}.json'}")
    return 0 if good else 1


T0 = time.monotonic()

if __name__ == "__main__":
    sys.exit(main(sys.argv))
