"""Issue 27's results contract, `pp3_perf-RUN.json`, from the harness's raw files.

    python3 checks/gpu/perf/pp3_perf.py contract RUN --inputs FILE --raw DIR [--out-dir DIR]

Reads FILE (pp3_perf.py prepare's inputs.json: plans, per-rank bytes, config;
`run` copies it to $OUT/pp3_perf_inputs.json),
RAW/pp3_perf_raw-RUN-*.json (one per engine), the measured bandwidth
(results/hbm_bandwidth-h200-b1.json) and, when given, the same run's
shared_gpu_calibration.json. A field nothing measured is null and its path
is listed under `missing`; no figure is made up. Computed fields (HBM and
PCIe bytes, the projection) say so in `sources`.

Three ranks share one GPU here (`timeshare.py`). `gpu_busy_ms` is each
rank's kernel time as the profiler saw it; `time_sharing` says how much of
it another rank's kernel was in flight beside, and the projection takes the
GPU time the calibration says recovers a rank's time alone: `fair` or
`busy`; uncalibrated (or neither held), `busy`, an upper bound, and the
basis says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bytes_per_token import header_terms, reconcile
from perf_cases import CUT
from projection import (
    Links,
    MeasuredStep,
    RankBytes,
    hbm_bytes_per_step,
    mtp_c1_tok_s,
    pcie_bytes_per_step,
    project_3090,
    roofline_fraction,
)
from seed_config import seed_config

# The launcher's speculative-step arithmetic (pure), so the measured figures
# and the plan's paper projection count a round's tokens alike.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "launcher" / "src"))
from flashnext.plan.mtp_projection import tokens_per_step  # noqa: E402

NOTE = (
    "our pinned vLLM 0.33.0 on the host's torch 2.11.0+cu130 (not the pinned torch 2.14), "
    "dummy weights (the full-size skeleton, --load-format dummy), one H200 running the "
    "three PP ranks (emulated)"
)
RUN_KEYS = ("mode", "mtp_k", "concurrency", "decode_tok_s", "ttft_s", "prompt_tokens")
RANK_KEYS = (
    "rank", "batch", "step_ms", "gpu_busy_ms", "hbm_bytes_per_step", "roofline_fraction",
    "cpu_ms", "ple_gather_us", "pcie_bytes_per_step", "start_peak_bytes",
    "serving_peak_bytes", "planned_bytes",
)  # fmt: skip
PROJECTION_KEYS = ("c1_tok_s", "c4_tok_s", "mtp1_c1_tok_s", "basis", "seed_config")
SEED_KEYS = ("c1_tok_s", "c4_tok_s", "within_15pct")
CUT_KEYS = ("what", "before", "after")
MTP_KEYS = (
    "mtp_k", "mode", "draft_ms", "h200_round_ms", "tokens_per_round", "h200_tok_s",
    "projected_3090_c1_tok_s", "measured_decode_tok_s",
)  # fmt: skip
MTP_KS = (1, 2, 3)


def rank_bytes_of(inputs: dict[str, Any], rank: int) -> RankBytes:
    b = inputs["rank_bytes"][rank]
    return RankBytes(b["dense_bytes"], b["routed_expert_bytes"], b["moe_layers"],
                     b["embedding_row_bytes"], b["gdn_layers"], b["qsa_layers"])  # fmt: skip


def runs_of(raws: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    runs = []
    for raw in raws.values():
        spec = raw["spec"]
        for case in raw.get("cases", []):
            runs.append({
                "mode": spec["mode"],
                "mtp_k": spec["mtp_k"],
                "concurrency": case["concurrency"],
                "decode_tok_s": case.get("decode_tok_s"),
                "ttft_s": case.get("ttft_s"),
                "prompt_tokens": case["prompt_tokens"],
            })  # fmt: skip
    return runs


def window_complete(case: dict[str, Any]) -> bool:
    """A case whose timed decode window finished: ok, or failed after it (in the
    profile window: `profile_failed`, or a raw of p1, written before `stage` was
    recorded, with the window's `ranks` and `decode_tok_s` set). Its window's
    figures stand; what the profile would have given stays null."""
    if case.get("ok"):
        return True
    if case.get("stage") not in (None, "profile window"):
        return False
    return bool(case.get("ranks")) and case.get("decode_tok_s") is not None


def _decode_case(raw: dict[str, Any] | None, concurrency: int) -> dict[str, Any] | None:
    for case in (raw or {}).get("cases", []):
        wanted = case["kind"] == "decode" and case["concurrency"] == concurrency
        if wanted and window_complete(case):
            return case
    return None


def failed_cases(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """An engine's failed cases: where each died and whether its decode window is used."""
    keys = ("kind", "concurrency", "prompt_tokens", "stage", "error")
    return [
        {k: c.get(k) for k in keys} | {"window_kept": c["kind"] == "decode" and window_complete(c)}
        for c in raw.get("cases", [])
        if c.get("ok") is False
    ]


def _peak(memory: list[dict[str, Any]] | None, rank: int, phase: str) -> int | None:
    """NVML's per-process peak of the phase (None when pids were not visible)."""
    if not memory or rank >= len(memory):
        return None
    entry = memory[rank]
    if not entry.get("pid_visible"):
        return None
    return entry.get("peaks", {}).get(phase, {}).get("nvml")


def start_memory(raw: dict[str, Any] | None, plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 27 item 5, per rank: the plan's predicted start peak (its largest
    phase, `start_peak`, with the terms it adds) beside what the rank's process
    held before serving: NVML (context and all: an upper bound, on a card with
    room the allocator keeps more), torch's reserved and allocated peaks (the
    tensors' own need; allocated from p2 on). `nvml_over_predicted_bytes` > 0:
    the plan predicted less than the process took.

    Which side of torch's allocator the difference is on: NVML less reserved
    (`outside_allocator_bytes`: the CUDA context and what is allocated past
    torch) against the plan's `cuda_context` term, and reserved against the
    plan's other terms (`reserved_over_predicted_bytes`)."""
    out = []
    for rank, planned in enumerate(plan["ranks"]):
        predicted = planned["start_peak"]["predicted_bytes"]
        terms = {t["name"]: t["bytes"] for t in planned["start_peak"]["terms"]}
        entry = ((raw or {}).get("memory_start") or [])[rank : rank + 1]
        seen = entry[0]["peaks"].get("start", {}) if entry and entry[0].get("pid_visible") else {}
        nvml, reserved = seen.get("nvml"), seen.get("reserved")
        in_allocator = predicted - terms.get("cuda_context", 0)
        both = nvml is not None and reserved is not None
        out.append({
            "rank": rank,
            "predicted_bytes": predicted,
            "predicted_phase": planned["start_peak"]["phase"],
            "predicted_terms": terms,
            "nvml_bytes": nvml,
            "reserved_bytes": reserved,
            "allocated_bytes": seen.get("allocated"),
            "nvml_over_predicted_bytes": None if nvml is None else nvml - predicted,
            "outside_allocator_bytes": nvml - reserved if both else None,
            "reserved_over_predicted_bytes": None if reserved is None else reserved - in_allocator,
        })  # fmt: skip
    return out


def gpu_time_model(calibration: dict[str, Any] | None) -> str:
    """The reading of a shared rank's kernel time the calibration upheld (`fair`
    or `busy`); `busy` without one: the profiler's figure, an upper bound."""
    model = ((calibration or {}).get("verdict") or {}).get("model")
    return model if model in ("fair", "busy") else "busy"


def rank_rows(
    raw: dict[str, Any] | None,
    inputs: dict[str, Any],
    read_bps: float,
    kv_in_vram: bool = False,
    gpu_model: str = "busy",
) -> tuple[list[dict[str, Any]], list[list[MeasuredStep] | None], list[dict[str, Any]]]:
    """One row per rank and batch (1 and 4) of an engine; the projection's
    inputs; per rank and batch, how its kernels shared the GPU."""
    plan = inputs["plans"]["0"]
    config = inputs["config"]
    rows_out, steps, sharing_out = [], {1: [], 4: []}, []
    for batch in (1, 4):
        case = _decode_case(raw, batch)
        for rank in range(len(plan["ranks"])):
            w = case["ranks"][rank] if case else {}
            prof = case["profile"][rank] if case and case.get("profile") else {}
            decode_rows = w.get("decode_rows") or []
            rows = max(decode_rows) if decode_rows else None
            context = case["prompt_tokens"] + case["new_tokens"] // 2 if case else None
            rb = rank_bytes_of(inputs, rank)
            hbm = (
                hbm_bytes_per_step(rb, config, rows=rows, context=context, kv_in_vram=kv_in_vram)
                if rows else None
            )  # fmt: skip
            pcie = (
                pcie_bytes_per_step(rb, config, rows=rows, context=context, kv_in_vram=kv_in_vram)
                if rows else None
            )  # fmt: skip
            # Kernels less NCCL's (which wait for the peer on the GPU); records
            # before the split (p1) summed annotations too and give none.
            busy = prof.get("compute_ms_per_step")
            shared = prof.get("time_sharing") or {}
            gpu_ms = shared.get("fair_ms_per_step") if gpu_model == "fair" else busy
            if case:
                sharing_out.append({"rank": rank, "batch": batch} | shared)
            # The host's share of the critical path: from its last wait for the
            # step's input to its graph launch. execute_model's whole wall time
            # (p1: 30.8 ms of a 28.7 ms decode step) is mostly those waits.
            cpu = w.get("host_critical_ms")
            # The host gather proper (HostRowGather._select). The whole gather() call,
            # which first waits for the step's ids from the GPU (on rank 0 at c=1 the
            # pipeline's previous step), is `ple_gather` in the raw file, not here.
            ple = (w.get("ple_select") or {}).get("wall_us_per_step")
            if case and ple is None and rank not in plan["ple_ranks"]:
                ple = 0.0
            row = {
                "rank": rank,
                "batch": batch,
                "step_ms": w.get("decode_period_ms"),
                "gpu_busy_ms": busy,
                "hbm_bytes_per_step": hbm["total"] if hbm else None,
                "roofline_fraction": (
                    roofline_fraction(hbm["total"], gpu_ms, read_bps) if hbm else None
                ),
                "cpu_ms": cpu,
                "ple_gather_us": ple,
                "pcie_bytes_per_step": pcie,
                "start_peak_bytes": _peak((raw or {}).get("memory_start"), rank, "start"),
                "serving_peak_bytes": _peak((raw or {}).get("memory_serving"), rank, "serving"),
                "planned_bytes": plan["ranks"][rank]["committed_bytes"],
            }
            rows_out.append(row)
            if None not in (gpu_ms, cpu, pcie, hbm):
                steps[batch].append(MeasuredStep(gpu_ms, cpu, pcie, hbm["total"]))
    n = len(plan["ranks"])
    return rows_out, [s if len(s) == n else None for s in (steps[1], steps[4])], sharing_out


def scheduler_costs(raw: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Per decode batch, the engine core's scheduler calls in its window
    (perf_engine.SchedulerClock): reported, not on a token's critical path."""
    out = []
    for batch in (1, 4):
        case = _decode_case(raw, batch)
        calls = (case or {}).get("scheduler")
        if calls:
            out.append({"batch": batch} | {f"{name}_us_median": c["us_median"]
                                           for name, c in calls.items()})  # fmt: skip
    return out


def _draft_ms(raw: dict[str, Any] | None) -> float | None:
    case = _decode_case(raw, 1)
    if not case:
        return None
    last = case["ranks"][-1].get("mtp_propose") or {}
    us = last.get("gpu_us_median")
    return us / 1e3 if us is not None else None


def mtp_rows(
    raws: dict[str, dict[str, Any]],
    inputs: dict[str, Any],
    links: Links,
    gpu_model: str,
    acceptance: float | None,
) -> list[dict[str, Any]]:
    """Issue 27 item 1, per K the harness ran (engines mtp1-mtp3), at c=1:
    the draft step's cost on the last rank (`propose`, CUDA events), the
    H200's measured round (the last rank's decode period: every rank's
    verify pass, the draft and the hops), the tokens a round yields at the
    profile's acceptance, and the tok/s those give, on the H200 as measured
    and on 3x3090 as projected (projection.mtp_c1_tok_s). Dummy weights
    accept what they accept: `measured_decode_tok_s` is that run's, not a
    figure at the cited rate. K above 1 ran with a KV pool beyond 3x3090
    (`mode`; pp3_perf.beyond_3090)."""
    rows = []
    for k in MTP_KS:
        raw = raws.get(f"mtp{k}")
        if raw is None:
            continue
        case = _decode_case(raw, 1)
        _, (verify, _), _ = rank_rows(raw, inputs, links.h200_read_bytes_per_s, gpu_model=gpu_model)
        draft = _draft_ms(raw)
        period = case["ranks"][-1].get("decode_period_ms") if case else None
        tokens = tokens_per_step(acceptance, k) if acceptance is not None else None
        rows.append({
            "mtp_k": k,
            "mode": raw["spec"]["mode"],
            "draft_ms": draft,
            "h200_round_ms": period,
            "tokens_per_round": tokens,
            "h200_tok_s": tokens * 1e3 / period if tokens and period else None,
            "projected_3090_c1_tok_s": mtp_c1_tok_s(verify, draft, links, tokens)
            if verify and draft is not None and tokens else None,
            "measured_decode_tok_s": case.get("decode_tok_s") if case else None,
        })  # fmt: skip
    return rows


def cut_of(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 27 item 4: decode tok/s at c=4 before and after the cut
    (perf_cases.CUT: its two engines, run in the same run)."""
    before, after, what = CUT

    def c4(name: str) -> float | None:
        case = _decode_case(raws.get(name), 4)
        return case.get("decode_tok_s") if case else None

    measured = {"before": c4(before), "after": c4(after)}
    return {"what": what if any(v is not None for v in measured.values()) else None} | measured


def build(
    run_id: str,
    inputs: dict[str, Any],
    raws: dict[str, dict[str, Any]],
    bandwidth: dict[str, Any],
    calibration: dict[str, Any] | None = None,
) -> dict[str, Any]:
    read_bps = bandwidth["results"]["read"]["bytes_per_s"]
    links = Links(read_bps, bandwidth["results"]["h2d_pinned"]["bytes_per_s"])
    model = gpu_time_model(calibration)
    ranks, (c1, c4), sharing = rank_rows(raws.get("offload"), inputs, read_bps, gpu_model=model)
    _, (mtp1, _c4), _ = rank_rows(raws.get("mtp1"), inputs, read_bps, gpu_model=model)
    acceptance = (
        (inputs["plans"].get("1") or {}).get("mtp", {}).get("projection", {}).get("acceptance_rate")
    )
    projection = project_3090(c1 or [], c4, mtp1, links, mtp1_draft_ms=_draft_ms(raws.get("mtp1")),
                              acceptance_rate=acceptance)  # fmt: skip
    mtp = mtp_rows(raws, inputs, links, model, acceptance)
    if not c1:
        projection["basis"] = None
    else:
        projection["basis"] = f"{gpu_time_basis(model, calibration)}; {projection['basis']}"
    measured = {c: (_decode_case(raws.get("offload"), c) or {}).get("decode_tok_s") for c in (1, 4)}
    projection["seed_config"] = seed_config(c1, c4, links, measured)
    doc = {
        "model": "full-size, dummy weights",
        "emulated": True,
        "note": NOTE,
        "run_id": run_id,
        "runs": runs_of(raws),
        "ranks": ranks,
        "projection_3090": {k: projection.get(k) for k in PROJECTION_KEYS},
        "cut": cut_of(raws),
        "mtp": mtp,
        "bytes_per_token": reconcile(inputs["plans"]["0"], inputs["config"]),
        "start_memory": start_memory(raws.get("offload"), inputs["plans"]["0"]),
        "scheduler": scheduler_costs(raws.get("offload")),
        "time_sharing": {
            "gpu_time": model,
            "calibration": (calibration or {}).get("verdict"),
            "ranks": sharing,
        },
        "sources": {
            "hbm_bytes_per_step": "computed (projection.hbm_bytes_per_step): the plan's per-rank "
            "weight bytes from the safetensors headers, uniform routing, GDN/QSA state from "
            "config.json; rows and context as the decode window ran them",
            "pcie_bytes_per_step": "computed: the QSA offload's selected K/V rows per decode row "
            "(patch 0022 reads them by UVA inside the graph, where nothing can count them)",
            "roofline_fraction": f"hbm_bytes_per_step / the GPU time time_sharing.gpu_time "
            f"names (busy: gpu_busy_ms) / {read_bps:.4g} B/s "
            "(results/hbm_bandwidth-h200-b1.json, read)",
            "step_ms": "the rank's wall time per decode step over the window's trailing run "
            "of decode steps (the prompt's prefill chunks left out; CUDA-synchronised end)",
            "gpu_busy_ms": "torch.profiler, started after the prefill: the rank's kernels' "
            "device time / profiled decode steps, NCCL's kernels (their wait for the peer) "
            "and GPU-side annotations left out; both are in the raw file. Three ranks "
            "share one GPU: time_sharing has how much of it another rank's kernel was in "
            "flight beside",
            "cpu_ms": "median per decode step of the host's time from the end of its last "
            "wait for the step's input (rank 0: the PLE gather's wait for the ids; later "
            "ranks: the PP receive, and only where the GPU had nothing left at the launch) "
            "to its graph launch",
            "ple_gather_us": "patch 0012's HostRowGather._select (the host row gather, its "
            "page faults) per decode step; the whole gather() call, which also waits for the "
            "step's ids from the GPU and copies them, is ple_gather in the raw file",
            "start_peak_bytes": "NVML, this process's used memory, peak before serving",
            "planned_bytes": "the 3x3090 plan's committed bytes per rank",
            "scheduler": "the engine core's schedule and update_from_output, median wall "
            "time a call in the decode window (the core runs in the harness's process)",
            "start_memory": "the offload engine's start peaks per process (NVML, torch "
            "reserved and allocated) beside the plan's predicted start peak (start_peak)",
            "acceptance_rate": "the profile's (profiles/3x3090.toml [mtp]), not measured",
            "seed_config": "the offload engine's steps projected by every rule "
            "(projection.RULES; `rule` is the contract's) beside the field report's measured "
            "80.0 and 152-155 tok/s (shared/SPEC.md); c4_over_c1: the H200 run's own decode "
            "tok/s and the report's, both measured",
            "bytes_per_token": "the plan's decode terms (flashnext plan --json decode.terms, "
            "from the safetensors headers) beside the field report's 5.83 GB, which counts "
            "the vision tower too (bytes_per_token.py)",
            "mtp": "per K at c=1: draft_ms the last rank's propose (CUDA events, median); "
            "h200_round_ms its decode period; tokens_per_round at the profile's acceptance "
            "(flashnext.plan.mtp_projection.tokens_per_step); h200_tok_s their ratio; "
            "projected_3090_c1_tok_s as projection_3090's basis says; measured_decode_tok_s "
            "the run's own, at what dummy weights accept",
        },
        "engines": {
            name: {
                "ok": r.get("ok"),
                "exit": r.get("exit"),
                "error": r.get("error"),
                "startup_s": r.get("startup_s"),
                "wall_s": r.get("wall_s"),
                "overrides": r.get("spec", {}).get("overrides"),
                "gate": r.get("gate"),
                "max_model_len": r.get("max_model_len"),
                "failed_cases": failed_cases(r),
            }
            for name, r in raws.items()
        },  # fmt: skip
    }
    doc["missing"] = missing_paths(doc)
    return doc


def gpu_time_basis(model: str, calibration: dict[str, Any] | None) -> str:
    verdict = (calibration or {}).get("verdict")
    if verdict is None:
        return ("GPU time: the profiler's kernel time (busy), an upper bound: no "
                "shared_gpu_calibration for this run")  # fmt: skip
    if verdict.get("model") is None:
        return ("GPU time: the profiler's kernel time (busy), an upper bound: the "
                "calibration upheld neither reading")  # fmt: skip
    return (f"GPU time: {model} (shared_gpu_calibration: within "
            f"{verdict['tolerance']:.0%} of a process's kernel time alone)")  # fmt: skip


def missing_paths(doc: dict[str, Any]) -> list[str]:
    out = []
    for i, run in enumerate(doc["runs"]):
        out += [f"runs[{i}].{k}" for k in RUN_KEYS if run.get(k) is None]
    for i, row in enumerate(doc["ranks"]):
        out += [f"ranks[{i}].{k}" for k in RANK_KEYS if row.get(k) is None]
    out += [f"projection_3090.{k}" for k in PROJECTION_KEYS if doc["projection_3090"][k] is None]
    seed = doc["projection_3090"]["seed_config"]
    out += [f"projection_3090.seed_config.{k}" for k in SEED_KEYS if seed[k] is None]
    if doc["bytes_per_token"]["terms"] is None:
        out.append("bytes_per_token.terms")
    out += [f"cut.{k}" for k in CUT_KEYS if doc["cut"][k] is None]
    ran = {row["mtp_k"]: row for row in doc["mtp"]}
    for k in MTP_KS:
        if k not in ran:
            out.append(f"mtp[K={k}]")
            continue
        out += [f"mtp[K={k}].{key}" for key in MTP_KEYS if ran[k][key] is None]
    if not doc["runs"]:
        out.append("runs")
    return out


def main(args) -> int:
    inputs = json.loads(args.inputs.read_text())
    plan = inputs["plans"]["0"]
    if args.model is not None and not plan["decode"].get("terms"):
        plan["decode"]["terms"] = header_terms(args.model, plan)
    raws = {}
    for path in sorted(args.raw.glob(f"pp3_perf_raw-{args.run_id}-*.json")):
        raws[path.stem.removeprefix(f"pp3_perf_raw-{args.run_id}-")] = json.loads(path.read_text())
    calibration_path = args.calibration or args.raw / "shared_gpu_calibration.json"
    calibration = json.loads(calibration_path.read_text()) if calibration_path.exists() else None
    bandwidth = json.loads(args.bandwidth.read_text())
    # The projection scales by the read bandwidth of the card that ran: an H200 call
    # may get an H100, whose runs need that card's own measurement.
    cards = {json.dumps(r.get("card"), sort_keys=True) for r in raws.values() if r.get("card")}
    names = sorted({json.loads(c)["name"] for c in cards} - {None})
    if names and names != [bandwidth.get("device")]:
        print(
            f"pp3_perf contract: the runs ran on {' and '.join(names)}, {args.bandwidth} was "
            f"measured on {bandwidth.get('device')}: measure the same card (python3 "
            "checks/gpu/perf/hbm_bandwidth.py --out FILE, in the same call) and pass it "
            "with --bandwidth",
            file=sys.stderr,
        )
        return 2
    doc = build(args.run_id, inputs, raws, bandwidth, calibration)
    doc["cards"] = [json.loads(c) for c in sorted(cards)]  # which card ran (each engine's)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dest = args.out_dir / f"pp3_perf-{args.run_id}.json"
    dest.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"pp3_perf contract: {dest}: {len(doc['runs'])} runs, {len(doc['missing'])} missing")
    return 0
