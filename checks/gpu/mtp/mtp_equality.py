"""MTP inside vLLM 0.33.0 on a GPU (issue 16): greedy output with MTP equals it without.

    python checks/gpu/mtp/mtp_equality.py --model DIR --tables DIR --plan PLAN.json \\
        --mtp-plan PLAN-MTP1.json --mtp-plan PLAN-MTP2.json --kit /root/kit \\
        --out OUT_DIR --raw RAW_DIR --run-id N [--speculative-tokens 1 2]

Engines of the patched tree (checks/gpu/kit) on a tiny checkpoint with one
MTP layer (checks/gpu/tiny/tiny_model.py, its LM head narrowed to three tokens by
checks/gpu/mtp/narrow_head.py), each its own process (in_vllm_worker.py), with
the h200-tiny profile's settings: PLAN is its `flashnext plan --json` (MTP
off), each --mtp-plan the same with `--mtp K` (run-in-vllm writes them on the
GPU host), parsed by vLLM's own parser (checks/gpu/common/plan_settings.py).
An MTP engine runs the plan of its K; what it must differ in is overridden
by name and recorded in the result (`engines.<name>.overrides`,
`env_dropped`): the echo-drafter copy, the drafter's weights kept in VRAM
(no --cpu-offload-gb/params) but in the serving setup, vLLM's spec-decode
counters on, and the QSA offload variables dropped where K/V stay in VRAM.
`--drafters` adds copies whose MTP layer echoes the target at
a gain each (checks/gpu/mtp/echo_drafter.py): the gain sets how often the
drafter is right, so one run shows the output unchanged from a drafter that
is almost never right to one that nearly always is. Each MTP engine below
then runs once per drafter (names end in -gG), the serving setup for the
`--serving-gains` ones:

  mtp-off           no speculative decoding, QSA K/V in VRAM
  mtp-on-kK         --speculative-config {"method": "mtp", "num_speculative_tokens": K}
  mtp-off-offload   QSA K/V in host RAM (VLLM_QSA_KV_OFFLOAD, patch 0022)
  mtp-on-offload-kK the serving setup, the MTP plan as it is: QSA K/V in host
                    RAM, MTP, and the drafter's routed experts and embedding in
                    pinned host memory (the plan's --cpu-offload-gb /
                    --cpu-offload-params, flashnext.plan.mtp; patch 0031)

Each mtp-on engine is compared with the mtp-off engine of the same K/V
placement. Prompts of 100 and 3,000 random ids at batch 1 and 4, greedy,
NEW_TOKENS new tokens each (EOS ignored). A case is equal when every
request's generated ids are the same token for token. Where a request's ids
part, the row gives the position, mtp-off's margin between its two best
logprobs there, and whether the parting is a near tie by vLLM's own rule
(tests/models/utils.py check_logprobs_close: each engine's token is in the
other's top-k; the sequences then diverge and are not compared further):
the verify pass scores k + 1 tokens at once, and its bf16 logits may break
a near tie the other way; a wrong token breaks the rule. Acceptance is
vLLM's own count, accepted / drafted tokens. Then mtp-off and each
mtp-on-kK are timed alone at batch 1 (3,000-token prompt, 128 decoded
tokens) and the decode ratio printed.

Exit 0 when every case of every MTP engine is equal or parts only at near
ties, the serving-setup engines really held the drafter's weights in host
memory (patch 0031's log line), and for at least one drafter every engine's
acceptance is between 0.2 and 0.9 (both the accepted path and the
rejections with their state rollback really ran). The timed engines use
that drafter. This is our
pinned vLLM on the host's torch, not the pinned torch 2.14: the JSON says
which.
"""

from __future__ import annotations

import json
import re
import sys
from argparse import Namespace
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "ab"))
sys.path.insert(0, str(HERE.parent / "common"))

import in_vllm_ab  # noqa: E402
import logprob_compare  # noqa: E402
from in_vllm_ab import Run  # noqa: E402
from plan_settings import flag_value  # noqa: E402

PROMPT_LENGTHS = (100, 3000)
NEW_TOKENS = 64  # enough steps for the acceptance count to mean something
# K by default; run-in-vllm writes a plan for each (its default list is this one).
SPECULATIVE_TOKENS = (1, 2)
ACCEPTANCE_BAND = (0.2, 0.9)
# echo_drafter.RECORD (that module needs numpy; this one runs on the host's python).
ECHO_RECORD = "echo_drafter.json"
# Patch 0031's line once the drafter's weights are loaded (the engine core may
# run in another process, so its log is the witness).
HOST_WEIGHTS = re.compile(
    r"MTP drafter: (\d+) weights in pinned host memory \((\d+) bytes\), (\d+) returned"
)


