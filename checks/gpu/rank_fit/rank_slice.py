"""Inputs of the rank-fit run (issue 12): each 3090 rank's slice of the model.

    python checks/gpu/rank_fit/rank_slice.py OUT_DIR [--facts FILE]

Runs here (CPU, the launcher's venv or any python with the launcher on
PYTHONPATH). It writes the full-scale checkpoint skeleton (`flashnext skeleton
--fixed-metadata`: the shipped config and the fixed quantization config), asks
`flashnext plan --json` for the 3x3090 plan on the replayed facts, and writes:

- OUT_DIR/rank{R}/: config.json cut to rank R's layers (16 decoder layers with
  the rank's QSA pattern; the PLE layer only in rank 0's slice), its
  quantization_config what `checkpoint fix` writes for the slice (targets and
  `ignore` derived from the slice's modules by fix's own code; the groups'
  schemes the skeleton's), and generation_config.json; no tokenizer (prompts are token ids, and the
  tokenizer holds no GPU memory);
- OUT_DIR/rank_fit.json: the plan's argv and env; for each rank the argv the
  worker starts (the plan's with the rank's `overrides` by name, for one rank
  on one GPU: see `rank_overrides`), the plan's per-rank figures, the bytes
  of the modules a PP=1 slice builds that the rank does not hold
  (`slice_extra_bytes`), and the PLE table (size and the manifest
  `flashnext table prepare` writes beside it).

No weights: the GPU side loads the slice with `--load-format dummy`, so vLLM
builds the real quantized modules at full width and fills them with random
values. checks/gpu/rank_fit/rank_fit.py runs it on the H200 under a ballast.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launcher" / "src"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "common"))

from flashnext.facts.model_derived import TEXT_PREFIX  # noqa: E402
from flashnext.skeleton import repaired_quantization_config  # noqa: E402
from flashnext.skeleton.configs import quantization_config  # noqa: E402
from flashnext.skeleton.inventory import build_inventory  # noqa: E402
from flashnext.table.layout import read_layout  # noqa: E402
from plan_settings import argv_with_overrides  # noqa: E402

FACTS = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
# Where rank_fit.py puts the sparse table on the GPU host (the plan's argv
# names it in --engram-config).
DEVICE_TABLE = "/root/rank_fit/ple-table.bin"
# One 3090 as NVML reports it (the replayed facts: memory_total_bytes of each
# card): the budget the ballast recreates on the H200.
CARD_TOTAL_BYTES = 25_769_803_776

# Checkpoint tensors of the model's two ends, by prefix: the embedding on the
# first PP rank; the final HC mixer, final norm and LM head on the last.
# Under PP=1 one slice builds both ends.
FIRST_RANK_ONLY = {"embed_tokens": (f"{TEXT_PREFIX}embed_tokens.",)}
LAST_RANK_ONLY = {
    "lm_head": ("lm_head.",),
    "final_mixer_norm": (f"{TEXT_PREFIX}hyper_connection_mixer.", f"{TEXT_PREFIX}norm."),
}
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I32": 4, "I64": 8}


def run_flashnext(*args: str) -> str:
    proc = subprocess.run(
        [str(REPO / "flashnext"), *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"flashnext {args[0]} failed ({proc.returncode}):\n{proc.stderr}")
    return proc.stdout


def slice_config(full: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """config.json of decoder layers [lo, hi) as a model of its own.

    ple_layer_ids are one-indexed (SPEC: [2] runs at layer index 1); a PLE
    layer outside the range is dropped, one inside is renumbered."""
    cfg = copy.deepcopy(full)
    text = cfg["text_config"]
    text["layer_types"] = list(text["layer_types"][lo:hi])
    text["num_hidden_layers"] = hi - lo
    text["ple_layer_ids"] = [i - lo for i in text["ple_layer_ids"] if lo < i <= hi]
    skeleton_qcfg = cfg.pop("quantization_config")
    # The slice as exported (`ignore` names modules by layer number), then fixed as
    # `checkpoint fix` would fix it: targets match exactly the slice's modules.
    cfg["quantization_config"] = quantization_config(build_inventory(cfg).ignore)
    rebuilt = repaired_quantization_config(cfg)
    # Only targets and `ignore` may differ from the skeleton's: the groups and their schemes
    # are the same.
    if _without_targets(rebuilt) != _without_targets(skeleton_qcfg):
        raise SystemExit("rank_slice: the skeleton's quantization_config is not the fixed one")
    cfg["quantization_config"] = rebuilt
    return cfg


def _without_targets(qcfg: dict[str, Any]) -> dict[str, Any]:
    """A quantization_config less what is derived from the modules: targets and `ignore`."""
    out = {k: v for k, v in qcfg.items() if k != "ignore"}
    out["config_groups"] = {
        name: {k: v for k, v in group.items() if k != "targets"}
        for name, group in qcfg["config_groups"].items()
    }
    return out


def tensor_bytes(entry) -> int:
    n = DTYPE_BYTES[entry.dtype]
    for d in entry.shape:
        n *= d
    return n


def end_bytes(full: dict[str, Any]) -> dict[str, int]:
    """Checkpoint bytes of each module group that only one end rank holds."""
    groups = {**FIRST_RANK_ONLY, **LAST_RANK_ONLY}
    totals = dict.fromkeys(groups, 0)
    for e in build_inventory(full).entries:
        for key, prefixes in groups.items():
            if e.name.startswith(prefixes):
                totals[key] += tensor_bytes(e)
    return totals


def slice_extra(rank: int, ranks: int, ends: dict[str, int]) -> dict[str, int]:
    """Modules a PP=1 slice builds that PP rank `rank` of `ranks` does not hold."""
    extra = {}
    if rank != 0:
        extra.update({k: ends[k] for k in FIRST_RANK_ONLY})
    if rank != ranks - 1:
        extra.update({k: ends[k] for k in LAST_RANK_ONLY})
    return extra


def rank_overrides(model: str, has_ple: bool) -> dict[str, Any]:
    """What one rank run alone on one GPU differs in from the plan, by EngineArgs
    name (the worker adds what the H200 needs: rank_fit_worker.h200_overrides)."""
    overrides: dict[str, Any] = {
        "model": model,  # the slice (the worker parses the argv with vLLM's serve parser)
        "pipeline_parallel_size": 1,  # one rank alone: PP 3 -> 1
        "load_format": "dummy",  # no weights: vLLM fills the real modules at random
        "skip_tokenizer_init": True,  # token-id prompts; the tokenizer holds no GPU memory
    }
    if not has_ple:
        # vLLM refuses it for a model without n-gram layers; under PP=3 those
        # ranks build no PLE module either.
        overrides["engram_config"] = None
    return overrides


def rank_argv(plan_argv: list[str], overrides: dict[str, Any]) -> list[str]:
    """The plan's `vllm serve` argv for one rank run alone on one GPU: `vllm serve`'s
    own arguments, the model first, with the rank's overrides and nothing else."""
    if Path(plan_argv[0]).name != "vllm" or plan_argv[1] != "serve":
        raise SystemExit(f"rank_slice: the plan's argv is not `vllm serve`: {plan_argv[:3]}")
    return argv_with_overrides(list(plan_argv[2:]), overrides)


