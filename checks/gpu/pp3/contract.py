"""Issue 24's results contract, from what the GPU host wrote.

    python checks/gpu/pp3/contract.py EQUALITY_JSON [EQUALITY_JSON ...]
        [--serve SERVE_JSON] --command CMD [--command CMD ...] --out-dir checks/gpu/results

EQUALITY_JSON is orchestrate.py's `pp3_equality-RUN.json`: one call's, or
each call's where the run's calls ran on more than one machine (a machine
lost between calls; the later file's comparison where two made the same).
The verdicts are judged here, over every call's comparisons together, by
this checkout's compare.py, which must be the one that compared them (each
file's `compare_sha256`; a file written before that stamp is taken on
trust). SERVE_JSON is the `serve-tiny.json` of the launcher serving PP=3
(checks/gpu/serve/serve-tiny in its PP=3 mode).
Writes `pp3-RUN.json` (PP=3 against PP=1 in each mode, the two sensitivity
runs, the launcher's serve) and `layer_ab-RUN.json` (the PP=1 offload and
PLE-file A/B, layer by layer), each with the commands that made it. Runs
on the host's python (stdlib only).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from orchestrate import EQUALITY_MODES, EXPECTED_CATCH, compare, judge_all  # noqa: E402

TORCH_NOTE = (
    "our pinned vLLM 0.33.0 on the lent GPU host's torch 2.11.0+cu130 (the card: `card`), "
    "not the pinned torch 2.14"
)
# key -> (mode, new tokens per request)
PP3_COMPARISONS = {f"pp3-{m.name}": (m, 8) for m in EQUALITY_MODES} | {
    f"pp3-{m.name}-prefill4": (m, 1) for m in EQUALITY_MODES
}
AB_COMPARISONS = {"ab-offload": "QSA K/V offloaded vs VRAM", "ab-ple-file": "PLE file vs VRAM"}
SERVE_KEYS = ("health", "smoke", "bench_c1_tok_s", "bench_c4_tok_s", "clean_stop")


# What the calls of one run share; a file that differs is another run's.
RUN_KEYS = ("run_id", "devices", "emulated", "profile", "plan_hash", "compare_sha256")


def _run_stamp(result: dict[str, Any]) -> dict[str, Any]:
    series = (result.get("series") or {}).get("series_sha256")
    # One kind of card: a spread measured on one does not bound another's comparisons
    # (None: a call made before results named their card).
    card = (result.get("card") or {}).get("name")
    return {key: result.get(key) for key in RUN_KEYS} | {"series_sha256": series, "card": card}


def merged(results: list[tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
    """The calls of one run as one equality result: every call's engines and
    comparisons (the later file's where two compared the same pair), judged
    together, so a comparison made on a fresh machine is bounded by the
    spreads another machine measured (orchestrate.judge_all)."""
    (first_path, first), *rest = results
    stamp = _run_stamp(first)
    for path, result in rest:
        for key, value in _run_stamp(result).items():
            if value != stamp[key]:
                raise SystemExit(
                    f"contract: {path} is not of {first_path}'s run: its {key} is {value!r}, "
                    f"not {stamp[key]!r}. Give the equality results of one run id, "
                    "made by one kit and one compare.py on one kind of card."
                )
    here = hashlib.sha256(Path(compare.__file__).read_bytes()).hexdigest()
    if stamp["compare_sha256"] not in (None, here):  # None: made before the stamp
        raise SystemExit(
            f"contract: {first_path} was compared by another compare.py than this checkout's "
            f"(sha256 {stamp['compare_sha256']}); judge it from the commit that ran it: "
            "git log -- checks/gpu/common/compare.py"
        )
    one = dict(first) | {"engines": {}, "specs": {}, "comparisons": {}, "compared_in": {}}
    for path, result in results:
        for part in ("engines", "specs", "comparisons"):
            one[part] |= result.get(part, {})
        one["compared_in"] |= dict.fromkeys(result.get("comparisons", {}), str(path))
    one["cuda_launch_blocking"] = any(r["cuda_launch_blocking"] for _, r in results)
    one["verdicts"] = judge_all(one["comparisons"])
    one["calls"] = [
        {
            "file": str(path),
            "engines": sorted(result.get("engines", {})),
            "card": result.get("card"),
        }
        for path, result in results
    ]
    return one


def _case(case: str) -> tuple[int, int]:
    tokens, batch = case.split("x")
    return int(tokens), int(batch)


def runs_of(
    verdicts: dict[str, Any], key: str, mode: str, graphs: str, new_tokens: int = 8
) -> list[dict[str, Any]]:
    return [
        {
            "mode": mode,
            "graphs": graphs,
            "prompt_tokens": _case(case)[0],
            "batch": _case(case)[1],
            "new_tokens": new_tokens,
            "equal_to_pp1": v["equal"],
            "layer_max_rel": v["layer_max_rel"],
            "layer_mean_rel": v["layer_mean_rel"],
            "first_layer_over_bound": v["first_layer_over_bound"],
            "ids_equal": v["ids_equal"],
            "cause": v.get("cause"),  # where it parts first, and why (compare.parting_cause)
        }
        for case, v in sorted(verdicts.get(key, {}).items(), key=lambda kv: _case(kv[0]))
    ]


def caught(verdicts: dict[str, Any], key: str) -> bool | None:
    """Caught where it acts in every case it ran (None: it did not run)."""
    cases = verdicts.get(key)
    if not cases:
        return None
    return all(
        (v["first_layer_over_bound"] or "").startswith(EXPECTED_CATCH[key]) for v in cases.values()
    )


def serve_block(serve: dict[str, Any] | None) -> dict[str, Any] | None:
    if serve is None:
        return None
    block = serve.get("serve", {})
    missing = [k for k in SERVE_KEYS if k not in block]
    if missing:
        raise SystemExit(f"contract: the serve result lacks {missing}; was it the PP=3 mode?")
    return dict(block)  # the five keys, and what else it measured (MTP acceptance)


def common(equality: dict[str, Any], commands: list[str]) -> dict[str, Any]:
    series = equality.get("series") or {}
    return {
        "run_id": equality["run_id"],
        "devices": equality["devices"],
        "card": equality.get("card"),  # the first call's; every call's is in `calls`
        "emulated": equality["emulated"],
        "series_sha256": series.get("series_sha256"),
        "patches": series.get("patches"),
        "cuda_launch_blocking": equality["cuda_launch_blocking"],
        "software": TORCH_NOTE,
        "commands": commands,
        "calls": equality.get("calls"),  # each equality file and the engines it ran
        "compared_in": equality.get("compared_in"),
    }


def build(
    equality: dict[str, Any], serve: dict[str, Any] | None, commands: list[str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    verdicts = equality["verdicts"]
    pp3 = {"pp_size": 3} | common(equality, commands)
    pp3["runs"] = [
        run
        for key, (mode, new_tokens) in PP3_COMPARISONS.items()
        for run in runs_of(verdicts, key, mode.name, mode.graphs, new_tokens)
    ]
    pp3["sensitivity"] = {
        "drop_one_token_caught": caught(verdicts, "drop_one_token"),
        "boundary_shift_caught": caught(verdicts, "boundary_shift"),
    }
    pp3["spread"] = runs_of(verdicts, "spread", "eager-vram run to run", "eager")
    profile = "graphs-offload-mtp run to run"
    pp3["spread_profile"] = runs_of(verdicts, "spread-profile", profile, "full_decode_only")
    # The reference in other chunks: the bound on rows PP=3 ran in another chunk.
    pp3["spread_schedule"] = runs_of(verdicts, "spread-schedule", "eager-vram rechunked", "eager")
    pinned = "eager-vram, every autotuner on its first config"
    pp3["pinned"] = runs_of(verdicts, "pp3-eager-vram-pinned", pinned, "eager")
    pp3["serve"] = serve_block(serve)
    ab = {"pp_size": 1} | common(equality, commands)
    ab["runs"] = [
        run for key, what in AB_COMPARISONS.items() for run in runs_of(verdicts, key, what, "eager")
    ]
    return pp3, ab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("equality", type=Path, nargs="+")
    parser.add_argument("--serve", type=Path)
    parser.add_argument("--command", action="append", required=True, dest="commands")
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args(argv)
    results = [(path, json.loads(path.read_text())) for path in args.equality]
    for path, result in results:
        if result.get("phase") != "equality":
            print(f"contract: {path} is not an equality phase result", file=sys.stderr)
            return 2
    serve = json.loads(args.serve.read_text()) if args.serve else None
    pp3, ab = build(merged(results), serve, args.commands)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in ((f"pp3-{pp3['run_id']}.json", pp3), (f"layer_ab-{ab['run_id']}.json", ab)):
        dest = args.out_dir / name
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(dest)
        print(f"contract: wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