def host_weights(log: str) -> dict[str, int] | None:
    """What patch 0031 logged about the drafter's host-resident weights (last line)."""
    found = HOST_WEIGHTS.findall(log)
    if not found:
        return None
    params, nbytes, returned = (int(n) for n in found[-1])
    return {"params": params, "bytes": nbytes, "returned_from_device": returned}


@dataclass(frozen=True)
class Arm:
    name: str
    speculative_tokens: int  # 0: no MTP
    offload: bool  # QSA K/V in host RAM; with MTP also the drafter's experts + embedding
    timed: bool = False
    gain: float | None = None  # the echo drafter's gain (echo_drafter.py); None: --model as is

    def run(self) -> Run:
        return Run(self.name, "patched", "mtp", "full_decode_only", "packed",
                   offload=self.offload, timed=self.timed)  # fmt: skip


@dataclass(frozen=True)
class Pair:
    off: str
    on: str
    gain: float | None = None


def on_name(k: int, offload: bool, gain: float | None) -> str:
    base = f"mtp-on-offload-k{k}" if offload else f"mtp-on-k{k}"
    return base if gain is None else f"{base}-g{gain:g}"


def compared_arms(
    ks: list[int],
    gains: Sequence[float | None] = (None,),
    serving_gains: Sequence[float | None] | None = None,
) -> list[Arm]:
    """mtp-off and mtp-off-offload; per drafter gain, MTP at every K; the
    serving setup (K/V and drafter weights in host RAM) at the largest K for
    `serving_gains` (default: every gain)."""
    top = max(ks)
    arms = [Arm("mtp-off", 0, False), Arm("mtp-off-offload", 0, True)]
    for g in gains:
        arms += [Arm(on_name(k, False, g), k, False, gain=g) for k in ks]
    for g in gains if serving_gains is None else serving_gains:
        arms.append(Arm(on_name(top, True, g), top, True, gain=g))
    return arms


def timed_arms(ks: list[int], gain: float | None = None) -> list[Arm]:
    """Timed alone at batch 1: mtp-off, and MTP at every K with one drafter."""
    return [Arm("timing-mtp-off", 0, False, timed=True)] + [
        Arm(f"timing-mtp-on-k{k}", k, False, timed=True, gain=gain) for k in ks
    ]


def pairs(arms: list[Arm]) -> list[Pair]:
    """Each MTP engine against the mtp-off engine of its K/V placement."""
    return [
        Pair("mtp-off-offload" if a.offload else "mtp-off", a.name, a.gain)
        for a in arms
        if a.speculative_tokens and not a.timed
    ]


def drafter_models(dirs: list[Path]) -> dict[float, Path]:
    """Echo-drafter copies by gain, from each copy's record (echo_drafter.py)."""
    found = {}
    for d in dirs:
        record = json.loads((Path(d) / ECHO_RECORD).read_text())
        found[float(record["gain"])] = Path(d)
    return found


def plan_tokens(plan: dict[str, Any]) -> int:
    """K of a plan: its --speculative-config's draft tokens (0: MTP off)."""
    spec = flag_value(list(plan["argv"]), "--speculative-config")
    return 0 if spec is None else int(json.loads(spec)["num_speculative_tokens"])


def mtp_plans(paths: list[Path]) -> dict[int, dict[str, Any]]:
    """The MTP plans (`flashnext plan --json --mtp K`) by K."""
    plans = [in_vllm_ab.read_plan(p) for p in paths]
    return {plan_tokens(plan): plan for plan in plans}


def engine_spec(arm: Arm, args, cases, timed_prompt) -> dict[str, Any]:
    """The worker's spec: the plan of the arm's K, with what the arm differs in."""
    model = args.model if arm.gain is None else args.drafter_models[arm.gain]
    plan = args.mtp_plans[arm.speculative_tokens] if arm.speculative_tokens else args.plan
    spec = in_vllm_ab.worker_spec(arm.run(), Namespace(**{**vars(args), "model": model}),
                                  cases, [timed_prompt], plan)  # fmt: skip
    spec["timed_batches"] = [[timed_prompt]] if arm.timed else []
    spec["max_new_tokens"] = NEW_TOKENS
    spec["prompt_logprobs"] = False  # only the generated tokens are compared
    spec["ignore_eos"] = True  # the narrowed head's tie token may be the EOS id
    if arm.speculative_tokens:
        spec["overrides"]["disable_log_stats"] = False  # vLLM's spec-decode counters
        if not arm.offload:  # only the serving setup keeps the drafter's weights in host RAM
            spec["overrides"] |= {"cpu_offload_gb": None, "cpu_offload_params": None}
    return spec


