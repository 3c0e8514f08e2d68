"""MTP inside vLLM 0.33.0 on a GPU (issue 16): greedy output with MTP equals it without.

    python checks/gpu/mtp_equality.py --model DIR --tables DIR --kit /root/kit \\
        --out OUT_DIR --raw RAW_DIR --run-id N [--speculative-tokens 2]

Two engines of the patched tree (checks/gpu/kit) on a tiny checkpoint with one
MTP layer (checks/gpu/tiny_model.py), each its own process
(in_vllm_worker.py), with the 3x3090 profile's scheduler, FULL_DECODE_ONLY
graphs, PLE from the packed table and QSA K/V in VRAM:

  mtp-off  no speculative decoding
  mtp-on   --speculative-config {"method": "mtp", "num_speculative_tokens": K}

Prompts of 100 and 3,000 random ids at batch 1 and 4, greedy, NEW_TOKENS new
tokens each. A case is equal when every request's generated ids are the same
token for token. Where they part, the row gives the position and mtp-off's
margin between its two best logprobs there: a margin near zero is a
numerical near-tie (the verify pass scores k + 1 tokens at once), a wide one
a wrong token. Acceptance is vLLM's own count, accepted / drafted tokens.
The two engines are then timed alone at batch 1 (3,000-token prompt, 128
decoded tokens) and the decode ratio printed.

Exit 0 when every case is equal and the acceptance is between 0.2 and 0.9:
a drafter that is right only part of the time, so that both the accepted
path and the rejections with their state rollback really run (a random
drafter is rejected nearly always; train it first, e.g. on the target's
own greedy outputs). This is our pinned vLLM on the host's torch, not the
pinned torch 2.14: the JSON says which.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import in_vllm_ab  # noqa: E402
from in_vllm_ab import Run  # noqa: E402

PROMPT_LENGTHS = (100, 3000)
NEW_TOKENS = 64  # enough steps for the acceptance count to mean something
ACCEPTANCE_BAND = (0.2, 0.9)


def runs() -> list[Run]:
    compared = [Run(f"mtp-{arm}", "patched", "mtp", "full_decode_only", "packed")
                for arm in ("off", "on")]  # fmt: skip
    timed = [Run(f"timing-mtp-{arm}", "patched", "mtp", "full_decode_only", "packed",
                 timed=True) for arm in ("off", "on")]  # fmt: skip
    return compared + timed


def engine_spec(run: Run, args, cases, timed_prompt) -> dict[str, Any]:
    spec = in_vllm_ab.worker_spec(run, args, cases, [timed_prompt])
    spec["timed_batches"] = [[timed_prompt]] if run.timed else []
    spec["max_new_tokens"] = NEW_TOKENS
    spec["prompt_logprobs"] = False  # only the generated tokens are compared
    if run.name.endswith("-on"):
        spec["speculative_config"] = {
            "method": "mtp",
            "num_speculative_tokens": args.speculative_tokens,
        }
    return spec


def top_two_margin(step: dict[str, float]) -> float | None:
    """Best minus second-best logprob of one generated position's top-k."""
    best = sorted(step.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else None


def compare_case(off: list[dict[str, Any]], on: list[dict[str, Any]]) -> dict[str, Any]:
    """Equal when every request's generated ids are; else the first parting."""
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        ids_a, ids_b = a["output_ids"], b["output_ids"]
        if ids_a == ids_b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y), None)
        if at is None:  # one is a prefix of the other
            at = min(len(ids_a), len(ids_b))
            return {"equal": False, "request": i, "position": at, "margin": None,
                    "why": f"request {i}: {len(ids_a)} vs {len(ids_b)} tokens"}  # fmt: skip
        steps = a.get("output_logprobs") or []
        margin = top_two_margin(steps[at]) if at < len(steps) else None
        why = f"request {i}, generated token {at}: {ids_a[at]} without MTP, {ids_b[at]} with"
        return {"equal": False, "request": i, "position": at, "margin": margin, "why": why}
    return {"equal": True}


def acceptance(record: dict[str, Any]) -> float | None:
    counts = record.get("spec_decode") or {}
    drafted = counts.get("draft_tokens", 0)
    return counts.get("accepted_tokens", 0) / drafted if drafted else None


