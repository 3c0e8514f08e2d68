"""The PP=3 harness on the GPU host: engines in parallel, each its own process
(engine.py) under the kit's stock or patched tree, then the comparisons.

    python checks/gpu/pp3/orchestrate.py PHASE --model DIR --stock-model DIR
        --tables DIR --kit /root/kit --out OUT --raw RAW --run-id ID

PHASE diagnose: the V2-runner crash. PP=3 engines with one sync probe each
(capture.install_sync), stock and patched, plus PP=1 and the V1 runner with
layer capture; prints which engines died and how (the device assert lines).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from compare import compare_runs, render  # noqa: E402
from emulation import ONE_GPU_ENV, SHIM_DIR  # noqa: E402

OFFLOAD_ENV = {
    "VLLM_QSA_KV_OFFLOAD": "1",
    "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS": "1024",
    "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES": str(16 << 30),
}
ERROR_LINE = re.compile(
    r"Assertion|index out of bounds|illegal memory|CUDA error|RuntimeError"
    r"|pp3 sync probe|pp3 trace|pp3 streams|Error:"
)


@dataclass(frozen=True)
class Engine:
    name: str
    tree: str  # stock | patched
    pp: int
    graphs: str = "eager"
    table: bool = True
    sync: str = "none"
    capture: bool = False
    cases: tuple = ((100, 1), (100, 4), (3000, 1))
    env: dict[str, str] = field(default_factory=dict)
    stock_model: bool = False  # the PLE-off, dummy-weight copy stock can load at PP>1


# capture.install_sync's probes: where a sync goes, what is traced, candidate fixes.
SYNC_PROBES = (
    "none", "recv", "pre_forward", "post_forward", "sample", "layers", "trace", "trace2",
    "fix_recv", "fix_send", "fix_recv_sync", "fix_recv_persistent", "send_sync",
    "streams", "fix_stream",
)  # fmt: skip


def diagnose_engines() -> list[Engine]:
    engines = [Engine(f"pp3-sync-{where}", "patched", 3, sync=where) for where in SYNC_PROBES]
    # Is it memory reuse? Without the caching allocator nothing is reused early;
    # with NCCL recording its streams (instead of stashing tensors until wait()),
    # a buffer NCCL still touches is never handed out again.
    engines.append(
        Engine("pp3-env-nocache", "patched", 3, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    )
    engines.append(
        Engine("pp3-env-recordstreams", "patched", 3, env={"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"})
    )
    engines.append(Engine("pp3-stock", "stock", 3, table=False, stock_model=True))
    # Which stream does stock's PP handler wait on, and which one runs the step?
    engines.append(
        Engine("pp3-stock-streams", "stock", 3, table=False, stock_model=True, sync="streams")
    )
    capture_cases = ((100, 1), (3000, 1), (100, 4))
    # Candidate fix F with layer capture: if it serves, its layers meet pp1-ref's.
    engines.append(
        Engine("pp3-fix_stream", "patched", 3, sync="fix_stream", capture=True, cases=capture_cases)
    )
    engines.append(Engine("pp1-ref", "patched", 1, capture=True, cases=capture_cases))
    engines.append(
        Engine(
            "pp3-v1",
            "patched",
            3,
            capture=True,
            cases=capture_cases,
            env={"VLLM_USE_V2_MODEL_RUNNER": "0"},
        )  # fmt: skip
    )
    return engines


def spec_for(engine: Engine, args) -> dict[str, Any]:
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", **engine.env}
    if engine.pp > 1:
        env |= ONE_GPU_ENV
    return {
        "run": engine.name,
        "model": str(args.stock_model if engine.stock_model else args.model),
        "load_format": "dummy" if engine.stock_model else None,
        "pp": engine.pp,
        "graphs": engine.graphs,
        "table": str(args.tables / "ple-packed.bin") if engine.table else None,
        "sync": engine.sync,
        "capture": engine.capture,
        "cases": [list(c) for c in engine.cases],
        "env": env,
    }


def launch(engine: Engine, args) -> dict[str, Any]:
    spec = spec_for(engine, args)
    raw = args.raw
    spec_path, out_path, log_path = (
        raw / f"{engine.name}{s}" for s in (".spec.json", ".out.json", ".log")
    )
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    pythonpath = f"{SHIM_DIR}:" if engine.pp > 1 else ""
    command = (
        f". {args.kit / f'env-{engine.tree}.sh'} && export PYTHONPATH={pythonpath}$PYTHONPATH && "
        f"exec python3 {HERE / 'engine.py'} {spec_path} {out_path}"
    )
    started = time.monotonic()
    with log_path.open("w") as log:
        # Its own session: the engine's workers go with it, however it ends.
        proc = subprocess.Popen(
            ["bash", "-c", command],
            env={**os.environ, **spec["env"]},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: Any = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = "timeout"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    wall = time.monotonic() - started
    record = (
        json.loads(out_path.read_text()) if out_path.exists() else {"run": engine.name, "ok": False}
    )
    errors = [
        ln for ln in log_path.read_text(errors="replace").splitlines() if ERROR_LINE.search(ln)
    ]
    record |= {"exit": code, "wall_s": round(wall, 1), "error_lines": errors[:120]}
    print(f"pp3: {engine.name} exit {code} ok={record.get('ok')} after {wall:.0f} s", flush=True)
    return record


def run_all(engines: list[Engine], args) -> dict[str, dict]:
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        return dict(
            zip(
                (e.name for e in engines), pool.map(lambda e: launch(e, args), engines), strict=True
            )
        )


def diagnose(args) -> dict[str, Any]:
    engines = [e for e in diagnose_engines() if not args.only or e.name in args.only]
    if args.cases:
        cases = tuple(tuple(int(x) for x in c.split("x")) for c in args.cases)
        engines = [dataclasses.replace(e, cases=cases) for e in engines]
    records = run_all(engines, args)
    summary = {
        name: {
            "ok": r.get("ok"),
            "exit": r.get("exit"),
            "error": r.get("error"),
            "error_lines": r.get("error_lines"),
            "ids": {c: v["output_ids"] for c, v in r.get("cases", {}).items()},
        }
        for name, r in records.items()
    }
    comparisons = []
    ref = args.raw / "pp1-ref.out.json"
    for other in ("pp3-v1", "pp3-fix_stream"):
        path = args.raw / f"{other}.out.json"
        if records.get("pp1-ref", {}).get("ok") and records.get(other, {}).get("ok"):
            result = compare_runs(ref, path)
            comparisons.append(result)
            print(render(result), flush=True)
    return {"records": summary, "comparisons": comparisons}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["diagnose"])
    for name in ("model", "stock-model", "tables", "kit", "out", "raw"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--parallel", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--only", nargs="*", help="engine names to run (default: all of the phase)")
    parser.add_argument("--cases", nargs="*", help="TOKENSxBATCH cases instead of each engine's")
    args = parser.parse_args()
    args.raw.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"phase": args.phase, "run_id": args.run_id, "emulated": True, "devices": 1}
    result |= diagnose(args)
    dest = args.out / f"pp3_{args.phase}-{args.run_id}.json"
    dest.write_text(json.dumps(result, indent=1))
    with tarfile.open(args.out / f"logs-{args.run_id}.tgz", "w:gz") as tar:
        for log in sorted(args.raw.glob("*.log")):
            tar.add(log, arcname=log.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
