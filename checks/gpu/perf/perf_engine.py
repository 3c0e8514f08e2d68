"""One engine of issue 27's harness: the full-size model, PP=3, three ranks on
one GPU, timed step by step on every rank.

    python3 checks/gpu/perf/perf_engine.py SPEC.json OUT.json

Started by pp3_perf.py under the kit's patched tree with onegpu_perf/ first
on PYTHONPATH and the spec's environment. The argv (`vllm serve`'s own
arguments, the plan's but for pp3_perf.engine_argv's overrides) goes through
vLLM's serve parser (rank_fit_worker.engine_args); `--gpu-memory-utilization`
is restated here: the plan's usable bytes per rank as a share of this GPU's
total (NVML), the start gate only (`--kv-cache-memory-bytes` sizes the KV).

Cases: `decode` at concurrency c (prompts of 3,000 token ids): a generate of
one new token (its time: TTFT), one of 1 + 64 (decode tok/s = c x 64 / the
difference), each rank's steps recorded in a window (step_probe.window_*),
then one under torch.profiler, armed to start after the prefill (each rank's
decode kernels; with timeshare.attach_sharing, how much of each rank's
kernel time another rank's kernel shared the card). `ttft`: one
prompt, one new token. Writes OUT.json after every case. A case that fails
records its `stage` and keeps what it measured; the engine stops there and
makes no further collective_rpc (a dead worker takes the executor with it).
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "rank_fit"))


def gpu_total_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)


def restate_utilization(argv: list[str], usable_bytes: int, total: int):
    share = usable_bytes / total
    i = argv.index("--gpu-memory-utilization")
    planned = argv[i + 1]
    out = argv[: i + 1] + [f"{share:.6f}"] + argv[i + 2 :]
    return out, {"planned": planned, "usable_bytes": usable_bytes, "gpu_total": total,
                 "utilization": round(share, 6)}  # fmt: skip


def prompts(n: int, tokens: int, token_range: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = token_range
    return [[rng.randrange(lo, hi) for _ in range(tokens)] for _ in range(n)]


class SchedulerClock:
    """The engine core's scheduler, timed where it runs: in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0). Its calls are vLLM's CPU cost per engine
    step (`schedule`: the next batch; `update_from_output`: a batch's results);
    with async scheduling they run while the ranks compute (p1's rank 0 waited
    27 ms a step for its ids, its step long dispatched), so they are reported,
    not added to a token's critical path."""

    CALLS = ("schedule", "update_from_output")

    def __init__(self, scheduler: Any) -> None:
        self.records: dict[str, list[float]] = {name: [] for name in self.CALLS}
        for name in self.CALLS:
            setattr(scheduler, name, self._timed(name, getattr(scheduler, name)))

    def _timed(self, name: str, inner):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.records[name].append((time.perf_counter() - t0) * 1e6)

        return timed

    def begin(self) -> None:
        for calls in self.records.values():
            calls.clear()

    def summary(self) -> dict[str, Any]:
        return {
            name: {
                "calls": len(us),
                "us_median": statistics.median(us) if us else None,
                "us_total": sum(us),
            }
            for name, us in self.records.items()
        }


def failed_case(stage: str, exc: BaseException) -> dict[str, Any]:
    """The fields a case gets when it dies in `stage` (ttft, decode window, profile
    window). Dying in the profile window leaves the timed decode window's figures
    (ttft_s, generate_s, decode_tok_s, ranks) whole: `profile_failed` says so."""
    out = {"ok": False, "stage": stage, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    if stage == "profile window":
        out["profile_failed"] = True
    return out


def outcome(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The engine's ok and error from its cases. After a failed case the executor
    may be gone (a dead worker): no further collective_rpc, so the serving-memory
    record is skipped and the case's error stays the engine's."""
    failed = next((c for c in cases if c.get("ok") is False), None)
    if failed is None:
        return {"ok": all(c.get("ok") or c.get("skipped") for c in cases)}
    where = f"{failed['kind']} c={failed['concurrency']} {failed['prompt_tokens']} tokens"
    return {
        "ok": False,
        "error": f"case {where} died in its {failed.get('stage')}: {failed.get('error')}",
        "memory_serving": None,
        "memory_serving_skipped": "a case failed (the executor may be gone): no collective_rpc",
    }


def run(spec: dict[str, Any], out_path: Path) -> dict[str, Any]:
    import step_probe
    from rank_fit_worker import engine_args
    from timeshare import attach_sharing
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"engine": spec["engine"], "ok": False, "cases": []}

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1) + "\n")

    argv, gate = restate_utilization(spec["argv"], spec["usable_bytes"], gpu_total_bytes())
    result |= {"argv": argv, "gate": gate}
    save()
    t0 = time.monotonic()
    llm = LLM.from_engine_args(engine_args(argv))
    result["startup_s"] = round(time.monotonic() - t0, 1)
    result["memory_start"] = llm.collective_rpc(step_probe.memory, args=("serving",))
    result["installed"] = llm.collective_rpc(step_probe.install)
    # LLMEngine -> InprocClient -> EngineCore; a layout of another vLLM leaves it untimed
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    scheduler = SchedulerClock(core.scheduler) if hasattr(core, "scheduler") else None
    result["scheduler_timed"] = scheduler is not None
    max_len = int(llm.llm_engine.model_config.max_model_len)
    result["max_model_len"] = max_len
    save()

    def generate(batch: list[list[int]], new: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start

    tr = spec["token_range"]
    generate(prompts(1, 64, tr, 0), 4)  # warm-up outside every window
    for i, case in enumerate(spec["cases"]):
        rec: dict[str, Any] = dict(case)
        if case["prompt_tokens"] + case.get("new_tokens", 1) + 1 > max_len:
            rec["skipped"] = f"prompt longer than this engine's max_model_len {max_len}"
            result["cases"].append(rec)
            save()
            continue
        batch = prompts(case["concurrency"], case["prompt_tokens"], tr, seed=100 + i)
        stage = "ttft"
        try:
            if case["kind"] == "ttft":
                llm.collective_rpc(step_probe.window_begin, args=(f"ttft{case['prompt_tokens']}",))
                rec["ttft_s"] = generate(batch, 1)
                rec["ranks"] = llm.collective_rpc(step_probe.window_end)
            else:
                rec["ttft_s"] = generate(batch, 1)
                stage = "decode window"
                name = f"decode-c{case['concurrency']}"
                llm.collective_rpc(step_probe.window_begin, args=(name,))
                if scheduler:
                    scheduler.begin()
                rec["generate_s"] = generate(batch, 1 + case["new_tokens"])
                if scheduler:
                    rec["scheduler"] = scheduler.summary()
                rec["ranks"] = llm.collective_rpc(step_probe.window_end)
                span = rec["generate_s"] - rec["ttft_s"]
                rec["decode_tok_s"] = case["concurrency"] * case["new_tokens"] / span
                stage = "profile window"
                settle = case.get("profile_settle_steps", 1)
                llm.collective_rpc(step_probe.profile_begin, args=(settle,))
                generate(batch, 1 + case["profile_tokens"] + settle)
                rec["profile"] = attach_sharing(llm.collective_rpc(step_probe.profile_end))
            rec["ok"] = True
        except Exception as exc:  # noqa: BLE001 - the record says how the case died
            # What the case measured before it died stays in rec.
            rec |= failed_case(stage, exc)
        result["cases"].append(rec)
        save()
        shown = ("kind", "concurrency", "prompt_tokens", "ttft_s", "decode_tok_s", "ok", "stage")
        print(f"perf_engine {spec['engine']}: {json.dumps({k: rec.get(k) for k in shown})}")
        if not rec["ok"]:
            break
    result |= outcome(result["cases"])
    if "memory_serving_skipped" not in result:
        result["memory_serving"] = llm.collective_rpc(step_probe.memory, args=("end",))
    save()
    return result


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    record: dict[str, Any] = {"engine": spec["engine"], "ok": False}
    try:
        record = run(spec, out)
    except BaseException as exc:  # noqa: BLE001 - the record says how the engine died
        prior = json.loads(out.read_text()) if out.exists() else record
        prior["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        prior["traceback"] = traceback.format_exc()[-4000:]
        out.write_text(json.dumps(prior, indent=1) + "\n")
        record = prior
    print(f"perf_engine {spec['engine']}: {'ok' if record.get('ok') else record.get('error')}",
          flush=True)  # fmt: skip
    os._exit(0 if record.get("ok") else 1)  # vLLM's workers can hang the teardown


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