def verdict(records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    off, on = records.get("mtp-off", {}), records.get("mtp-on", {})
    errors = {name: r["error"] for name, r in records.items() if "error" in r}
    rows = []
    for case in sorted(off.get("cases", {}), key=lambda c: tuple(map(int, c.split("x")))):
        length, batch = (int(n) for n in case.split("x"))
        row = {"prompt_tokens": length, "batch": batch}
        if case not in on.get("cases", {}):
            rows.append(row | {"equal": False, "why": "mtp-on has no result"})
            continue
        rows.append(row | compare_case(off["cases"][case], on["cases"][case]))
    rate = acceptance(on)
    timed_off = records.get("timing-mtp-off", {}).get("timing") or [{}]
    timed_on = records.get("timing-mtp-on", {}).get("timing") or [{}]
    off_tok_s, on_tok_s = timed_off[0].get("decode_tok_s"), timed_on[0].get("decode_tok_s")
    low, high = ACCEPTANCE_BAND
    return {
        "cases": rows,
        "spec_decode": on.get("spec_decode"),
        "acceptance": rate,
        "acceptance_in_band": rate is not None and low <= rate <= high,
        "decode_tok_s": {"off": off_tok_s, "on": on_tok_s},
        "decode_ratio_on_over_off": on_tok_s / off_tok_s if off_tok_s and on_tok_s else None,
        "errors": errors,
        "ok": bool(rows)
        and all(r["equal"] for r in rows)
        and not errors
        and rate is not None
        and low <= rate <= high,
    }


def markdown(result: dict[str, Any]) -> str:
    v = result["verdict"]
    host = result["host"]
    lines = [
        f"### MTP greedy equality, run {result['run_id']} ({host['gpu']}, torch {host['torch']}: "
        f"{host['note']}), num_speculative_tokens {result['speculative_tokens']}",
        "",
        "| prompt tokens | batch | equal | where they part | mtp-off's top-2 margin there |",
        "|---|---|---|---|---|",
    ]
    for r in v["cases"]:
        margin = "-" if r.get("margin") is None else f"{r['margin']:.3f}"
        lines.append(f"| {r['prompt_tokens']} | {r['batch']} | {r['equal']} | "
                     f"{r.get('why', '')} | {margin} |")  # fmt: skip
    rate = "-" if v["acceptance"] is None else f"{v['acceptance']:.3f}"
    ratio = v["decode_ratio_on_over_off"]
    lines += [
        "",
        f"acceptance (accepted / drafted tokens): {rate}, band {ACCEPTANCE_BAND}: "
        f"{v['acceptance_in_band']}; counts {v['spec_decode']}",
        f"decode tok/s at batch 1, off / on: {v['decode_tok_s']['off']} / "
        f"{v['decode_tok_s']['on']}; on/off {'-' if ratio is None else f'{ratio:.2f}'}",
        f"errors: {v['errors'] or 'none'}",
        f"ok: {v['ok']}",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = in_vllm_ab.engine_run_parser(__doc__.splitlines()[0])
    parser.add_argument("--speculative-tokens", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.raw.mkdir(parents=True, exist_ok=True)

    all_cases = in_vllm_ab.make_prompts(args.model)
    cases = {k: v for k, v in all_cases.items() if int(k.split("x")[0]) in PROMPT_LENGTHS}
    timed_prompt = in_vllm_ab.make_prompts(args.model, seed=1)[
        f"{in_vllm_ab.TIMED_PROMPT_TOKENS}x1"
    ][0]
    specs = {run.name: engine_spec(run, args, cases, timed_prompt) for run in runs()}
    by_name = {run.name: run for run in runs()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            name: pool.submit(in_vllm_ab.launch, by_name[name], specs[name], args)
            for name in ("mtp-off", "mtp-on")
        }
        records = {name: f.result() for name, f in futures.items()}
    for name in ("timing-mtp-off", "timing-mtp-on"):  # one at a time, alone on the GPU
        records[name] = in_vllm_ab.launch(by_name[name], specs[name], args)
    result = {
        "schema_version": 1,
        "run_id": args.run_id,
        "host": in_vllm_ab.host_facts(args.kit),
        "speculative_tokens": args.speculative_tokens,
        "new_tokens": NEW_TOKENS,
        "verdict": verdict(records),
    }
    stem = f"mtp_equality-{args.run_id}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (args.out / f"{stem}.md").write_text(text)
    print(text)
    return 0 if result["verdict"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
