"""Does a 3090 rank fit in 24 GiB? Each rank's slice on the H200 under a ballast (issue 12).

On the GPU host (checks/gpu/rank_fit/run-rank-fit calls it):

    python3 checks/gpu/rank_fit/rank_fit.py run --inputs DIR --rank R --run-id ID --out DIR

Here, after the calls, to merge the per-rank files and print the table:

    python3 checks/gpu/rank_fit/rank_fit.py merge --run-id ID [--results checks/gpu/results]

`run`, for rank R of rank_fit.json (checks/gpu/rank_fit/rank_slice.py wrote it):
1. the PLE table of the real size, as a sparse file with the manifest
   `flashnext table prepare` writes (rank 0's slice only: it alone has the
   PLE layer);
2. the ballast (checks/gpu/rank_fit/ballast.py) leaves free what one idle 3090 has
   free in the replayed facts, plus the bytes of the modules a PP=1 slice
   builds that the rank does not hold (LM head, final HC mixer and norm on
   rank 0; the embedding on rank 2; all of them on rank 1), less the PP
   receive buffers the plan counts for the rank, which PP=1 does not allocate;
3. rank_fit_worker.py starts vLLM with the plan's argv and env, but for the
   overrides by name (the rank's from rank_slice.py, the H200's of the
   worker; HOST_ENV's variables), and runs the
   prefills: 48,000 tokens, 4 x 60,000 at once, then 262,142 + 2 new tokens
   (the context ends at max_model_len, 262,144);
4. writes OUT/rank_fit-ID-rankR.json: `rank`, `planned_bytes` (the plan's
   committed bytes for the rank), `peak_bytes` (the engine's peak as NVML
   counts it, moved back to the rank: less the slice's extra modules, plus
   its PP buffers), `ok` (the engine started and every prefill finished),
   `overrides` and `env_overrides` (what the run differs in from the plan),
   and the details.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The run whose per-rank files stand for today's plan (checks/gpu/RESULTS.md);
# a test fails when the plan no longer is the one that run measured.
RUN_OF_RECORD = "r7"
INPUTS_ON_HOST = "/root/rank_fit/inputs"  # where run-rank-fit puts rank_slice's output
NEW_TOKENS = 2
# Prompt ids inside the vocabulary (248,320), clear of the special tokens at
# its top (248,044 and up).
TOKEN_RANGE = (100, 248_000)
# Kernels that need sm90: on a 3090 vLLM never picks them, so neither may we.
DISABLED_KERNELS = "MacheteLinearKernel,CutlassW4A8LinearKernel"
# The lent host's rules (.library/device KINDS.md) and no network there.
HOST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # flashinfer's sampler is a JIT build
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine's allocator in the worker
    "VLLM_DISABLED_KERNELS": DISABLED_KERNELS,
}


def spec_argv(rank: dict[str, Any], inputs: Path, extra: list[str]) -> list[str]:
    """The rank's argv with the slice where it lies on this host, and a diagnosis's
    flags (e.g. --no-enable-flashinfer-autotune, recorded as diagnosis_args)."""
    return [a.replace("@SLICE@", str(inputs)) for a in rank["argv"]] + list(extra)


def env_overrides(plan_env: dict[str, str]) -> dict[str, str]:
    """HOST_ENV's variables that the plan's environment lacks or sets otherwise."""
    return {k: v for k, v in HOST_ENV.items() if plan_env.get(k) != v}


def cases(max_model_len: int) -> list[dict[str, Any]]:
    """The issue's prefills, largest last (an OOM there keeps the others)."""
    return [
        {"name": "48k", "batch": 1, "tokens": 48_000, "token_range": TOKEN_RANGE},
        {"name": "4x60k", "batch": 4, "tokens": 60_000, "token_range": TOKEN_RANGE},
        {
            "name": "262k",
            "batch": 1,
            "tokens": max_model_len - NEW_TOKENS,
            "token_range": TOKEN_RANGE,
        },
    ]


def budget(doc: dict[str, Any], rank: dict[str, Any], headroom: int = 0) -> dict[str, int]:
    """Free bytes the ballast leaves, and the start-up budget, for one slice.

    `headroom` > 0 is a measuring run: the ballast leaves that much more, so
    a slice that does not fit still shows how much it needs (`ok` still
    judges the peak against the 3090's free memory)."""
    extra = sum(rank["slice_extra_bytes"].values())
    pp_buffers = rank["planned"]["pp_buffer_bytes"]
    return {
        "slice_extra": extra,
        "pp_buffers": pp_buffers,
        "headroom": headroom,
        "target_free": doc["card_free_bytes"] + extra - pp_buffers + headroom,
        "gate_budget": rank["planned"]["vram_usable_bytes"] + extra - pp_buffers,
    }


