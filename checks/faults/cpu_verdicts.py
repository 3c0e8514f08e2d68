#!/usr/bin/env python3
"""Issue 41's results file for the CPU stand-in: a short soak and every fault, in the
contract's shape (checks/gpu/results/soak-<run>.json), where="CPU stand-in".

    FLASHNEXT_PY=... $FLASHNEXT_PY checks/faults/cpu_verdicts.py [OUT.json] [SOAK_S]

Default OUT: checks/gpu/results/soak-cpu-standin.json; SOAK_S: 20. About two minutes.
The stand-in is no vLLM and has no GPU: what this proves is the supervisor's and the
soak's own behaviour (the code that also runs on the GPU), not vLLM's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "fixtures" / "standin_vllm"))
import standin_faults  # noqa: E402
from flashnext.atomic import write_text_atomic  # noqa: E402
from flashnext.facts import server_usage  # noqa: E402
from flashnext.tools import soak  # noqa: E402
from harness import start_standin  # noqa: E402

EMULATED = (
    "the stand-in vllm (checks/fixtures/standin_vllm, vLLM 0.33.0's wire format and /metrics "
    "names): no GPU and no real vLLM; three processes titled VLLM::Worker_PP0..2 stand for "
    "the ranks. The supervisor, bench --soak and their process handling are the real code."
)


def run_soak(seconds: float) -> dict:
    proc, url = start_standin(max_model_len=4096, extra=("--max-num-seqs", "4"),
                              STANDIN_PP_WORKERS="1", STANDIN_TOKEN_INTERVAL_S="0.01",
                              STANDIN_PREFILL_TOK_S="200000")  # fmt: skip
    try:
        port = int(url.rpartition(":")[2])
        pid, why = server_usage.find_listener("127.0.0.1", port)
        cfg = soak.SoakConfig(url=url, model="qwen3.8-flash-next", duration_s=seconds,
                              clients=8, max_tokens=64, long_prompt_tokens=3000,
                              interval_s=5)  # fmt: skip

        def sampler() -> dict:
            u = server_usage.sample(pid, why)
            return {"rss_bytes": u.rss_bytes, "pinned_bytes": u.pinned_bytes,
                    "gpu_used_bytes": u.gpu_used_bytes, "unavailable": u.unavailable}  # fmt: skip

        run = soak.run_soak(cfg, sampler)
        return soak.build_result(cfg, run, {"local": pid is not None, "max_num_seqs": 4})
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else HERE.parent / "gpu/results/soak-cpu-standin.json"
    seconds = float(argv[2]) if len(argv) > 2 else 20.0
    result = run_soak(seconds)
    faults = []
    with tempfile.TemporaryDirectory() as tmp:
        for fault in standin_faults.FAULTS:
            verdict = fault(Path(tmp))
            verdict.pop("log", None)
            faults.append(verdict)
            print(f"{verdict['what']}: exit {verdict['exit_code']}, "
                  f"{verdict['detected_s']} s", file=sys.stderr)  # fmt: skip
    doc = {
        "run": "cpu-standin",
        "command": "checks/faults/cpu_verdicts.py",
        "pp_size": 3,
        "emulated": EMULATED,
        "duration_s": result["duration_s"],
        "requests": result["requests"],
        "outcomes": result["outcomes"],
        "lost": result["lost"],
        "memory": result["memory"],
        "soak_checks": result["checks"],
        "pool_pressure": {
            "requests": None,
            "demand_over_capacity": None,
            "equal_to_serial": None,
            "note": "not run: the host pools exist only on the GPU",
        },  # fmt: skip
        "faults": faults,
    }
    write_text_atomic(out, json.dumps(doc, sort_keys=True, indent=2) + "\n")
    print(f"written {out}", file=sys.stderr)
    bad = result["lost"] or any(
        f["leftover_processes"] or f["exit_code"] not in (0, 1) for f in faults
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