def build(out: Path, facts: Path = FACTS) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rank-slice-") as tmp:
        skeleton = Path(tmp) / "skeleton"
        run_flashnext("skeleton", str(skeleton), "--fixed-metadata", "--json")
        plan = json.loads(
            run_flashnext(
                "plan", "--facts", str(facts), "--model", str(skeleton),
                "--table", DEVICE_TABLE, "--json",
            )
        )  # fmt: skip
        full = json.loads((skeleton / "config.json").read_text())
        generation = (skeleton / "generation_config.json").read_text()
        table = read_layout(skeleton)
    ends = end_bytes(full)
    ranks = []
    n_ranks = len(plan["pp_ranges"])
    for r, (lo, hi) in enumerate(plan["pp_ranges"]):
        cfg = slice_config(full, lo, hi)
        rank_dir = out / f"rank{r}"
        rank_dir.mkdir(exist_ok=True)
        (rank_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (rank_dir / "generation_config.json").write_text(generation)
        has_ple = bool(cfg["text_config"]["ple_layer_ids"])
        planned = plan["ranks"][r]
        overrides = rank_overrides(f"@SLICE@/rank{r}", has_ple)
        ranks.append(
            {
                "rank": r,
                "layers": [lo, hi],
                "dir": f"rank{r}",
                "qsa_layers": [
                    i
                    for i, kind in enumerate(cfg["text_config"]["layer_types"])
                    if kind == "full_attention"
                ],
                "ple_layer_ids": cfg["text_config"]["ple_layer_ids"],
                "argv": rank_argv(plan["argv"], overrides),
                "overrides": overrides,
                "planned": planned,
                "slice_extra_bytes": slice_extra(r, n_ranks, ends),
                "qsa_host_bytes_planned": planned_host_bytes(plan, r),
            }
        )
    doc = {
        "note": (
            "inputs of checks/gpu/rank_fit/rank_fit.py: the 3x3090 plan (replayed facts "
            f"{facts.name}, full skeleton) cut into one PP=1 run per rank"
        ),
        "card_total_bytes": CARD_TOTAL_BYTES,
        "card_free_bytes": card_free_bytes(facts),
        "plan_hash": plan["plan_hash"],
        "plan_argv": plan["argv"],
        "plan_env": plan["env"],
        "kv_cache_memory_bytes": plan["kv_cache_memory_bytes"]["value"],
        "table": {
            "path": DEVICE_TABLE,
            "bytes": table.file_bytes("packed"),
            "manifest": table.manifest("packed"),
        },
        "ranks": ranks,
    }
    (out / "rank_fit.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def planned_host_bytes(plan: dict[str, Any], rank: int) -> int:
    """Pinned host bytes of the rank's offloaded QSA layers, as planned (exact pinning)."""
    qsa = plan["qsa"]
    return qsa["layers_per_rank"][rank] * qsa["per_layer_exact_bytes"]


def card_free_bytes(facts: Path) -> int:
    """Free memory of an idle 3090 in the replayed facts (the tightest card)."""
    devices = json.loads(facts.read_text())["gpu"]["devices"]
    return min(int(d["memory_free_bytes"]) for d in devices)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--facts", type=Path, default=FACTS)
    args = p.parse_args()
    doc = build(args.out, args.facts)
    for r in doc["ranks"]:
        extra = sum(r["slice_extra_bytes"].values())
        print(
            f"rank {r['rank']}: layers {r['layers']}, QSA {r['qsa_layers']}, "
            f"PLE {r['ple_layer_ids']}, planned {r['planned']['committed_bytes']} B, "
            f"slice extra {extra} B"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
