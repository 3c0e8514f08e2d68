"""The A/B inside vLLM 0.33.0 on a GPU: stock vs patched, every mode, one verdict table.

    python checks/gpu/ab/in_vllm_ab.py --model DIR --tables DIR --plan PLAN.json \\
        --kit /root/kit --out OUT_DIR --raw RAW_DIR --run-id N [--phase all|ab|timing] \\
        [--parallel 9]

Runs on the GPU host with its own python (torch there; vLLM comes from the
kit, checks/gpu/kit). Each engine run is its own process
(checks/gpu/ab/in_vllm_worker.py) on the tiny checkpoint of
checks/gpu/tiny/tiny_model.py, with the h200-tiny profile's settings: PLAN is its
`flashnext plan --json` (run-in-vllm writes it on the GPU host), whose argv
vLLM's own parser turns into each engine's LLM(...) arguments
(checks/gpu/common/plan_settings.py) and whose environment is each engine's.
What a run must differ in is overridden by name (`run_overrides`) and recorded
in the result (`engines.<run>.overrides`, `env_dropped`):

  a  stock vLLM, PLE table pinned in memory (stock default: no --engram-config,
     which stock's parser rejects), QSA K/V in VRAM (the plan's offload
     variables dropped)
  b  patched, PLE from `flashnext table prepare`'s file (packed: the plan's;
     page-aligned), QSA K/V in VRAM
  c  patched, PLE from the packed file, QSA K/V offloaded to host RAM as the
     plan has it (1,024-token chunks, so long prefills merge many chunks)
  sensitivity  c (eager) with every offloaded selection permuted: must differ

each eager (an override) and with the plan's FULL_DECODE_ONLY graphs, on prompts of 100, 3,000 and
20,000 distinct random token ids at batch 1 and 4. Every b and c run is
compared with a of the same graph mode, and with stock's own run-to-run spread
(the other a run), by checks/gpu/common/logprob_compare.py (vLLM's check_logprobs_close
rule, prompt logprobs at every position). Two more runs time TTFT and decode of
b-packed and c with graphs at c=1 and c=4 (3,000-token prompts).

The timing runs go last and one at a time, alone on the GPU.

Writes OUT_DIR/in_vllm_ab-<run-id>.json and .md; raw outputs and engine logs
stay in RAW_DIR. Exit 0 when every run is equal and the sensitivity run is
not, 1 otherwise. This is our pinned vLLM on the host's torch, not the pinned
torch 2.14: the JSON says which.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))

from card import card as card_now  # noqa: E402
from logprob_compare import compare_runs  # noqa: E402
from plan_settings import plan_env, plan_table  # noqa: E402

PROMPT_LENGTHS = (100, 3000, 20000)
BATCHES = (1, 4)
TIMED_PROMPT_TOKENS = 3000
RUN_TIMEOUT_S = 420
PROFILE = "h200-tiny"  # the profile whose plan every engine runs (run-in-vllm writes it)
TABLES = {"packed": "ple-packed.bin", "aligned": "ple-aligned.bin"}
# The worker's engine runs in its own process, so the timing hooks and the
# sensitivity run's permutation see the real worker.
HARNESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@dataclass(frozen=True)
class Run:
    name: str
    tree: str  # "stock" | "patched"
    mode: str  # a | b-packed | b-aligned | c | sensitivity
    graphs: str  # "eager" | "full_decode_only"
    table: str | None = None  # "packed" | "aligned"
    offload: bool = False
    permute_selection: bool = False
    timed: bool = False
    env: dict[str, str] = field(default_factory=dict)


def all_runs() -> list[Run]:
    runs = []
    for graphs in ("eager", "full_decode_only"):
        runs += [
            Run(f"a-{graphs}", "stock", "a", graphs),
            Run(f"b-packed-{graphs}", "patched", "b-packed", graphs, "packed"),
            Run(f"b-aligned-{graphs}", "patched", "b-aligned", graphs, "aligned"),
            Run(f"c-{graphs}", "patched", "c", graphs, "packed", offload=True),
        ]
    runs += [
        Run("sensitivity-eager", "patched", "sensitivity", "eager", "packed", True, True),
        # Timed alone, after the A/B runs: (c) against (b), both with graphs.
        Run("timing-b", "patched", "timing", "full_decode_only", "packed", timed=True),
        Run("timing-c", "patched", "timing", "full_decode_only", "packed", True, timed=True),
    ]
    return runs


def make_prompts(model: Path, seed: int = 0) -> dict[str, list[list[int]]]:
    """Distinct random ids (no specials, no EOS: it resets the PLE history)."""
    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config", config)
    specials = {int(text.get("eos_token_id", 0)), int(text.get("bos_token_id", 0))}
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    specials |= {int(t["id"]) for t in tokenizer.get("added_tokens", []) if t.get("special")}
    pool = [t for t in range(int(text["vocab_size"])) if t not in specials]
    rng = random.Random(seed)
    cases = {}
    for length in PROMPT_LENGTHS:
        prompts = [rng.sample(pool, length) for _ in range(max(BATCHES))]
        for batch in BATCHES:
            cases[f"{length}x{batch}"] = prompts[:batch]
    return cases


def run_overrides(run: Run, args, plan: dict[str, Any]) -> dict[str, Any]:
    """What this run's engine must differ in from the plan, by name (None: unset)."""
    wanted: dict[str, Any] = {"model": str(args.model)}  # a copy of the plan's (MTP's drafters)
    if run.graphs == "eager":
        wanted |= {"enforce_eager": True, "compilation_config": None}
    table = TABLES.get(run.table or "")
    if table is None:
        wanted["engram_config"] = None  # stock's PLE: the table pinned in host memory
    elif str(args.tables / table) != plan_table(plan):
        wanted["engram_config"] = {"mmap_path": str(args.tables / table)}
    if args.gpu_memory_utilization is not None:  # a start-up gate only: the KV bytes are set
        wanted["gpu_memory_utilization"] = args.gpu_memory_utilization
    return wanted


