"""The launcher end to end on the tiny checkpoint, on the GPU host, with our
patched vLLM from the kit (stdlib only, Python 3.11 or newer: the host's
python3 runs it, through the `serve-tiny` beside this file).

    checks/gpu/serve/serve-tiny MODEL_DIR TABLE OUT_DIR
    PROFILE=h200-tiny-pp3 PP_ONE_GPU=1 checks/gpu/serve/serve-tiny MODEL_DIR TABLE OUT_DIR

The second form serves PP=3 on the one GPU: three pipeline ranks share GPU 0
through the test-only shim of checks/gpu/pp3 (its README, "Serving PP=3
through the launcher"). On the GPU host, for example:

    PROFILE=h200-tiny-pp3 PP_ONE_GPU=1 FLASHNEXT_MTP=1 checks/gpu/serve/serve-tiny \\
      /root/pp3/tiny12 /root/pp3/tables/ple-packed.bin $OUT/serve

1. MODEL_DIR is written by checks/gpu/tiny/tiny_model.py when it has no
   config.json (--layers 12 for h200-tiny-pp3); TABLE by `flashnext table
   prepare --force` (a no-op when it is already the table of MODEL_DIR);
2. the kit's env (KIT/env-patched.sh: PYTHONPATH of the patched vLLM tree,
   KIT/bin/vllm first on PATH) is sourced; `checks/gpu/kit/assemble` must
   have run in this machine's life;
   with PP_ONE_GPU=1: this host's facts are probed once (`flashnext facts
   --json`) and its one GPU replayed as the profile's count
   (checks/gpu/pp3/emulation.py) into OUT_DIR/facts-pp3.json; every step
   below judges those facts (--facts; serve: --replay-facts-for-testing),
   so preflight's GPU-count check passes on them, never switched off;
3. `flashnext preflight`, `plan` and `serve --dry-run` with --profile PROFILE;
4. `flashnext serve` in the background: preflight again, `vllm serve` with
   the plan's argv and env, /health, the smoke completion ("ready"); then
   /health once more from here; at PP>1 a process titled Worker_PP<r> per
   rank under serve; with PP_ONE_GPU=1 the shim's env (FLASHNEXT_PP_ONE_GPU,
   the NCCL variables, the shim folder first on PYTHONPATH) read back from
   the vLLM process. The shim reaches vLLM through serve's own environment
   only: the plan's argv and env are the shipped ones;
5. `flashnext bench` at c=1 and c=4 (short runs) and `flashnext report`
   against the running server;
6. SIGTERM to serve, which must stop vLLM and exit 0; then no process of
   that vLLM may be left (its session, its engine and worker titles:
   VLLM::EngineCore_DP0, VLLM::Worker_PP0.., its port) and
   `nvidia-smi --query-compute-apps` must list nothing.
Every step is checked; a failed one is named with what it printed. The
server is stopped whatever happens (a failed step, Ctrl-C, SIGTERM: exit
130). Exit 0 only if every step passed.

Writes OUT_DIR: serve.log (serve and vLLM), preflight.json, plan.json,
bench.json, report.json, facts-pp3.json (PP_ONE_GPU=1: the replayed facts),
serve-tiny.json (serve_result.py says what it holds).

Expected on the H200: 2-3 minutes at PP=1, most of it vLLM's cold start
(60-120 s); PP=3 on one GPU starts in about 190 s. The bench is short (64
decode tokens, 2 runs, one 3000-token prefill).

Env: PROFILE (default h200-tiny), PP_ONE_GPU (1: emulate the profile's GPUs
on this host's one GPU, as above), KIT (default /root/kit), PORT (default
8000), STARTUP_S (serve's --startup-timeout, default 240, twice the PP=1
cold start; 480 with PP_ONE_GPU=1: run s1's cold PP=3 start was still
warming kernels at 300 s), FLASHNEXT_MTP (N > 0: every flashnext step plans
and serves with MTP, N draft tokens per step; the launcher's own --mtp, read
from the environment), TINY_LAYERS (tiny_model.py --layers, default 12 for
h200-tiny-pp3, else the script's default), FLASHNEXT_PYTHON (python for the
launcher, default python3), TINY_PYTHON (python with torch for
tiny_model.py, default python3), FLASHNEXT_FACTS (replay facts instead of
probing: for the test of this script only,
checks/launcher/test_serve_tiny_script.py; with PP_ONE_GPU=1 they stand in
for this host's probe; serve gets them as --replay-facts-for-testing).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE))

import serve_procs as procs  # noqa: E402
import serve_result as summary  # noqa: E402
from serve_readout import bench_line, patch_line, plan_line, preflight_lines  # noqa: E402
from serve_result import Facts, Step  # noqa: E402

USAGE = "usage: checks/gpu/serve/serve-tiny MODEL_DIR TABLE OUT_DIR"
# The profile's context (scheduler.max_model_len), which the ready line must report.
CONTEXT_TOKENS = 24576
# serve's own --startup-timeout covers /health; the smoke completion comes after it.
SMOKE_S = 120
NOTE_EVERY_S = 15  # a "waiting for serve" line this often
STOP_WAIT_S = 90  # SIGTERM to serve -> its exit (it stops vLLM first)
CLEANUP_WAIT_S = 60  # the same on the way out after a failure
SETTLE_TRIES = 10  # SIGKILL delivery and exit are not instant: look again, 1 s apart
# The tiny vocabulary is 32768 ids, its 8 special tokens the last ones: prompts draw
# from [1000, 32760). 3000-token prompts are the A/B's timed ones.
BENCH = (
    "--concurrency",
    "1,4",
    "--decode-tokens",
    "64",
    "--prompt-lengths",
    "3000",
    "--warmup",
    "1",
    "--runs",
    "2",
    "--token-id-range",
    "1000,32760",
)


class Interrupted(Exception):
    """SIGINT or SIGTERM to the harness: stop the server, write what ran, exit 130."""


class Stop(Exception):
    """A step failed that every later step needs: write the summary now."""


def _interrupt(signum, frame):
    raise Interrupted


def _exit_code(returncode: int) -> int:
    """A shell's way: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _first_line(text: str, prefix: str) -> str:
    return next((line for line in text.splitlines() if line.startswith(prefix)), "")


