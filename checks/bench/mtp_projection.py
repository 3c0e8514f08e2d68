#!/usr/bin/env python3
"""MTP's single-stream decode on paper, over acceptance rates: the README's table.

    python3 checks/bench/mtp_projection.py [--json]

Plans the full-scale skeleton (`flashnext skeleton DIR --fixed-metadata`),
its MTP experts INT4 as `flashnext checkpoint mtp-int4` leaves them, on the
replayed 3x3090 facts with the shipped profile, MTP switched on, and prints
what the drafter costs (plan/mtp.py: VRAM, pinned host memory, its pass
through VRAM while loading, the KV pool it shares) and plan/mtp_projection.py's
grid: tokens/s under the decode roofline for each acceptance rate and
num_speculative_tokens, and the ratio to the roofline without MTP. A
projection, not a measurement (the module says what it counts); the
profile's cited rate is marked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.checkpoint.mtp_int4 import int4_byte_classes  # noqa: E402
from flashnext.facts.model import read_model_facts  # noqa: E402
from flashnext.facts.schema import host_facts_from_json  # noqa: E402
from flashnext.plan.mtp_projection import PROJECTED_K, projection_table  # noqa: E402
from flashnext.plan.planner import PlanOptions, plan  # noqa: E402
from flashnext.profiles import available_profiles  # noqa: E402
from flashnext.units import gib  # noqa: E402

FACTS = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
GRID = (0.5, 0.6, 0.7, 0.8, 0.9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    args = parser.parse_args()
    shipped = available_profiles()["3x3090"]
    profile = dataclasses.replace(shipped, mtp=dataclasses.replace(shipped.mtp, enabled=True))
    env = {**os.environ, "PYTHONPATH": str(REPO / "launcher" / "src")}
    with tempfile.TemporaryDirectory(prefix="mtp-projection-") as tmp:
        model_dir = Path(tmp) / "skeleton"
        subprocess.run(
            [sys.executable, "-m", "flashnext", "skeleton", str(model_dir), "--fixed-metadata"],
            check=True, capture_output=True, env=env,
        )  # fmt: skip
        facts = host_facts_from_json(FACTS.read_text(), source=str(FACTS))
        options = PlanOptions(model_dir=str(model_dir), table_path="/nvme/flashnext/ple-table.bin")
        model = read_model_facts(model_dir)
        int4 = int4_byte_classes(model.tensor_bytes_by_class(), model.text_config["num_experts"])
        model_int4 = dataclasses.replace(model, byte_classes=int4)
        p = plan(facts, model_int4, profile, options)
        at_profile = p.mtp
        # vLLM refuses to start when one full-length request does not fit the pool: the
        # drafter's costs are then shown at the longest --max-model-len it starts at.
        longest = at_profile.requests.longest_request_tokens if at_profile.requests else 0
        if not at_profile.fits and at_profile.load.fits and longest:
            options = dataclasses.replace(options, max_model_len=longest)
            p = plan(facts, model_int4, profile, options)
        off = plan(facts, model, shipped, options)
    mtp = p.mtp
    projection = mtp.projection
    cited = projection.acceptance_rate
    rates = tuple(sorted({*GRID, *(() if cited is None else (cited,))}))
    rows = projection_table(projection.cost, rates)
    if args.json:
        doc = {"mtp": {k: v for k, v in mtp.to_json().items() if k != "projection"},
               "max_model_len": p.max_model_len.value,
               "at_profile_max_model_len": {"fits": at_profile.fits,
                                            "reason": at_profile.reason},
               "no_mtp_tokens_per_s": projection.no_mtp_tokens_per_s, "cited_rate": cited,
               "source": projection.acceptance_source,
               "rows": [{"acceptance_rate": a, **r.to_json()}
                        for a, r in zip([a for a in rates for _ in PROJECTED_K], rows,
                                        strict=True)]}  # fmt: skip
        print(json.dumps(doc, indent=2))
        return 0
    host, vram = mtp.placed_bytes["host"], mtp.placed_bytes["vram"]
    if at_profile is not mtp:
        print(f"MTP at --max-model-len {shipped.scheduler.max_model_len}: {at_profile.reason}")
    print(f"MTP at --max-model-len {p.max_model_len.value}: {mtp.reason}")
    req, req_off = mtp.requests, off.kv_capacity
    print(f"VRAM: weights {gib(vram['layer'] + vram['fc_norms_mixer'])}, its share of the KV "
          f"pool {gib(vram['kv'])}; pool {req.num_blocks} blocks of {req.block_size_tokens} "
          f"tokens, {req.full_length_requests} request(s) of {req.max_model_len} tokens at "
          f"once ({req_off.num_blocks} blocks of {req_off.block_size_tokens}, "
          f"{req_off.full_length_requests} without MTP)")  # fmt: skip
    print(f"host: experts {gib(host['routed_experts'])} + embedding {gib(host['embed_tokens'])} "
          f"+ K/V arena {gib(host['kv'])}, pinned {gib(mtp.pinned_bytes)}; "
          f"--cpu-offload-gb {mtp.cpu_offload_gb}")  # fmt: skip
    print(f"plan: --kv-cache-memory-bytes {p.kv_cache_memory_bytes.value} "
          f"({off.kv_cache_memory_bytes.value} without MTP), pinned {gib(p.pinned_bytes_needed)} "
          f"in all ({gib(off.pinned_bytes_needed)} without MTP)")  # fmt: skip
    print(f"load: {gib(mtp.load.transient_bytes)} through VRAM, {gib(mtp.load.room_bytes)} room "
          f"({mtp.load.binds} binds)")  # fmt: skip
    print(f"draft step: {projection.drafter_host_bytes_per_step / 1e6:.1f} MB over the host link "
          f"at {projection.cost.host_link_bytes_per_s / 1e9:.1f} GB/s")  # fmt: skip
    print(f"roofline without MTP: {projection.no_mtp_tokens_per_s:.0f} tok/s; cited rate: {cited}")
    print("| acceptance rate | " + " | ".join(f"k = {k}" for k in PROJECTED_K) + " |")
    print("|---|" + "---|" * len(PROJECTED_K))
    for i, a in enumerate(rates):
        cells = rows[i * len(PROJECTED_K) : (i + 1) * len(PROJECTED_K)]
        mark = " (cited)" if a == cited else ""
        print(f"| {a}{mark} | " + " | ".join(
            f"{r.tokens_per_s:.0f} tok/s (x{r.speedup:.2f})" for r in cells) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
