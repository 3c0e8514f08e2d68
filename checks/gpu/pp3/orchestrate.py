"""The PP=3 harness on the GPU host: engines in parallel, each its own process
(engine.py) under the kit's stock or patched tree, then the comparisons.

    python checks/gpu/pp3/orchestrate.py PHASE --model DIR --stock-model DIR
        --tables DIR --kit /root/kit --out OUT --raw RAW --run-id ID

PHASE diagnose: the V2-runner crash. PP=3 engines with one sync probe each
(capture.install_sync), stock and patched, plus PP=1 and the V1 runner with
layer capture; prints which engines died and how (the device assert lines).

PHASE equality: PP=3 against PP=1, layer by layer (compare.py), in each mode
of the 3x3090 profile, with the reference's own run-to-run spread and two
sensitivity runs that must be caught where they act; the PP=1 layer A/B
(offload against VRAM, PLE file against PLE in VRAM). Engines of one run id
may be spread over several calls (`--only`): every call compares whatever
engines of the run have finished, and writes pp3_equality-RUN_ID.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "common"))

import compare  # noqa: E402
from card import card as card_now  # noqa: E402
from compare import (  # noqa: E402
    boundary_paths,
    compare_runs,
    echo_acceptance,
    judge,
    render,
    schedule_bounds,
    spread_bounds,
)
from emulation import ONE_GPU_ENV, SHIM_DIR  # noqa: E402
from own_session import run_in_own_session  # noqa: E402
from plan_settings import plan_env  # noqa: E402

# Engines at once (--parallel; a PP=3 engine is three processes). Each process's
# start gate wants the plan's gpu_memory_utilization (0.1) of the card free: 14 GiB
# of an H200, 8 GiB of an H100. 10 ran together on the H200 (e2-e4); on an H100 at
# most 3 have (issue 42's probe), and what fits there is not measured: an engine
# refused with vLLM's "Free memory on device ... is less than desired GPU memory
# utilization" asks for a lower --parallel, and the result's `card` says which ran.
PARALLEL = 10

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
    offload: bool = False  # QSA K/V in host RAM, as the plan has it
    stock_model: bool = False  # the PLE-off, dummy-weight copy stock can load at PP>1
    mtp: bool = False  # MTP K=1 with the echo drafter copy (echo_drafter.py)
    new_tokens: int = 8
    pin_autotune: bool = False  # every Triton autotuner on its first config (capture.py)
    batched_tokens: int | None = None  # another --max-num-batched-tokens than the plan's


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


# The equality phase's prompts: 100, 3,000 and 20,000 distinct ids, batch 1 and 4.
EQUALITY_CASES = ((100, 1), (100, 4), (3000, 1), (3000, 4), (20000, 1), (20000, 4))
SENSITIVITY_CASES = ((100, 1), (3000, 1))
# Batch 4 of long prompts, prefill only. With decode steps in the mix the two
# engines split the later prompts into different chunks (at PP=3 a running
# request decodes every pp_size steps, at PP=1 every step, and each decode
# takes a token of the 512-token budget), and a recurrent GDN layer rounds a
# different split differently. With one new token nothing decodes: both
# engines fill every step with 512 prompt tokens in the same order.
PREFILL_BATCH_CASES = ((3000, 4), (20000, 4))
MTP = {"method": "mtp", "num_speculative_tokens": 1}
# The rechunked reference's token budget: not a multiple of GDN's 64-token
# chunks, so every prefill chunk after the first starts elsewhere in them.
RECHUNK_TOKENS = 500
# Where e3's MTP draft rows parted on equal metadata (20000x4) and where the
# metadata itself differed (3000x4): steps that mix prefill chunks and verifies.
POISON_CASES = ((3000, 4), (20000, 4))


@dataclass(frozen=True)
class Mode:
    """One way the profile runs the model: graphs, where QSA K/V lives, MTP."""

    name: str
    graphs: str = "eager"
    offload: bool = False
    mtp: bool = False
    table: bool = True


EAGER = Mode("eager-vram")
PROFILE = Mode("graphs-offload-mtp", graphs="full_decode_only", offload=True, mtp=True)
EQUALITY_MODES = (EAGER, PROFILE)


def mode_engine(name: str, mode: Mode, pp: int, **kw) -> Engine:
    return Engine(
        name, "patched", pp, graphs=mode.graphs, table=mode.table, capture=True,
        cases=kw.pop("cases", EQUALITY_CASES), offload=mode.offload, mtp=mode.mtp, **kw,
    )  # fmt: skip


def equality_engines() -> list[Engine]:
    engines = []
    for mode in EQUALITY_MODES:
        engines.append(mode_engine(f"pp1-{mode.name}", mode, 1))
        engines.append(mode_engine(f"pp3-{mode.name}", mode, 3))
    for mode in EQUALITY_MODES:
        for pp in (1, 3):
            engines.append(
                mode_engine(
                    f"pp{pp}-{mode.name}-prefill4",
                    mode,
                    pp,
                    cases=PREFILL_BATCH_CASES,
                    new_tokens=1,
                )  # fmt: skip
            )
    # The reference against itself, its cases in the other order (other KV
    # blocks for the same prompt): the spread past the indexer budget.
    engines.append(mode_engine(f"pp1-{EAGER.name}-again", EAGER, 1, cases=EQUALITY_CASES[::-1]))
    # The same in the profile's mode: do PP=1's own MTP draft rows part at
    # batch 4 (e2, e3: PP=3's do, by 0.7 of a row, on equal GDN metadata)?
    engines.append(mode_engine(f"pp1-{PROFILE.name}-again", PROFILE, 1, cases=EQUALITY_CASES[::-1]))
    # The reference in other prefill chunks: what a GDN layer's rounding does
    # to the same tokens run in another chunk (PP=3's scheduler moves batch 4's
    # later prompts by a token or two: RESULTS.md, "What parts them").
    engines.append(
        mode_engine(f"pp1-{EAGER.name}-rechunk", EAGER, 1, batched_tokens=RECHUNK_TOKENS)
    )
    # The profile's reference with every GDN output row no kernel writes in a
    # mixed prefill + spec-decode step left NaN (capture.poison_gdn_out): its
    # draft rows NaN at layer.N.gdn say "never written", numbers say
    # "computed differently". Only the batch-4 long cases have such steps.
    engines.append(
        mode_engine(
            f"pp1-{PROFILE.name}-poison", PROFILE, 1, sync="poison_gdn_out", cases=POISON_CASES
        )
    )
    # Both sides with every autotuner on one config: what parts them then is
    # not a config timed differently on a shared GPU.
    for pp in (1, 3):
        engines.append(mode_engine(f"pp{pp}-{EAGER.name}-pinned", EAGER, pp, pin_autotune=True))
    engines.append(
        mode_engine("pp3-shift", EAGER, 3, sync="boundary_shift", cases=SENSITIVITY_CASES)
    )
    # The dropped token acts inside one rank's QSA layer, so PP=1 shows it as well.
    engines.append(
        mode_engine("pp1-drop", PROFILE, 1, sync="drop_one_token", cases=SENSITIVITY_CASES)
    )
    # The PP=1 layer A/B: offload against VRAM, PLE file against PLE in VRAM.
    engines.append(mode_engine("pp1-eager-offload", Mode("eager-offload", offload=True), 1))
    engines.append(mode_engine("pp1-eager-ple-vram", Mode("eager-ple-vram", table=False), 1))
    return engines


# (name, reference, engine, what it is): every comparison of the phase.
EQUALITY_PAIRS = (
    ("spread", f"pp1-{EAGER.name}", f"pp1-{EAGER.name}-again", "reference run to run"),
    (
        "spread-schedule",
        f"pp1-{EAGER.name}",
        f"pp1-{EAGER.name}-rechunk",
        f"reference in other prefill chunks ({RECHUNK_TOKENS}-token budget): bounds moved rows",
    ),
    (
        "spread-profile",
        f"pp1-{PROFILE.name}",
        f"pp1-{PROFILE.name}-again",
        "reference run to run, the profile's mode (MTP draft rows)",
    ),
    *(
        (f"pp3-{m.name}", f"pp1-{m.name}", f"pp3-{m.name}", f"PP=3 vs PP=1, {m.name}")
        for m in EQUALITY_MODES
    ),
    *(
        (
            f"pp3-{m.name}-prefill4",
            f"pp1-{m.name}-prefill4",
            f"pp3-{m.name}-prefill4",
            f"PP=3 vs PP=1, {m.name}, batch 4 prefill only",
        )
        for m in EQUALITY_MODES
    ),  # fmt: skip
    (
        f"pp3-{EAGER.name}-pinned",
        f"pp1-{EAGER.name}-pinned",
        f"pp3-{EAGER.name}-pinned",
        f"PP=3 vs PP=1, {EAGER.name}, every autotuner on its first config",
    ),
    ("boundary_shift", f"pp1-{EAGER.name}", "pp3-shift", "sensitivity: misaligned row at rank 1"),
    ("drop_one_token", f"pp1-{PROFILE.name}", "pp1-drop", "sensitivity: a selected token dropped"),
    (
        "poison-gdn-out",
        f"pp1-{PROFILE.name}",
        f"pp1-{PROFILE.name}-poison",
        "GDN rows no kernel writes in a mixed step left NaN (points.*.by_kind.*.nan_rows)",
    ),
    ("ab-offload", f"pp1-{EAGER.name}", "pp1-eager-offload", "PP=1 A/B: QSA K/V offloaded"),
    ("ab-ple-file", "pp1-eager-ple-vram", f"pp1-{EAGER.name}", "PP=1 A/B: PLE from the file"),
)
# Each reference's own run-to-run spread: what bounds the rows compared with
# it past the indexer budget. The profile's reference (graphs, offload, MTP)
# has its own (e4: its spread parts at other positions than eager's); every
# other reference takes the eager one's.
SPREAD_OF = {f"pp1-{EAGER.name}": "spread", f"pp1-{PROFILE.name}": "spread-profile"}
SPREAD_KEYS = tuple(key for key, *_ in EQUALITY_PAIRS if key.startswith("spread"))


def spread_key(ref: str) -> str:
    return SPREAD_OF.get(ref, "spread")


# Where each sensitivity run must be caught: the layer it acts on (QSA layer
# 3 is the first, on rank 0; layer 4 is rank 1's first).
EXPECTED_CATCH = {"boundary_shift": "layer.4.", "drop_one_token": "layer.3.qsa"}


def engine_env(engine: Engine, plan: dict[str, Any]) -> tuple[dict[str, str], list[str]]:
    """The plan's environment for this engine, and the plan's variables it drops."""
    env, dropped = plan_env(plan, offload=engine.offload)
    env |= engine.env
    if engine.pp > 1:
        env |= ONE_GPU_ENV  # the emulation's shim: three ranks on GPU 0
    return env, dropped


def spec_for(engine: Engine, args) -> dict[str, Any]:
    """The engine's spec: the plan (engine.py takes its arguments from there) and
    what this engine differs in (engine.py's overrides, the env's drops)."""
    env, dropped = engine_env(engine, args.plan)
    model = args.stock_model if engine.stock_model else args.model
    if engine.mtp:
        model = args.echo_model
    spec = {
        "run": engine.name,
        "model": str(model),
        "load_format": "dummy" if engine.stock_model else None,
        "pp": engine.pp,
        "graphs": engine.graphs,
        "table": str(args.tables / "ple-packed.bin") if engine.table else None,
        "sync": engine.sync,
        "capture": engine.capture,
        "pin_autotune": engine.pin_autotune,
        "cases": [list(c) for c in engine.cases],
        "max_new_tokens": engine.new_tokens,
        "plan": {"argv": args.plan["argv"], "env": args.plan["env"]},
        "env": env,
        "env_dropped": dropped,
    }
    if engine.mtp:
        spec["speculative_config"] = MTP
    if engine.batched_tokens is not None:
        spec["max_num_batched_tokens"] = engine.batched_tokens
    return spec


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
    code = run_in_own_session(command, {**os.environ, **spec["env"]}, log_path, args.timeout)
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


def _series_stamp(kit: Path) -> dict[str, Any] | None:
    """The patched tree's stamp (patches/apply): the series' sha256 and patches."""
    stamp = kit / "patched" / "vllm" / "_flashnext_patches.json"
    if not stamp.is_file():
        return None
    data = json.loads(stamp.read_text())
    return {
        "series_sha256": data.get("series_sha256"),
        "patches": [p.get("name") for p in data.get("patches", [])],
    }


def _capture_errors(record: dict[str, Any]) -> dict[str, list[str]]:
    """Per case, what the capture's diagnostic hooks met (capture.dump's `errors`)."""
    found = {}
    for case, entry in record.get("cases", {}).items():
        errors = [e for dump in entry.get("capture") or [] for e in (dump or {}).get("errors", [])]
        if errors:
            found[case] = errors
    return found


def _summary(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "ok": record.get("ok"),
        "exit": record.get("exit"),
        "error": record.get("error"),
        "error_lines": record.get("error_lines"),
        "startup_s": record.get("startup_s"),
        "spec_decode": record.get("spec_decode"),
        "pinned_autotune": record.get("pinned_autotune"),  # per rank: kernel -> config
        "capture_errors": _capture_errors(record),
        "ids": {c: v["output_ids"] for c, v in record.get("cases", {}).items()},
        # MTP engines: what the echo drafter's counters can be (RESULTS.md, e1 item 5)
        "echo": echo_acceptance(
            {c: v["output_ids"] for c, v in record.get("cases", {}).items()},
            record.get("spec_decode"),
        )
        if record.get("spec_decode")
        else None,
    }


def earlier_spreads(path: Path) -> dict[str, Any]:
    """The references' spreads as an earlier call of the run measured them
    (`--spread-from`), so that a call on a fresh machine, after the machine
    that ran them was lost, bounds its comparisons as that machine would
    have. A spread whose two engines run anew in this call replaces its own."""
    earlier = json.loads(path.read_text()).get("comparisons", {})
    return {key: earlier[key] | {"from": str(path)} for key in SPREAD_KEYS if key in earlier}


def cached(raw: Path, name: str, inputs: list[Path], extra: Any, compute) -> Any:
    """compute(), kept in RAW/compare/ under the bytes it reads: a later call
    of the same run id computes again only what an engine run anew changed.
    (Each call of run e2 compared every finished pair again: 170-270 s of
    the GPU host's time per call.) The key holds compare.py itself, so a
    changed comparison is never taken from an older one."""
    digest = hashlib.sha256(Path(compare.__file__).read_bytes())
    for path in inputs:
        digest.update(path.read_bytes())
    digest.update(json.dumps(extra, sort_keys=True).encode())
    kept = raw / "compare" / f"{name}-{digest.hexdigest()[:20]}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    result = compute()
    kept.parent.mkdir(exist_ok=True)
    tmp = kept.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(kept)
    return result


def equality(args) -> dict[str, Any]:
    """Run this call's engines, then every comparison whose two engines of
    this run id have finished (in this call or an earlier one)."""
    engines = {e.name: e for e in equality_engines()}
    chosen = [e for e in engines.values() if not args.only or e.name in args.only]
    run_all(chosen, args)
    finished = {}
    for name in engines:
        path = args.raw / f"{name}.out.json"
        if path.exists():
            finished[name] = json.loads(path.read_text())
    done = {n for n, r in finished.items() if r.get("ok")}
    comparisons = earlier_spreads(args.spread_from) if args.spread_from else {}
    for key, ref, other, what in EQUALITY_PAIRS:  # the spreads first: the others use them
        if ref in done and other in done:
            spread = None if key.startswith("spread") else comparisons.get(spread_key(ref))
            pair = [args.raw / f"{ref}.out.json", args.raw / f"{other}.out.json"]
            compute = partial(compare_runs, *pair, spread)
            result = cached(args.raw, f"{ref}--{other}", pair, spread, compute)
            comparisons[key] = result | {"what": what}
            print(render(result), flush=True)
    verdicts = judge_all(comparisons)
    # Does PP=1's fused boundary path round like PP=3's split one?
    paths = {
        name: cached(args.raw, f"{name}-boundary", [out], None, partial(boundary_paths, out))
        for name in sorted(done)
        if finished[name]["spec"]["pp"] == 1
        for out in [args.raw / f"{name}.out.json"]
    }
    for name, cases in paths.items():
        for case, points in cases.items():
            for point, r in points.items():
                print(
                    f"pp3 boundary {name} {case} {point}: fused vs split identical "
                    f"{r.get('identical_frac')} first parting {r.get('first_parting_position')}",
                    flush=True,
                )
    for key, cases in verdicts.items():
        for case, v in cases.items():
            print(
                f"pp3 verdict {key} {case}: equal {v['equal']} "
                f"first over bound {v['first_layer_over_bound']}",
                flush=True,
            )
    return {
        "engines": {n: _summary(r) for n, r in finished.items()},
        "specs": {n: spec_for(engines[n], args) for n in finished},
        "comparisons": comparisons,
        "verdicts": verdicts,
        "boundary_paths": paths,
    }


def judge_all(comparisons: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each comparison's verdict per case, bounded by its reference's spread
    where one was run (spread_key)."""
    bounds = {
        name: spread_bounds(comparisons.get(name, {}).get("cases", {}))
        for name in set(SPREAD_OF.values())
    }
    moved = schedule_bounds(comparisons.get("spread-schedule", {}).get("cases", {}))
    verdicts: dict[str, dict[str, Any]] = {}
    for key, result in comparisons.items():
        spread = key.startswith("spread")
        own = None if spread else bounds[spread_key(result["ref"])]
        verdicts[key] = {
            case: judge(entry["points"], own, None if spread else moved)
            | {"ids_equal": entry["ids_equal"], "cause": entry.get("cause")}
            for case, entry in result["cases"].items()
        }
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("phase", choices=["diagnose", "equality"])
    for name in ("model", "stock-model", "tables", "kit", "out", "raw"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--echo-model", type=Path, help="the echo-drafter copy (MTP engines)")
    parser.add_argument(
        "--plan", type=Path, required=True,
        help="`flashnext plan --json` of the h200-tiny-pp3 profile: every engine's settings",
    )  # fmt: skip
    parser.add_argument(
        "--spread-from",
        type=Path,
        help="an earlier call's equality result whose spreads to use (its machine was lost)",
    )
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--parallel", type=int, default=PARALLEL, help="engines at once")
    parser.add_argument("--timeout", type=int, default=420)
    parser.add_argument("--only", nargs="*", help="engine names to run (default: all of the phase)")
    parser.add_argument("--cases", nargs="*", help="TOKENSxBATCH cases instead of each engine's")
    args = parser.parse_args()
    args.plan = json.loads(args.plan.read_text())
    args.raw.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "phase": args.phase,
        "run_id": args.run_id,
        "emulated": True,
        "devices": 1,
        "card": card_now(),  # which card ran: an H200 call may get an H100
        "cuda_launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", "0") not in ("", "0"),
        "series": _series_stamp(args.kit),
        # The comparison and its judge: the contract merges only calls of one.
        "compare_sha256": hashlib.sha256(Path(compare.__file__).read_bytes()).hexdigest(),
        "profile": args.plan.get("profile"),
        "plan_hash": args.plan.get("plan_hash"),
    }
    result |= diagnose(args) if args.phase == "diagnose" else equality(args)
    dest = args.out / f"pp3_{args.phase}-{args.run_id}.json"
    dest.write_text(json.dumps(result, indent=1))
    with tarfile.open(args.out / f"logs-{args.run_id}.tgz", "w:gz") as tar:
        for log in sorted(args.raw.glob("*.log")):
            tar.add(log, arcname=log.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