def worker_spec(run: Run, args, cases, timed_prompts, plan=None) -> dict[str, Any]:
    """The worker's spec: the plan (args.plan unless given), this run's overrides, its
    environment (the plan's, less the QSA offload variables where K/V stay in VRAM)."""
    plan = args.plan if plan is None else plan
    env, dropped = plan_env(plan, offload=run.offload)
    return {
        "run": run.name,
        "plan": {"argv": list(plan["argv"]), "env": dict(plan["env"])},
        "overrides": run_overrides(run, args, plan),
        "permute_selection": run.permute_selection,
        "cases": {} if run.timed else cases,
        "timed_batches": [timed_prompts[:1], timed_prompts[:4]] if run.timed else [],
        "env": env | HARNESS_ENV | run.env,
        "env_dropped": dropped,
    }


def launch(run: Run, spec: dict[str, Any], args) -> dict[str, Any]:
    """One worker process under the run's tree; returns its record or its error."""
    raw = args.raw
    spec_path, out_path = raw / f"{run.name}.spec.json", raw / f"{run.name}.out.json"
    log_path = raw / f"{run.name}.log"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env_script = args.kit / f"env-{run.tree}.sh"
    command = f". {env_script} && exec python3 {HERE / 'in_vllm_worker.py'} {spec_path} {out_path}"
    env = {**os.environ, **spec["env"]}
    started = time.monotonic()
    with log_path.open("w") as log:
        try:
            proc = subprocess.run(
                ["bash", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT,
                timeout=args.timeout, check=False,
            )  # fmt: skip
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    wall = time.monotonic() - started
    print(f"in_vllm_ab: {run.name} exit {code} after {wall:.0f} s", file=sys.stderr, flush=True)
    if code == 0 and out_path.exists():
        return json.loads(out_path.read_text()) | {"wall_s": wall}
    tail = log_path.read_text(errors="replace").splitlines()[-40:]
    return {"run": run.name, "error": f"exit {code}", "log_tail": tail, "wall_s": wall}


def host_facts(kit: Path) -> dict[str, Any]:
    probe = (
        "import json, torch, triton; print(json.dumps({'torch': torch.__version__, "
        "'triton': triton.__version__, 'gpu': torch.cuda.get_device_name(0)}))"
    )
    facts = json.loads(subprocess.run(["python3", "-c", probe], capture_output=True,
                                      text=True, check=True).stdout)  # fmt: skip
    stamp = json.loads((kit / "patched" / "vllm" / "_flashnext_patches.json").read_text())
    listing = "".join(f"{p['name']} {p['sha256']}\n" for p in stamp["patches"])
    facts["patch_series"] = {
        "series_sha256": stamp["series_sha256"],
        "patches_sha256": hashlib.sha256(listing.encode()).hexdigest(),
        "patches": [p["name"] for p in stamp["patches"]],
    }
    facts["note"] = "our pinned vLLM 0.33.0 on the host's torch, not the pinned torch 2.14"
    facts["card"] = card_now()  # which card ran: an H200 call may get an H100
    return facts


def verdicts(records: dict[str, dict], runs: list[Run]) -> tuple[list[dict], bool | None]:
    """Each b/c/sensitivity case against stock of its graph mode and stock's spread
    (the other stock run: prompt logprobs come from the same eager prefill)."""
    rows, sensitivity_changed = [], None
    stock = {g: records.get(f"a-{g}", {}) for g in ("eager", "full_decode_only")}
    for run in runs:
        if run.mode in ("a", "timing"):
            continue
        reference = stock[run.graphs]
        other = stock["full_decode_only" if run.graphs == "eager" else "eager"]
        record = records.get(run.name, {})
        for case in sorted(record.get("cases", {}), key=lambda c: tuple(map(int, c.split("x")))):
            length, batch = (int(n) for n in case.split("x"))
            row = {"run": run.name, "mode": run.mode, "graphs": run.graphs,
                   "prompt_tokens": length, "batch": batch}  # fmt: skip
            if "cases" not in reference or "cases" not in other:
                rows.append(row | {"equal": False, "first_difference": "a stock run failed"})
                continue
            v = compare_runs(reference["cases"][case], other["cases"][case], record["cases"][case])
            rows.append(row | {
                "equal": v.equal, "max_logprob_diff": v.max_logprob_diff,
                "mean_logprob_diff": v.mean_logprob_diff, "violations": v.violations,
                "stock_violations": v.stock_violations,
                "stock_mean_logprob_diff": v.stock_mean_logprob_diff,
                "deterministic_positions": v.deterministic_positions,
                "first_difference": v.where,
            })  # fmt: skip
        if "error" in record:
            rows.append({"run": run.name, "mode": run.mode, "graphs": run.graphs,
                         "equal": False, "error": record["error"]})  # fmt: skip
        if run.mode == "sensitivity" and "cases" in record:
            mine = [r for r in rows if r["run"] == run.name]
            sensitivity_changed = not all(r["equal"] for r in mine)
    return rows, sensitivity_changed


def timing_ratios(records: dict[str, dict]) -> list[dict[str, Any]]:
    """(c) against (b-packed), both with graphs: TTFT and decode tok/s at c=1, c=4."""
    b = records.get("timing-b", {}).get("timing", [])
    c = records.get("timing-c", {}).get("timing", [])
    rows = []
    for tb, tc in zip(b, c, strict=False):
        rows.append({
            "batch": tb["batch"], "prompt_tokens": tb["prompt_tokens"],
            "b_ttft_s": tb["ttft_s"], "c_ttft_s": tc["ttft_s"],
            "ttft_ratio_c_over_b": tc["ttft_s"] / tb["ttft_s"],
            "b_decode_tok_s": tb["decode_tok_s"], "c_decode_tok_s": tc["decode_tok_s"],
            "decode_ratio_c_over_b": tc["decode_tok_s"] / tb["decode_tok_s"],
            "ple_gather_decode_us_per_step_b": tb["ple_gather_decode"].get("mean_us"),
            "ple_gather_decode_us_per_step_c": tc["ple_gather_decode"].get("mean_us"),
            "ple_gather_prefill_us_per_step_b": tb["ple_gather_prefill"].get("mean_us"),
        })  # fmt: skip
    return rows


def engine_record(record: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """An engine's line in the result: what it differs in from the plan (the
    overrides it applied, the plan's variables it dropped) and how it ran."""
    keys = ("overrides", "startup_s", "wall_s", "peak_vram_bytes", "mean_top1_logprob",
            "error", "log_tail")  # fmt: skip
    return {k: record.get(k) for k in keys} | {"env_dropped": spec["env_dropped"]}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"### in-vLLM A/B, run {result['run_id']} ({result['host']['gpu']}, "
        f"torch {result['host']['torch']}: {result['host']['note']})",
        "",
        "| run | graphs | prompt tokens | batch | equal | max / mean logprob diff "
        "| stock's own mean diff | rule violations (stock's) | positions stock reproduces "
        "| why not equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["runs"]:
        if "max_logprob_diff" not in r:
            lines.append(f"| {r['run']} | {r['graphs']} | - | - | False | - | - | - | - | "
                         f"{r.get('error') or r.get('first_difference', '')} |")  # fmt: skip
            continue
        lines.append(
            f"| {r['run']} | {r['graphs']} | {r['prompt_tokens']} | {r['batch']} | "
            f"{r['equal']} | {r['max_logprob_diff']:.4f} / {r['mean_logprob_diff']:.4f} | "
            f"{r['stock_mean_logprob_diff']:.4f} | {r['violations']} ({r['stock_violations']}) "
            f"| {r['deterministic_positions']} | {r['first_difference']} |"
        )
    lines += ["", f"sensitivity_changed: {result['sensitivity_changed']}", ""]
    if result["timing"]:
        lines += [
            "| batch | TTFT b / c (s) | c/b | decode tok/s b / c | c/b "
            "| PLE gather per decode step b / c (us) |",
            "|---|---|---|---|---|---|",
        ]  # fmt: skip
        for t in result["timing"]:
            gb, gc = t["ple_gather_decode_us_per_step_b"], t["ple_gather_decode_us_per_step_c"]
            lines.append(
                f"| {t['batch']} | {t['b_ttft_s']:.3f} / {t['c_ttft_s']:.3f} | "
                f"{t['ttft_ratio_c_over_b']:.2f} | {t['b_decode_tok_s']:.1f} / "
                f"{t['c_decode_tok_s']:.1f} | {t['decode_ratio_c_over_b']:.2f} | "
                f"{gb or 0:.0f} / {gc or 0:.0f} |"
            )
    return "\n".join(lines) + "\n"


def engine_run_parser(description: str) -> argparse.ArgumentParser:
    """The options every run of worker engines on the tiny checkpoint takes
    (this A/B, mtp_equality.py): what run-in-vllm passes, and the engines' limits."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--tables", type=Path, required=True)
    parser.add_argument(
        "--plan", type=Path, required=True,
        help=f"`flashnext plan --json` of the {PROFILE} profile: every engine's settings",
    )  # fmt: skip
    parser.add_argument("--kit", type=Path, default=Path("/root/kit"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--raw", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--timeout", type=int, default=RUN_TIMEOUT_S)
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=None,
        help="instead of the plan's (an override, recorded)",
    )  # fmt: skip
    return parser


def read_plan(path: Path) -> dict[str, Any]:
    """The plan file, checked to be the harness's profile's."""
    plan = json.loads(Path(path).read_text())
    if plan.get("profile") != PROFILE:
        raise SystemExit(f"{path}: a plan of {plan.get('profile')!r}, not of {PROFILE!r}")
    return plan


def plan_record(plan: dict[str, Any]) -> dict[str, Any]:
    """What a result says of the plan its engines ran."""
    return {k: plan.get(k) for k in ("profile", "plan_hash", "argv", "env")}


def main() -> int:
    parser = engine_run_parser(__doc__.splitlines()[0])
    # 5 at once ran on the H200; on an H100 (8 GiB start gate a process, not 14) what
    # fits is not measured: lower it where vLLM refuses a start for free memory.
    parser.add_argument("--parallel", type=int, default=5)
    parser.add_argument(
        "--phase",
        choices=("all", "ab", "timing"),
        default="all",
        help="ab: the compared runs (in parallel); timing: the timed runs (one at a "
        "time); all: both, timing last",
    )
    parser.add_argument("--only", nargs="*", default=None, help="run names to run")
    args = parser.parse_args()
    args.plan = read_plan(args.plan)
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw.mkdir(parents=True, exist_ok=True)

    wanted = {"all": (False, True), "ab": (False,), "timing": (True,)}[args.phase]
    runs = [
        r for r in all_runs() if r.timed in wanted and (args.only is None or r.name in args.only)
    ]
    cases = make_prompts(args.model)
    timed = make_prompts(args.model, seed=1)[f"{TIMED_PROMPT_TOKENS}x4"]
    specs = {run.name: worker_spec(run, args, cases, timed) for run in runs}
    host = host_facts(args.kit)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {
            run.name: pool.submit(launch, run, specs[run.name], args)
            for run in runs
            if not run.timed
        }
        records = {name: future.result() for name, future in futures.items()}
    for run in runs:  # one at a time, nothing else on the GPU
        if run.timed:
            records[run.name] = launch(run, specs[run.name], args)
    rows, changed = verdicts(records, runs)
    result = {
        "schema_version": 2,
        "run_id": args.run_id,
        "host": host,
        # Every engine's settings: the plan's, but for each engine's overrides (engines).
        "plan": plan_record(args.plan),
        "settings": {"top_k_logprobs": 5},
        "runs": rows,
        "sensitivity_changed": changed,
        "timing": timing_ratios(records),
        "engines": {
            name: engine_record(rec, specs[name]) for name, rec in records.items()
        },  # fmt: skip
    }
    stem = args.out / f"in_vllm_ab-{args.run_id}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    if args.phase == "timing":
        return 0 if len(result["timing"]) == 2 else 1
    ok = rows and all(r["equal"] for r in rows if r["mode"] != "sensitivity") and changed
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