def write_sparse_table(table: dict[str, Any]) -> dict[str, Any]:
    """The table file at its real size, holes only, and its manifest."""
    path = Path(table["path"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(table["bytes"])
    Path(f"{path}.json").write_text(json.dumps(table["manifest"], indent=2) + "\n")
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "allocated_bytes": st.st_blocks * 512}


def start_ballast(target_free: int) -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "ballast.py"), str(target_free)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        raise SystemExit(f"rank_fit: the ballast exited {proc.returncode} before holding memory")
    return proc, json.loads(line)


def stop_ballast(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _over_run(worker: dict[str, Any], key: str) -> int:
    """The largest `key` over the start and every case the worker recorded."""
    records = [worker.get("start", {}), *worker.get("cases", [])]
    return max(int(r.get(key, 0)) for r in records)


def judge(
    doc: dict[str, Any], rank: dict[str, Any], worker: dict[str, Any], b: dict[str, int]
) -> dict[str, Any]:
    """The per-rank record: planned vs peak, moved back to what the rank holds."""
    start = worker.get("start", {})
    ran = [c["name"] for c in worker.get("cases", []) if c.get("ok")]
    peak_rank = _over_run(worker, "driver_peak") - b["slice_extra"] + b["pp_buffers"]
    ok = (
        bool(worker.get("ok"))
        and "error" not in start
        and len(ran) == len(cases(0))
        and peak_rank <= doc["card_free_bytes"]
    )
    planned = rank["planned"]
    return {
        "rank": rank["rank"],
        "planned_bytes": planned["committed_bytes"],
        "peak_bytes": peak_rank,
        "ok": ok,
        "card_free_bytes": doc["card_free_bytes"],
        "margin_bytes": doc["card_free_bytes"] - peak_rank,
        "allocator_peak_bytes": _over_run(worker, "max_reserved")
        - b["slice_extra"]
        + b["pp_buffers"],
        "kv_cache_memory_bytes": doc["kv_cache_memory_bytes"],
        "qsa_host_bytes": _over_run(worker, "qsa_host_bytes"),
        "qsa_host_bytes_planned": rank["qsa_host_bytes_planned"],
        "cases_ok": ran,
        "budget": b,
        "worker": worker,
    }


def kernel_choices(log_lines: list[str]) -> list[str]:
    """vLLM's own lines naming the kernels and backends it chose."""
    picked = []
    for line in log_lines:
        message = line.split("] ", 1)[-1]
        chose = message.startswith("Using ") and ("Kernel" in message or "backend" in message)
        if chose and message not in picked:
            picked.append(message)
    return picked


def host_facts() -> dict[str, Any]:
    probe = (
        "import json, torch, triton; print(json.dumps({'torch': torch.__version__, "
        "'triton': triton.__version__, 'gpu': torch.cuda.get_device_name(0), "
        "'gpu_memory_bytes': torch.cuda.get_device_properties(0).total_memory}))"
    )  # the card that ran (an H200 call may get an H100) and its memory, as torch has it
    out = subprocess.run(["python3", "-c", probe], capture_output=True, text=True, check=False)
    facts = json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}
    facts["note"] = "our pinned vLLM 0.33.0 on the host's torch, not the pinned torch 2.14"
    return facts