def top_two_margin(step: dict[str, float]) -> float | None:
    """Best minus second-best logprob of one generated position's top-k."""
    best = sorted(step.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else None


def parting(i: int, a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """Where request i's generated ids first differ (None: identical), mtp-off's
    top-2 margin there, and whether vLLM's own rule calls it a near tie."""
    ids_a, ids_b = a["output_ids"], b["output_ids"]
    if ids_a == ids_b:
        return None
    at = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
    if at is None:  # one is a prefix of the other
        at = min(len(ids_a), len(ids_b))
        return {"request": i, "position": at, "margin": None, "near_tie": False,
                "why": f"request {i}: {len(ids_a)} vs {len(ids_b)} tokens"}  # fmt: skip
    steps = a.get("output_logprobs") or []
    return {
        "request": i,
        "position": at,
        "margin": top_two_margin(steps[at]) if at < len(steps) else None,
        "near_tie": not logprob_compare.output_violation(a, b),
        "why": f"request {i}, generated token {at}: {ids_a[at]} without MTP, {ids_b[at]} with",
    }


def compare_case(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> dict[str, Any]:
    """Equal when every request's generated ids are. Close when every request
    that parts does so at a near tie by vLLM's rule (check_logprobs_close: each
    engine's token is in the other's top-k there); the verify pass scores k + 1
    tokens at once, so its bf16 logits may break a tie the other way."""
    partings = [p for i, (a, b) in enumerate(zip(off, on, strict=True)) if (p := parting(i, a, b))]
    by_request = {p["request"]: p for p in partings}
    identical = sum(
        by_request[i]["position"] if i in by_request else len(a["output_ids"])
        for i, a in enumerate(off)
    )
    row = {
        "equal": not partings,
        "close": all(p["near_tie"] for p in partings),
        "tokens_identical": identical,
        "tokens": sum(len(a["output_ids"]) for a in off),
        "partings": partings,
    }
    if partings:  # the first, for the table
        first = partings[0]
        row |= {k: first[k] for k in ("request", "position", "margin", "why")}
    return row


def acceptance(record: dict[str, Any]) -> float | None:
    counts = record.get("spec_decode") or {}
    drafted = counts.get("draft_tokens", 0)
    return counts.get("accepted_tokens", 0) / drafted if drafted else None


def case_rows(off: dict[str, Any], on: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for case in sorted(off.get("cases", {}), key=lambda c: tuple(map(int, c.split("x")))):
        length, batch = (int(n) for n in case.split("x"))
        row = {"prompt_tokens": length, "batch": batch}
        if case not in on.get("cases", {}):
            rows.append(row | {"equal": False, "close": False, "why": "mtp-on has no result"})
            continue
        rows.append(row | compare_case(off["cases"][case], on["cases"][case]))
    return rows


def pair_verdict(pair: Pair, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    on = records.get(pair.on, {})
    rate = acceptance(on)
    low, high = ACCEPTANCE_BAND
    doc = {
        "off": pair.off,
        "on": pair.on,
        "gain": pair.gain,
        "cases": case_rows(records.get(pair.off, {}), on),
        "spec_decode": on.get("spec_decode"),
        "acceptance": rate,
        "acceptance_in_band": rate is not None and low <= rate <= high,
        "vram_allocated_bytes": {
            "off": records.get(pair.off, {}).get("vram_allocated_bytes"),
            "on": on.get("vram_allocated_bytes"),
        },
    }
    doc["close"] = bool(doc["cases"]) and all(r["close"] for r in doc["cases"])
    if "offload" in pair.on:  # the drafter's weights must really have left VRAM
        held = on.get("host_weights") or {}
        doc["host_weights"] = held
        doc["drafter_in_host_memory"] = held.get("bytes", 0) > 0
    doc["ok"] = (
        doc["close"] and doc["acceptance_in_band"] and doc.get("drafter_in_host_memory", True)
    )
    return doc


def gain_rows(verdicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per drafter: its engines' acceptance, and whether every one of them is
    in the band with output equal (or parting at near ties only)."""
    rows: dict[Any, dict[str, Any]] = {}
    for v in verdicts:
        row = rows.setdefault(v["gain"], {"gain": v["gain"], "acceptance": {}, "ok": True})
        row["acceptance"][v["on"]] = v["acceptance"]
        row["ok"] = row["ok"] and v["ok"]
    return list(rows.values())


def proving_gain(rows: list[dict[str, Any]]) -> float | None:
    """The drafter the timed engines use: of those whose every engine passed,
    the one with the highest mean acceptance; else the largest gain."""

    def mean_rate(row):
        rates = [r for r in row["acceptance"].values() if r is not None]
        return sum(rates) / len(rates) if rates else 0.0

    passed = [r for r in rows if r["ok"]]
    if passed:
        return max(passed, key=mean_rate)["gain"]
    gains = [r["gain"] for r in rows if r["gain"] is not None]
    return max(gains) if gains else None


def decode_ratios(records: dict[str, dict[str, Any]], ks: list[int]) -> dict[str, Any]:
    def tok_s(name: str) -> float | None:
        return ((records.get(name, {}).get("timing") or [{}])[0]).get("decode_tok_s")

    off = tok_s("timing-mtp-off")
    doc: dict[str, Any] = {"off_tok_s": off}
    for k in ks:
        on = tok_s(f"timing-mtp-on-k{k}")
        doc[f"k{k}"] = {"on_tok_s": on, "on_over_off": on / off if on and off else None}
    return doc


def verdict(
    records: dict[str, dict[str, Any]], ks: list[int], arms: list[Arm] | None = None
) -> dict[str, Any]:
    """ok: every MTP engine's output equals mtp-off's (or parts at near ties
    only), at every gain; the serving setup's drafter weights were in host
    memory; and at least one drafter had every engine's acceptance in the band."""
    errors = {name: r["error"] for name, r in records.items() if "error" in r}
    verdicts = [pair_verdict(pair, records) for pair in pairs(arms or compared_arms(ks))]
    rows = gain_rows(verdicts)
    return {
        "pairs": verdicts,
        "gains": rows,
        "decode": decode_ratios(records, ks),
        "errors": errors,
        "ok": bool(verdicts)
        and all(v["close"] and v.get("drafter_in_host_memory", True) for v in verdicts)
        and any(r["ok"] for r in rows)
        and not errors,
    }


def markdown(result: dict[str, Any]) -> str:
    v = result["verdict"]
    host = result["host"]
    lines = [
        f"### MTP greedy equality, run {result['run_id']} ({host['gpu']}, torch {host['torch']}: "
        f"{host['note']})",
    ]
    if any(row["gain"] is not None for row in v["gains"]):
        lines += [
            "",
            "| echo drafter gain | acceptance per engine | every engine equal (or near ties) "
            "and in the band |",
            "|---|---|---|",
        ]
        for row in v["gains"]:
            rates = ", ".join(f"{name} {'-' if r is None else f'{r:.3f}'}"
                              for name, r in row["acceptance"].items())  # fmt: skip
            lines.append(f"| {row['gain']:g} | {rates} | {row['ok']} |")
    for p in v["pairs"]:
        rate = "-" if p["acceptance"] is None else f"{p['acceptance']:.3f}"
        lines += [
            "",
            f"#### {p['on']} vs {p['off']}",
            "",
            "| prompt tokens | batch | identical tokens | equal | partings all near ties "
            "| first parting | mtp-off's top-2 margin there |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in p["cases"]:
            margin = "-" if r.get("margin") is None else f"{r['margin']:.3f}"
            same = f"{r['tokens_identical']} of {r['tokens']}" if "tokens" in r else "-"
            lines.append(f"| {r['prompt_tokens']} | {r['batch']} | {same} | {r['equal']} | "
                         f"{r['close']} | {r.get('why', '')} | {margin} |")  # fmt: skip
        lines += [
            "",
            f"acceptance (accepted / drafted tokens): {rate}, band {ACCEPTANCE_BAND}: "
            f"{p['acceptance_in_band']}; counts {p['spec_decode']}",
        ]
        if "host_weights" in p:
            held = p["host_weights"]
            lines.append(f"drafter weights in pinned host memory (UVA): {held.get('params', 0)} "
                         f"tensors, {held.get('bytes', 0)} bytes, "
                         f"{held.get('returned_from_device', 0)} returned from the device "
                         "after loading (patch 0031's log)")  # fmt: skip
    d = v["decode"]
    gain = result.get("timed_gain")
    lines += [
        "",
        f"decode tok/s at batch 1 without MTP: {d['off_tok_s']}"
        + ("" if gain is None else f" (MTP engines timed with the gain-{gain:g} drafter)"),
    ]
    for key, row in d.items():
        if key.startswith("k"):
            ratio = row["on_over_off"]
            lines.append(f"with MTP {key}: {row['on_tok_s']}, on/off "
                         f"{'-' if ratio is None else f'{ratio:.2f}'}")  # fmt: skip
    lines += [f"errors: {v['errors'] or 'none'}", f"ok: {v['ok']}"]
    return "\n".join(lines) + "\n"


def launch_or_reuse(arm: Arm, spec: dict[str, Any], args) -> dict[str, Any]:
    """With --reuse, an engine that already finished in this raw dir is read
    back instead of run again: a run cut by the device's per-call limit goes on
    where it stopped."""
    done = args.raw / f"{arm.name}.out.json"
    if args.reuse and done.exists():
        return json.loads(done.read_text()) | {"reused": True}
    return in_vllm_ab.launch(arm.run(), spec, args)


def main() -> int:
    parser = in_vllm_ab.engine_run_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--speculative-tokens", type=int, nargs="+", default=list(SPECULATIVE_TOKENS)
    )
    parser.add_argument(
        "--drafters",
        type=Path,
        nargs="*",
        default=[],
        help="echo-drafter copies of --model (echo_drafter.py), one per gain",
    )
    parser.add_argument(
        "--serving-gains",
        type=float,
        nargs="*",
        default=None,
        help="the drafters run in the serving setup too (default: all)",
    )
    parser.add_argument(
        "--mtp-plan", type=Path, action="append", default=[],
        help="the plan with `--mtp K`, one per --speculative-tokens K",
    )  # fmt: skip
    parser.add_argument("--reuse", action="store_true", help="read back finished engines")
    args = parser.parse_args()
    ks = sorted(set(args.speculative_tokens))
    args.plan = in_vllm_ab.read_plan(args.plan)
    args.mtp_plans = mtp_plans(args.mtp_plan)
    if plan_tokens(args.plan) or set(ks) - set(args.mtp_plans):
        parser.error(f"--plan without MTP and an --mtp-plan for each K of {ks} (run-in-vllm)")
    args.drafter_models = drafter_models(args.drafters)
    gains = sorted(args.drafter_models) or [None]
    unknown = set(args.serving_gains or ()) - set(args.drafter_models)
    if unknown:
        parser.error(f"--serving-gains {sorted(unknown)}: no drafter with that gain in --drafters")
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw.mkdir(parents=True, exist_ok=True)

    all_cases = in_vllm_ab.make_prompts(args.model)
    cases = {k: v for k, v in all_cases.items() if int(k.split("x")[0]) in PROMPT_LENGTHS}
    timed_prompt = in_vllm_ab.make_prompts(args.model, seed=1)[
        f"{in_vllm_ab.TIMED_PROMPT_TOKENS}x1"
    ][0]
    compared = compared_arms(ks, gains, args.serving_gains)
    specs = {arm.name: engine_spec(arm, args, cases, timed_prompt) for arm in compared}
    with ThreadPoolExecutor(max_workers=len(compared)) as pool:
        futures = {
            arm.name: pool.submit(launch_or_reuse, arm, specs[arm.name], args) for arm in compared
        }
        records = {name: f.result() for name, f in futures.items()}
    for name, record in records.items():
        log = args.raw / f"{name}.log"
        if log.exists():
            record["host_weights"] = host_weights(log.read_text(errors="replace"))
    # The timed engines use the drafter that passed with the highest acceptance.
    timed_gain = proving_gain(gain_rows([pair_verdict(p, records) for p in pairs(compared)]))
    for arm in timed_arms(ks, timed_gain):  # one at a time, alone on the GPU
        specs[arm.name] = engine_spec(arm, args, cases, timed_prompt)
        records[arm.name] = launch_or_reuse(arm, specs[arm.name], args)
    result = {
        "schema_version": 4,
        "run_id": args.run_id,
        "host": in_vllm_ab.host_facts(args.kit),
        # Every engine's settings: its K's plan, but for its overrides (engines).
        "plans": {
            f"k{k}": in_vllm_ab.plan_record(plan)
            for k, plan in {0: args.plan, **args.mtp_plans}.items()
        },
        "engines": {name: in_vllm_ab.engine_record(records[name], specs[name]) for name in records},
        "speculative_tokens": ks,
        "new_tokens": NEW_TOKENS,
        "drafters": {f"{g:g}": str(d) for g, d in args.drafter_models.items()},
        "timed_gain": timed_gain,
        "verdict": verdict(records, ks, compared),
    }
    stem = f"mtp_equality-{args.run_id}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