def _tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def http_status(url: str) -> str:
    """The HTTP status of GET url ("" when nothing answered)."""
    try:
        return str(urllib.request.urlopen(url, timeout=10).status)
    except urllib.error.HTTPError as exc:
        return str(exc.code)
    except OSError:
        return ""


class Run:
    """One run: the settings, each step's record, the server it started."""

    def __init__(self, model: Path, table: Path, out: Path, emulated: bool) -> None:
        env = os.environ
        self.model, self.table, self.out = model, table, out
        self.kit = Path(env.get("KIT") or "/root/kit")
        self.port = env.get("PORT") or "8000"
        self.py = env.get("FLASHNEXT_PYTHON") or "python3"
        profile = env.get("PROFILE") or "h200-tiny"
        self.startup_s = int(env.get("STARTUP_S") or (480 if emulated else 240))
        self.tiny_layers = env.get("TINY_LAYERS") or ("12" if profile == "h200-tiny-pp3" else "")
        mtp = env.get("FLASHNEXT_MTP") or "0"
        self.prefix = (env.get("VLLM_PROCESS_NAME_PREFIX") or "VLLM") + "::"
        self.facts = Facts(
            profile=profile, emulated=emulated, mtp_k=int(mtp) if mtp.isdigit() else 0
        )
        self.common = [
            "--profile",
            profile,
            "--model",
            str(model),
            "--table",
            str(table),
            "--port",
            self.port,
        ]
        # --facts for preflight, plan, report and bench; serve judges the host it runs
        # on and takes replayed facts only through its testing option, which it announces.
        # Passed by option, never by the environment (serve refuses FLASHNEXT_FACTS).
        replay = env.pop("FLASHNEXT_FACTS", "")
        self.facts_opt: list[str] = []
        self.serve_opt: list[str] = []
        if replay:
            self.facts.replay_from = f"FLASHNEXT_FACTS={replay}"
            self.use_replay(replay)
        self.steps: list[Step] = []
        self.started = time.monotonic()
        self.serve: subprocess.Popen | None = None
        self.vllm_pid: int | None = None
        self.tree: list[int] = []
        self.interrupted = False  # SIGINT/SIGTERM: the run failed, whatever ran

    # --- records and output

    def clock(self) -> int:
        return int(time.monotonic() - self.started)

    def say(self, text: str) -> None:
        print(f"[serve-tiny {self.clock():3d}s] {text}", flush=True)

    def record(self, name: str, verdict: str, t: float, detail: str = "") -> None:
        took = int(time.monotonic() - t)
        detail = detail.replace("\n", " ")
        self.steps.append(Step(name, verdict, took, detail))
        self.say(f"{verdict}: {name} ({took} s)" + (f": {detail}" if detail else ""))

    def fail(self, name: str, t: float, detail: str) -> None:
        """Record a failed step that every later one needs, and stop."""
        self.record(name, "FAILED", t, detail)
        raise Stop

    @property
    def failed(self) -> bool:
        return self.interrupted or any(s.verdict == "FAILED" for s in self.steps)

    def use_replay(self, path: str) -> None:
        self.facts.replay = path
        self.facts_opt = ["--facts", path]
        self.serve_opt = ["--replay-facts-for-testing", path]

    # --- children

    def launcher_env(self) -> dict[str, str]:
        """This process's environment with the launcher first on PYTHONPATH."""
        path = os.environ.get("PYTHONPATH")
        src = str(REPO / "launcher" / "src")
        return {**os.environ, "PYTHONPATH": f"{src}:{path}" if path else src}

    def fx(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """`python -m flashnext ARGS` (its output goes where kw says, else to ours)."""
        return subprocess.run([self.py, "-m", "flashnext", *args], env=self.launcher_env(), **kw)

    def fx_to(self, path: Path, *args: str) -> int:
        """`flashnext ARGS > path`: its exit code."""
        with open(path, "w") as fh:
            return _exit_code(self.fx(*args, stdout=fh).returncode)

    def py_json(self, path: Path | str):
        """A JSON file, None when it cannot be read."""
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    # --- 1. inputs

    def model_step(self) -> None:
        t = time.monotonic()
        if (self.model / "config.json").is_file():
            self.record("model", "ok", t, f"present: {self.model}")
            return
        self.say(f"writing the tiny checkpoint to {self.model} (checks/gpu/tiny/tiny_model.py)")
        self.model.parent.mkdir(parents=True, exist_ok=True)
        layers = ["--layers", self.tiny_layers] if self.tiny_layers else []
        said = f" (--layers {self.tiny_layers})" if self.tiny_layers else ""
        python = os.environ.get("TINY_PYTHON") or "python3"
        if subprocess.run(
            [python, "checks/gpu/tiny/tiny_model.py", str(self.model), *layers]
        ).returncode:
            self.fail(
                "model",
                t,
                f"checks/gpu/tiny/tiny_model.py {self.model}"
                f"{' ' + ' '.join(layers) if layers else ''} failed (output above)",
            )
        self.record("model", "ok", t, f"written: {self.model}{said}")

    # --- 2. the kit's env, the table, the profile

    def kit_step(self) -> None:
        t = time.monotonic()
        env_file = self.kit / "env-patched.sh"
        if not env_file.is_file():
            self.fail(
                "kit",
                t,
                f"{env_file} is missing: assemble the kit first (python3 "
                "checks/gpu/kit/assemble, checks/gpu/kit/README.md)",
            )
        # What the file exports, as a shell that sourced it has it: every later step's env.
        # Its own output goes to stderr; the environment comes back NUL-separated.
        sourced = subprocess.run(
            ["bash", "-c", '. "$1" 1>&2 && exec env -0', "serve-tiny", str(env_file)],
            stdout=subprocess.PIPE,
        )
        if sourced.returncode:
            self.fail("kit", t, f"sourcing {env_file} failed (exit {sourced.returncode})")
        env = dict(kv.partition("=")[::2] for kv in sourced.stdout.decode().split("\0") if kv)
        env.pop("_", None)  # bash's last command, not the kit's
        os.environ.clear()
        os.environ.update(env)
        vllm = shutil.which("vllm")
        if not vllm:
            self.fail("kit", t, f"no vllm on PATH after sourcing {env_file}")
        sampler = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") or "unset"
        self.record("kit", "ok", t, f"vllm is {vllm}; VLLM_USE_FLASHINFER_SAMPLER={sampler}")

    def table_step(self) -> None:
        t = time.monotonic()
        self.table.parent.mkdir(parents=True, exist_ok=True)
        args = ["--model", str(self.model), "--out", str(self.table), "--force"]
        if self.fx("table", "prepare", *args).returncode:
            self.fail("table", t, f"flashnext table prepare {' '.join(args)} failed (output above)")
        self.record("table", "ok", t, str(self.table))

    def read_profile(self) -> None:
        """The profile's pipeline and GPU count (an unknown profile: preflight names it)."""
        code = (
            "import sys\n"
            "from flashnext.profiles import available_profiles\n"
            "p = available_profiles().get(sys.argv[1])\n"
            "print(p.parallel.pipeline_parallel_size, p.gpu.count) if p else print('', '')\n"
        )
        said = subprocess.run(
            [self.py, "-c", code, self.facts.profile],
            env=self.launcher_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ).stdout.split()
        if len(said) == 2 and all(s.isdigit() for s in said):
            self.facts.pp_size, self.facts.gpu_count = int(said[0]), int(said[1])

    # --- 2b. PP_ONE_GPU=1: this host's GPU replayed as the profile's

    def facts_step(self) -> None:
        t, f = time.monotonic(), self.facts
        if not f.gpu_count or f.gpu_count < 2:
            what = f"{f.gpu_count} GPU(s)" if f.gpu_count else "not a profile this launcher has"
            self.fail(
                "facts",
                t,
                f"PP_ONE_GPU=1 emulates a profile of several GPUs; "
                f"{f.profile} is {what} (PROFILE=h200-tiny-pp3)",
            )
        host_facts, probed = f.replay, None
        if not host_facts:  # probed once, here; only the replayed copy is kept
            fd, probed = tempfile.mkstemp(prefix="serve-tiny-facts.")
            os.close(fd)
            host_facts = probed
            args = ["--model", str(self.model), "--table", str(self.table), "--port", self.port]
            if self.fx_to(Path(probed), "facts", "--json", *args):
                os.unlink(probed)
                self.fail("facts", t, "flashnext facts --json failed (output above)")
            f.replay_from = "this host, probed with flashnext facts --json"
        f.host_gpus = summary.gpus_in(host_facts)
        replayed = self.out / "facts-pp3.json"
        emulation = ["checks/gpu/pp3/emulation.py"]
        said = subprocess.run(
            [self.py, *emulation, "facts", host_facts, str(replayed), "--gpus", str(f.gpu_count)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if probed:
            os.unlink(probed)
        text = said.stdout.rstrip("\n")
        if said.returncode:
            self.fail("facts", t, text)
        self.record("facts", "ok", t, f"{text}; the host's facts: {f.replay_from}")
        f.replay_from += f", its GPU replayed x{f.gpu_count} (checks/gpu/pp3/emulation.py)"
        self.use_replay(str(replayed))
        # what serve's environment gets, PYTHONPATH included (the shim folder first)
        f.shim_env = subprocess.run(
            [self.py, *emulation, "env"],
            env=self.launcher_env(),
            stdout=subprocess.PIPE,
            text=True,
        ).stdout.splitlines()

    # --- 3. preflight, plan, dry run

    def preflight_step(self) -> None:
        t = time.monotonic()
        path = self.out / "preflight.json"
        rc = self.fx_to(path, "preflight", *self.common, *self.facts_opt, "--json")
        lines = preflight_lines(path)
        print("\n".join(lines), flush=True)
        if rc:
            fails = [re.sub(" +", " ", line) for line in lines if line.startswith("  fail")][:3]
            self.fail("preflight", t, f"exit {rc}; " + "\n".join(fails))
        self.record("preflight", "ok", t, lines[-1].lstrip(" ") if lines else "")

    def plan_step(self) -> None:
        t = time.monotonic()
        path = self.out / "plan.json"
        if self.fx_to(path, "plan", *self.common, *self.facts_opt, "--json"):
            self.fail("plan", t, "flashnext plan failed (output above)")
        self.record("plan", "ok", t, plan_line(self.py_json(path)))

    def dry_run_step(self) -> None:
        t = time.monotonic()
        dry = self.fx(
            "serve", *self.common, *self.serve_opt, "--dry-run", stdout=subprocess.PIPE, text=True
        )
        print(dry.stdout.rstrip("\n"), flush=True)
        if dry.returncode:
            self.fail("dry-run", t, "flashnext serve --dry-run failed")
        self.record("dry-run", "ok", t, "the command above is what serve runs")

    # --- 4. serve

    def serve_step(self) -> bool:
        """Start serve and wait for ready; True when it is up (whatever the checks said)."""
        t = time.monotonic()
        log = self.out / "serve.log"
        self.say(f"starting flashnext serve (log: {log}; startup timeout {self.startup_s} s)")
        # With PP_ONE_GPU=1 the shim's env comes last: its PYTHONPATH is the shim folder,
        # then the one serve runs with otherwise. serve hands its environment to vLLM.
        env = self.launcher_env() | {"PYTHONUNBUFFERED": "1"}
        env |= dict(kv.split("=", 1) for kv in self.facts.shim_env)
        argv = [
            self.py,
            "-m",
            "flashnext",
            "serve",
            *self.common,
            *self.serve_opt,
            "--startup-timeout",
            str(self.startup_s),
        ]
        with open(log, "w") as fh:
            # Its own process group: a Ctrl-C at the terminal reaches the harness, which
            # stops serve the way step 6 does.
            self.serve = subprocess.Popen(
                argv, env=env, stdout=fh, stderr=subprocess.STDOUT, process_group=0
            )
        deadline = time.monotonic() + self.startup_s + SMOKE_S
        note = time.monotonic() + NOTE_EVERY_S
        while True:
            text = log.read_text(errors="replace")
            ready = _first_line(text, "flashnext: ready: ")
            if ready:
                break
            if self.serve.poll() is not None:
                rc = _exit_code(self.serve.returncode)
                self.serve = None
                print(f"--- last lines of {log}\n{_tail(log, 60)}", flush=True)
                why = _first_line(text, "flashnext: error: ") or _tail(log, 1)
                self.record(
                    "serve", "FAILED", t, f"flashnext serve exited {rc} before ready: {why}"
                )
                if _first_line(text, "flashnext: error: smoke test failed"):
                    self.facts.health = True  # the smoke completion goes only after /health 200
                return False
            if time.monotonic() >= deadline:
                print(f"--- last lines of {log}\n{_tail(log, 60)}", flush=True)
                self.record("serve", "FAILED", t, f"not ready after {int(time.monotonic() - t)} s")
                return False
            if time.monotonic() >= note:
                self.say(f"waiting for serve: {_tail(log, 1)[:150]}")
                note = time.monotonic() + NOTE_EVERY_S
            time.sleep(1)
        self.check_ready(t, ready, text)
        return True

    def check_ready(self, t: float, ready: str, log: str) -> None:
        """serve said ready: its command, context, /health, workers and the shim's env."""
        f = self.facts
        f.smoke = True  # serve says ready only once its smoke completion was answered
        self.vllm_pid = procs.first_child(self.serve.pid)
        self.tree = procs.descendants(self.serve.pid)
        started = _first_line(log, "flashnext: starting: ").removeprefix("flashnext: starting: ")
        planned = " ".join((self.py_json(self.out / "plan.json") or {}).get("argv", []))
        code = http_status(f"http://127.0.0.1:{self.port}/health")
        f.health = code == "200"
        workers = procs.pp_workers(self.prefix, self.tree)
        vllm = self.vllm_pid or "?"
        detail = (
            f"{ready.removeprefix('flashnext: ready: ')}; vLLM pid {vllm}, processes "
            f"under serve: {' '.join(map(str, self.tree)) or 'none'}"
        )
        if workers:
            detail += f"; PP workers: {workers}"
        problems = []
        if started != planned:
            problems.append(
                f"serve ran another command than the plan's: started [{started}], "
                f"planned [{planned}]"
            )
        if f"context {CONTEXT_TOKENS} tokens" not in ready:
            problems.append(
                f"the server does not report the profile's context ({CONTEXT_TOKENS}): {ready}"
            )
        if not f.health:
            problems.append(f"GET /health from here answered {code or 'nothing'} after ready")
        pp = f.pp_size or 1
        for rank in range(pp if pp > 1 else 0):
            if f"{self.prefix}Worker_PP{rank} " not in workers + " ":
                problems.append(
                    f"PP={pp}, but no process titled {self.prefix}Worker_PP{rank} "
                    f"under serve (found: {workers or 'none'})"
                )
        if f.emulated:
            f.shim_in_vllm, why = procs.env_differences(self.vllm_pid, f.shim_env)
            if f.shim_in_vllm:
                names = " ".join(kv.split("=", 1)[0] for kv in f.shim_env)
                detail += f"; the shim's env is vLLM's ({names})"
            else:
                problems.append(f"the shim's env did not reach vLLM (pid {vllm}): {why}")
        if problems:
            self.record("serve", "FAILED", t, ";".join(problems))
        else:
            self.record("serve", "ok", t, detail)
        said = [
            line
            for line in log.splitlines()
            if re.match(r"flashnext: (watching|no .* engine)", line)
        ][:2]
        if said:
            print("\n".join(said), flush=True)

    # --- 5. bench, report

    def bench_step(self) -> None:
        t = time.monotonic()
        path = self.out / "bench.json"
        rc = self.fx_to(
            path,
            "bench",
            "--url",
            f"http://127.0.0.1:{self.port}",
            *BENCH,
            "--plan",
            str(self.out / "plan.json"),
            *self.facts_opt,
            "--json",
        )
        ok, line = bench_line(path, self.facts.mtp_k)
        if rc == 0 and ok:
            self.record("bench", "ok", t, line)
        else:
            self.record("bench", "FAILED", t, f"exit {rc}: {line}")

    def report_step(self) -> None:
        t = time.monotonic()
        path = self.out / "report.json"
        said = self.fx(
            "report",
            *self.common,
            *self.facts_opt,
            "--vllm-python",
            "python3",
            "--out",
            str(path),
            "--json",
            stdout=subprocess.PIPE,
            text=True,
        )
        text = said.stdout.rstrip("\n")
        print(text, flush=True)
        rc = _exit_code(said.returncode)
        if rc == 0 and path.is_file() and path.stat().st_size:
            self.record("report", "ok", t, patch_line(path))
        else:
            self.record("report", "FAILED", t, f"exit {rc}: {text}")

    # --- 6. stop, nothing left

    def stop_step(self) -> None:
        t, log = time.monotonic(), self.out / "serve.log"
        if self.serve is None:
            self.record("stop", "skipped", t, "flashnext serve had exited already")
            return
        serve, self.serve = self.serve, None
        if serve.poll() is not None:
            print(_tail(log, 40), flush=True)
            self.record(
                "stop",
                "FAILED",
                t,
                f"flashnext serve had already exited "
                f"({_exit_code(serve.returncode)}) before SIGTERM: the server died",
            )
            return
        self.say(f"SIGTERM to flashnext serve (pid {serve.pid})")
        serve.terminate()
        try:
            rc = _exit_code(serve.wait(timeout=STOP_WAIT_S))
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
            self.record(
                "stop",
                "FAILED",
                t,
                f"flashnext serve did not exit within {STOP_WAIT_S} s of SIGTERM (SIGKILLed)",
            )
            return
        said = _first_line(
            log.read_text(errors="replace"), "flashnext: received SIGTERM, stopping the server"
        )
        if rc == 0 and said:
            self.record("stop", "ok", t, "serve stopped vLLM and exited 0")
        else:
            print(_tail(log, 30), flush=True)
            self.record(
                "stop",
                "FAILED",
                t,
                f"serve exited {rc} after SIGTERM (0 means it stopped vLLM itself)",
            )

    def processes_step(self) -> None:
        t = time.monotonic()
        for attempt in range(SETTLE_TRIES):
            left = procs.leftovers(self.vllm_pid, self.port, self.prefix, self.tree)
            if not left:
                break
            if attempt < SETTLE_TRIES - 1:
                time.sleep(1)
        if not left:
            self.record(
                "processes",
                "ok",
                t,
                f"none of vLLM's processes left (session "
                f"{self.vllm_pid or '?'}, {self.prefix}*, port {self.port})",
            )
        else:
            print("\n".join(left), flush=True)
            self.record(
                "processes",
                "FAILED",
                t,
                "still running: " + "".join(f"{line};" for line in left[:3]),
            )

    def gpu_step(self) -> None:
        t = time.monotonic()
        if not shutil.which("nvidia-smi"):
            self.record("gpu", "skipped", t, "no nvidia-smi on this host")
            return
        query = [
            "nvidia-smi",
            "--query-compute-apps=pid,process_name,used_memory",
            "--format=csv,noheader",
        ]
        for attempt in range(SETTLE_TRIES):
            smi = subprocess.run(query, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            apps = smi.stdout.rstrip("\n")
            if smi.returncode or not apps:
                break
            if attempt < SETTLE_TRIES - 1:
                time.sleep(1)
        listed = "".join(f"{line};" for line in apps.split("\n"))
        if smi.returncode:
            self.record(
                "gpu",
                "skipped",
                t,
                f"nvidia-smi --query-compute-apps failed ({_exit_code(smi.returncode)}): {listed}",
            )
        elif not apps:
            self.record("gpu", "ok", t, "nvidia-smi lists no compute process")
        else:
            self.record("gpu", "FAILED", t, f"nvidia-smi --query-compute-apps: {listed}")

    # --- the way out

    def stop_leftovers(self) -> None:
        """The server is ours: stop it on any way out (a failed step, Ctrl-C, SIGTERM)."""
        serve, self.serve = self.serve, None
        if serve is not None and serve.poll() is None:
            self.say(f"cleanup: stopping serve (pid {serve.pid})")
            serve.terminate()
            try:
                serve.wait(timeout=CLEANUP_WAIT_S)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
        if self.vllm_pid:  # vLLM leads its own process group (serve starts it so)
            with contextlib.suppress(OSError):
                os.killpg(self.vllm_pid, signal.SIGKILL)

    def finish(self) -> None:
        seconds = self.clock()
        doc = summary.document(self.facts, self.steps, self.failed, seconds, self.out)
        summary.write(self.out / "serve-tiny.json", doc)
        print(f"\n{summary.table(self.steps)}", flush=True)
        verdict = "FAILED" if self.failed else "PASSED"
        self.say(f"{verdict} in {seconds} s; results in {self.out}")

    def steps_in_order(self) -> None:
        self.model_step()
        self.kit_step()
        self.table_step()
        self.read_profile()
        if self.facts.emulated:
            self.facts_step()
        self.preflight_step()
        self.plan_step()
        self.dry_run_step()
        if self.serve_step():
            self.bench_step()
            self.report_step()
        else:
            t = time.monotonic()
            self.record("bench", "skipped", t, "no server")
            self.record("report", "skipped", t, "no server")
        self.stop_step()
        self.processes_step()
        self.gpu_step()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print(USAGE, file=sys.stderr)
        return 2
    model, table, out = (Path(os.path.realpath(a)) for a in args)
    one_gpu = os.environ.get("PP_ONE_GPU", "")
    if one_gpu not in ("", "0", "1"):
        print(f"serve-tiny: PP_ONE_GPU={one_gpu}: expected 1 (emulate) or 0", file=sys.stderr)
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"serve-tiny: cannot create {out}: {exc.strerror}", file=sys.stderr)
        return 2
    os.chdir(REPO)
    sys.stdout.reconfigure(line_buffering=True)
    run = Run(model, table, out, emulated=one_gpu == "1")
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    try:
        run.steps_in_order()
    except Stop:
        code = 1
    except Interrupted:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run.interrupted = True
        run.say("interrupted")
        run.stop_leftovers()
        code = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        run.stop_leftovers()
    if code != 130:
        code = 1 if run.failed else 0
    run.finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