def run(args) -> int:
    doc = json.loads((args.inputs / "rank_fit.json").read_text())
    rank = doc["ranks"][args.rank]
    b = budget(doc, rank, args.headroom)
    argv = spec_argv(rank, args.inputs, args.extra_arg)
    table = write_sparse_table(doc["table"]) if rank["ple_layer_ids"] else None
    max_model_len = int(argv[argv.index("--max-model-len") + 1])
    spec = {
        "rank": rank["rank"],
        "argv": argv,
        "overrides": rank["overrides"],
        "budget_bytes": b["gate_budget"],
        "new_tokens": NEW_TOKENS,
        "cases": cases(max_model_len),
    }
    work = args.work / f"rank{rank['rank']}"
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, log_path = work / "spec.json", work / "out.json", work / "worker.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {**os.environ, **doc["plan_env"], **HOST_ENV}
    record_env = {k: env[k] for k in ("RANK_FIT_GC",) if k in env}
    ballast, held = start_ballast(b["target_free"])
    print(f"rank_fit: rank {rank['rank']}: ballast {held}", file=sys.stderr, flush=True)
    started = time.monotonic()
    worker_py = HERE / "rank_fit_worker.py"
    command = f". {args.kit}/env-patched.sh && exec python3 {worker_py} {spec_path} {out_path}"
    try:
        with log_path.open("w") as log:
            proc = subprocess.run(
                ["bash", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT,
                timeout=args.timeout, check=False,
            )  # fmt: skip
        code: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    finally:
        stop_ballast(ballast)
    worker = json.loads(out_path.read_text()) if out_path.exists() else {}
    worker["exit"] = code
    worker["wall_s"] = round(time.monotonic() - started, 1)
    log_lines = log_path.read_text(errors="replace").splitlines()
    worker["log_tail"] = log_lines[-60:]
    worker["kernels"] = kernel_choices(log_lines)
    record = judge(doc, rank, worker, b)
    record.update({"run_id": args.run_id, "ballast": held, "table": table, "host": host_facts()})
    record["overrides"] = worker.get("overrides", rank["overrides"])
    record["env_overrides"] = env_overrides(doc["plan_env"])
    record["diagnosis_env"] = record_env
    record["diagnosis_args"] = args.extra_arg
    args.out.mkdir(parents=True, exist_ok=True)
    dest = args.out / f"rank_fit-{args.run_id}-rank{rank['rank']}.json"
    dest.write_text(json.dumps(record, indent=2) + "\n")
    print(f"rank_fit: rank {rank['rank']}: ok={record['ok']} planned={record['planned_bytes']} "
          f"peak={record['peak_bytes']} -> {dest}", file=sys.stderr)  # fmt: skip
    return 0 if record["ok"] else 1


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def phase_peaks(record: dict[str, Any]) -> dict[str, int | None]:
    """Driver-view peaks as the rank, split into engine start and serving
    (the prefills); None where the phase never ran."""
    b, w = record["budget"], record["worker"]
    shift = b["pp_buffers"] - b["slice_extra"]
    start = w.get("start", {}).get("driver_peak")
    serving = [c["driver_peak"] for c in w.get("cases", []) if "driver_peak" in c]
    return {
        "start_peak_bytes": None if start is None else start + shift,
        "serving_peak_bytes": max(serving) + shift if serving else None,
    }


def merge(args) -> int:
    files = sorted(args.results.glob(f"rank_fit-{args.run_id}-rank*.json"))
    if not files:
        print(f"rank_fit: no rank_fit-{args.run_id}-rank*.json in {args.results}", file=sys.stderr)
        return 1
    records = [json.loads(f.read_text()) for f in files]
    keys = ("rank", "planned_bytes", "peak_bytes", "ok", "margin_bytes", "allocator_peak_bytes",
            "qsa_host_bytes", "qsa_host_bytes_planned", "cases_ok")  # fmt: skip
    summary = [{**{k: r[k] for k in keys}, **phase_peaks(r)} for r in records]
    doc = {"run_id": args.run_id, "note": records[0]["host"]["note"], "ranks": summary}
    (args.results / f"rank_fit-{args.run_id}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(
        "| rank | planned | peak, start | peak, serving | allocator peak | "
        "left of the 3090's free | QSA pinned host (planned) | prefills | ok |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['rank']} | {gib(s['planned_bytes'])} | {gib(s['start_peak_bytes'])} | "
              f"{gib(s['serving_peak_bytes'])} | {gib(s['allocator_peak_bytes'])} | "
              f"{gib(s['margin_bytes'])} | "
              f"{gib(s['qsa_host_bytes'])} ({gib(s['qsa_host_bytes_planned'])}) | "
              f"{', '.join(s['cases_ok']) or '-'} | {s['ok']} |")  # fmt: skip
    return 0 if all(s["ok"] for s in summary) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--inputs", type=Path, required=True, help="rank_slice.py's output dir")
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--run-id", required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--kit", type=Path, default=Path("/root/kit"))
    r.add_argument("--work", type=Path, default=Path("/root/rank_fit/work"))
    r.add_argument("--timeout", type=float, default=520.0, help="seconds for the worker")
    r.add_argument("--headroom", type=int, default=0, help="bytes beyond the 3090's (measuring)")
    r.add_argument(
        "--extra-arg", action="append", default=[], help="a vLLM flag added to the plan's argv"
    )
    m = sub.add_parser("merge")
    m.add_argument("--run-id", required=True)
    m.add_argument("--results", type=Path, default=HERE.parent / "results")
    args = p.parse_args()
    return run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    sys.exit(main())
