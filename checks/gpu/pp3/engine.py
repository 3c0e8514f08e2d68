"""One engine of the PP=3 harness: start vLLM at PP=1 or PP=3 (three ranks on
one GPU through onegpu/sitecustomize.py), generate greedily, capture every
rank's layer outputs (../common/capture.py), stop.

    python checks/gpu/pp3/engine.py SPEC.json OUT.json

SPEC: {"run", "plan" (`flashnext plan --json` of the h200-tiny-pp3 profile:
its argv and env), "model", "pp", "graphs": "eager"|"full_decode_only",
"table" (PLE file or null), "speculative_config" (MTP), "load_format",
"sync" (a capture.install_sync probe), "capture", "cases": [[prompt_tokens,
batch], ...], "seed", "max_new_tokens", "env"}. The engine's arguments are
the plan's (../common/plan_settings.py); what this engine must differ in is
overridden by name (`overrides`) and recorded in OUT.json. Layer captures go
to OUT.<case>.rank<R>.pt beside OUT.json.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
COMMON = HERE.parent / "common"
sys.path.insert(0, str(COMMON))

from engine_probes import spec_decode_counts  # noqa: E402
from plan_settings import engine_settings, flag_value, mtp_compilation, plan_table  # noqa: E402

# Prompts longer than this are captured thinned (capture.start).
LONG_PROMPT = 4096

# Settings a spec may restate for a diagnosis (none of the runs of record does).
SPEC_SETTINGS = (
    "kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len", "max_num_batched_tokens",
)  # fmt: skip


def overrides(spec: dict[str, Any]) -> dict[str, Any]:
    """What this engine must differ in from the plan, by name (None: unset)."""
    eager = spec["graphs"] == "eager"
    mtp = spec.get("speculative_config")
    wanted: dict[str, Any] = {
        "model": spec["model"],  # the echo-drafter copy, the stock copy
        "pipeline_parallel_size": spec["pp"],  # PP=1: the reference
        # Three ranks on one GPU: "mp" skips vLLM's GPU-count check (the emulation).
        "distributed_executor_backend": "mp" if spec["pp"] > 1 else None,
        "enforce_eager": True if eager else None,
        "speculative_config": mtp,  # the mode's MTP, on or off
        "disable_log_stats": False if mtp else None,  # the spec-decode counters
        # The harness's MTP engines keep the drafter in VRAM.
        "cpu_offload_gb": None,
        "cpu_offload_params": None,
        "load_format": spec.get("load_format"),  # dummy weights: the stock copy
    }
    if eager:
        wanted["compilation_config"] = None
    elif mtp and flag_value(list(spec["plan"]["argv"]), "--speculative-config") is None:
        # MTP turned on here: the decode graphs the launcher's MTP plan captures.
        wanted["compilation_config"] = mtp_compilation(spec["plan"], mtp["num_speculative_tokens"])
    if not spec.get("table"):
        wanted["engram_config"] = None  # PLE in VRAM
    elif spec["table"] != plan_table(spec["plan"]):
        wanted["engram_config"] = {"mmap_path": spec["table"]}
    wanted |= {name: spec[name] for name in SPEC_SETTINGS if name in spec}
    return wanted


def engine_kwargs(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """LLM(...) arguments: the plan's, with this engine's overrides; and those overrides."""
    kwargs, _, applied = engine_settings(spec["plan"], overrides(spec))
    return kwargs, applied


def prompts_for(length: int, batch: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct random ids per prompt (the same for every engine of a run)."""
    rng = random.Random(seed * 1_000_003 + length * 31 + batch)
    return [rng.sample(range(100, vocab - 100), length) for _ in range(batch)]


def run(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    import capture  # checks/gpu/common
    from vllm import LLM, SamplingParams

    kwargs, applied = engine_kwargs(spec)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    result: dict[str, Any] = {
        "startup_s": time.perf_counter() - started,
        "overrides": applied,
        "cases": {},
    }
    result["sync"] = llm.collective_rpc(capture.install_sync, args=(spec.get("sync", "none"),))
    if spec.get("capture"):
        result["capture_layers"] = llm.collective_rpc(capture.install_capture)
    if spec.get("pin_autotune"):
        result["pinned_autotune"] = llm.collective_rpc(capture.pin_autotune)
    config = json.loads((Path(spec["model"]) / "config.json").read_text())
    vocab = int(config.get("text_config", config)["vocab_size"])
    params = SamplingParams(
        temperature=0,
        max_tokens=spec.get("max_new_tokens", 8),
        logprobs=1,
        ignore_eos=True,
        detokenize=False,
    )
    for length, batch in spec["cases"]:
        case = f"{length}x{batch}"
        prompts = prompts_for(length, batch, vocab, spec.get("seed", 7))
        if spec.get("capture"):
            # Long prompts: every 8th prompt row and every decode row.
            keep_every = 8 if length > LONG_PROMPT else 1
            llm.collective_rpc(capture.start, args=(keep_every, length))
        t0 = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        entry: dict[str, Any] = {
            "seconds": time.perf_counter() - t0,
            "output_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "output_logprobs": [
                [
                    max(step.values(), key=lambda lp: lp.logprob).logprob
                    for step in o.outputs[0].logprobs
                ]
                for o in outputs
            ],
        }
        if spec.get("capture"):
            entry["capture"] = llm.collective_rpc(
                capture.dump, args=(str(out.with_suffix(f".{case}")),)
            )
        result["cases"][case] = entry
        print(
            f"{spec['run']} {case}: {entry['output_ids'][0][:8]} ({entry['seconds']:.1f} s)",
            flush=True,
        )
    if spec.get("speculative_config"):
        result["spec_decode"] = spec_decode_counts(llm.get_metrics())
    return result


def main() -> int:
    spec_path, out = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    os.environ.update(spec.get("env", {}))
    # The engine core in this process; capture.py and engine_probes.py
    # (checks/gpu/common) importable by every worker: collective_rpc pickles
    # their functions by reference.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ["PYTHONPATH"] = f"{HERE}:{COMMON}:{os.environ.get('PYTHONPATH', '')}"
    record: dict[str, Any] = {"run": spec["run"], "spec": spec, "ok": False}
    try:
        record.update(run(spec, out))
        record["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the record says how the engine died
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-4000:]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out)
    print(f"{spec['run']}: {'ok' if record['ok'] else record.get('error')}", flush=True)
    # Skip interpreter teardown: vLLM's workers can hang it after a crash.
    os._exit(0 if record["ok"] else 1)


if __name__ == "__main__":
    main()
