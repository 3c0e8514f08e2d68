"""One rank slice under its ballast: start vLLM with the plan's argv, run the prefills, measure.

    python3 checks/gpu/rank_fit/rank_fit_worker.py SPEC.json OUT.json

Run by checks/gpu/rank_fit/rank_fit.py (one process per rank, the patched vLLM tree
on PYTHONPATH, a ballast already holding the rest of the GPU). SPEC holds the
argv from rank_slice.py (`vllm serve`'s own arguments: the plan's with the
rank's overrides) and those overrides, the planned budget and the prompt
cases. The argv goes through vLLM's own `serve` parser and
EngineArgs, as `vllm serve` does; the engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the allocator's peak is the engine's.

Two more overrides of the argv, by name (`h200_overrides`; OUT records every
override as `overrides`), and one change to kernel choice, because the GPU
is an H200 and not a 3090:
- `--gpu-memory-utilization` is a share of the card's total, and vLLM
  refuses to start unless that share is free once its CUDA context exists.
  The same bytes as planned (0.97 x 24 GiB, plus the slice's extra modules)
  are restated as a share of the H200's total, lowered to what is free after
  this process's context if the H200's larger context leaves less (recorded
  as `gate_restated_by`). With --kv-cache-memory-bytes set the share sizes
  nothing else; the ballast is the hard limit.
- `--additional-config {"gdn_prefill_backend": "triton"}`: the GDN prefill a
  3090 runs; on Hopper vLLM would pick flashinfer's, a JIT build.
- the kernels a 3090 takes (`select_3090_kernels`): Marlin for the INT4
  experts and the INT8 layers, Humming for INT6, where vLLM would rank
  Humming first on sm90; a Humming MoE repack of a full-width expert layer
  asks for a 6.25 GiB temporary (seen in run r1), Marlin's does not.

OUT gets, and is rewritten after each case (a later failure keeps the earlier
results): memory after start (allocator: torch's reserved/allocated; driver:
NVML's used, less what was used before this process), per case the peaks of
both views, wall time, and the error if it failed (an OOM ends the run: the
engine is not reusable after one).

Everything runs under `if __name__ == "__main__"`: vLLM may re-import the
main module.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))

from plan_settings import argv_with_overrides  # noqa: E402

SAMPLE_S = 0.01  # NVML poll period: a prefill step takes tens of ms
RISE_BYTES = 256 << 20  # a new peak this much above the last is logged with its time


class NvmlPeak:
    """Device memory used (NVML's view) sampled in a thread; tracks the peak."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.baseline = self.used()  # before this process's CUDA context
        self.peak = self.baseline
        # Each 256 MiB rise of NVML's count: its wall clock, our bytes, the
        # torch allocator's reserved bytes then (NVML above reserved is memory
        # outside the allocator: context, libraries, driver mappings) and what
        # the main thread, where the in-process engine runs, was doing.
        self.rises: list[dict[str, Any]] = []
        self._main = threading.main_thread().ident
        self._logged = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.used()
            if used > self._logged + RISE_BYTES:
                self.rises.append(self._rise(used))
                self._logged = used
            self.peak = max(self.peak, used)
            time.sleep(SAMPLE_S)

    def _rise(self, used: int) -> dict[str, Any]:
        rise: dict[str, Any] = {"at": time.strftime("%H:%M:%S"), "ours": self.ours(used)}
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            rise["reserved"] = int(torch.cuda.memory_reserved())
        frame = sys._current_frames().get(self._main)
        rise["stack"] = main_thread_stack(frame)
        return rise

    def reset(self) -> None:
        self.peak = self.used()

    def ours(self, used: int) -> int:
        """Bytes of `used` that this process added (its context included)."""
        return used - self.baseline

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


STACK_FRAMES = 8  # innermost frames of vLLM and its kernels' libraries kept per rise
STACK_PACKAGES = ("vllm/", "flashinfer/", "humming", "torch/cuda", "torch/_ops")


def main_thread_stack(frame) -> list[str]:
    """The innermost frames of `frame`'s stack that belong to the engine's
    packages, as 'package/file.py:line function', innermost first."""
    kept: list[str] = []
    while frame is not None and len(kept) < STACK_FRAMES:
        path = frame.f_code.co_filename
        hit = next((path[path.rindex(p) :] for p in STACK_PACKAGES if p in path), None)
        if hit:
            kept.append(f"{hit}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return kept


def engine_args(argv: list[str]):
    """EngineArgs from `vllm serve ARGV` through vLLM's own CLI parser and
    validation, as `vllm serve` builds them (entrypoints/cli/{main,serve}.py)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    args.model = args.model_tag  # what ServeSubcommand.cmd does
    return EngineArgs.from_cli_args(args)


def restate_utilization(budget_bytes: int) -> dict[str, Any]:
    """budget_bytes as a share of this GPU (`utilization`), for --gpu-memory-utilization."""
    import torch

    torch.zeros(1, device="cuda")  # our context exists before we read free memory
    free, total = torch.cuda.mem_get_info()
    # Headroom for what vLLM allocates before its start-up snapshot (its
    # own workspaces) beyond the context this process already has.
    usable_at_gate = free - (512 << 20)
    requested = min(budget_bytes, usable_at_gate)
    share = requested / total
    return {
        "gpu_total": total,
        "free_after_context": free,
        "budget_bytes": budget_bytes,
        "requested_bytes": requested,
        "utilization": float(f"{share:.6f}"),
        "gate_restated_by": budget_bytes - requested,
    }


def h200_overrides(utilization: float) -> dict[str, Any]:
    """What the H200 needs beyond the rank's overrides, by EngineArgs name."""
    return {
        "gpu_memory_utilization": utilization,  # the planned bytes as this GPU's share
        "additional_config": {"gdn_prefill_backend": "triton"},  # the GDN prefill a 3090 runs
    }


def engine_argv(spec: dict[str, Any], utilization: float) -> tuple[list[str], dict[str, Any]]:
    """The argv this worker starts (the spec's with the H200's overrides), and
    every override of the plan it carries (the rank's and the H200's)."""
    mine = h200_overrides(utilization)
    return argv_with_overrides(spec["argv"], mine), spec.get("overrides", {}) | mine


def select_3090_kernels() -> None:
    """Take the kernels vLLM picks on sm86: on sm90 (only) it ranks Humming
    ahead of Marlin for the W4A16 MoE and linear layers
    (quantization/utils/humming/priority.py); a 3090 runs Marlin for INT4 and
    INT8, Humming for INT6. Machete and CUTLASS W4A8, sm90-only, are left out
    by VLLM_DISABLED_KERNELS (rank_fit.py)."""
    from vllm.model_executor.layers.quantization.utils.humming import priority

    priority._HUMMING_PREFERRED_CAPABILITIES = frozenset()


LOAD_TRACE: list[dict[str, Any]] = []


def collect_after_each_repack() -> None:
    """RANK_FIT_GC=1 (a diagnosis): run the cyclic garbage collector after
    each quantized module's weight post-processing, and trace the allocator.
    A repack replaces a parameter; if the old one sits in a reference cycle
    it stays on the GPU until Python's collector runs."""
    import gc

    import torch

    # The methods this model uses, imported so the walk below finds them.
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors  # noqa: F401
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16  # noqa: E501, F401
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    def wrap(cls):
        inner = cls.process_weights_after_loading

        def process(self, layer, *args, **kwargs):
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = inner(self, layer, *args, **kwargs)
            mid, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            gc.collect()
            LOAD_TRACE.append(
                {"method": cls.__name__, "before": before, "after": mid, "peak": peak,
                 "after_gc": torch.cuda.memory_allocated()}
            )  # fmt: skip
            return out

        cls.process_weights_after_loading = process

    seen = set()
    stack = list(QuantizeMethodBase.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack.extend(cls.__subclasses__())
        if "process_weights_after_loading" in cls.__dict__:
            wrap(cls)


def model_module_bytes(self) -> dict[str, int]:
    """Run on the worker (collective_rpc): bytes of the model's parameters and
    buffers, and of embed_tokens / lm_head, as allocated on the GPU."""
    import torch

    model = self.model_runner.model
    totals: dict[str, int] = {"all": 0, "embed_tokens": 0, "lm_head": 0}
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or id(t) in seen:
            continue
        seen.add(id(t))
        n = t.numel() * t.element_size()
        totals["all"] += n
        for key in ("embed_tokens", "lm_head"):
            if f"{key}." in f"{name}.":
                totals[key] += n
    return totals


def qsa_host_bytes() -> int:
    """Pinned host bytes the offloaded QSA arenas hold (patch 0022's ledger)."""
    from vllm.models.qwen4_exp.nvidia import qsa

    return int(sum(getattr(qsa, "_offload_host_bytes", {}).values()))


def prompts_for(case: dict[str, Any], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = case["token_range"]
    return [[rng.randrange(lo, hi) for _ in range(case["tokens"])] for _ in range(case["batch"])]


def memory_view(peak: NvmlPeak) -> dict[str, int]:
    import torch

    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
        "driver_used": peak.ours(peak.used()),
        "driver_peak": peak.ours(peak.peak),
    }


def run(spec: dict[str, Any], out_path: Path) -> int:
    peak = NvmlPeak()
    result: dict[str, Any] = {"rank": spec["rank"], "cases": [], "ok": False}

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    gate = restate_utilization(spec["budget_bytes"])
    argv, result["overrides"] = engine_argv(spec, gate["utilization"])
    result["argv"] = argv
    result["gate"] = gate
    save()

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    select_3090_kernels()
    if os.environ.get("RANK_FIT_GC") == "1":
        collect_after_each_repack()
    started = time.monotonic()
    try:
        llm = LLM.from_engine_args(engine_args(argv))
    except Exception as exc:  # the run's finding: recorded, not raised
        result["start"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        result["start"].update(memory_view(peak))
        result["load_trace"] = LOAD_TRACE
        result["rises"] = peak.rises
        save()
        peak.stop()
        return 1
    result["start"] = {"seconds": round(time.monotonic() - started, 1), **memory_view(peak)}
    try:
        result["start"]["modules"] = llm.collective_rpc(model_module_bytes)[0]
    except Exception as exc:
        result["start"]["modules"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    result["start"]["qsa_host_bytes"] = qsa_host_bytes()
    result["load_trace"] = LOAD_TRACE
    result["rises"] = peak.rises
    save()

    params = SamplingParams(
        temperature=0.0, max_tokens=spec["new_tokens"], ignore_eos=True, detokenize=False
    )
    ok = True
    for i, case in enumerate(spec["cases"]):
        torch.cuda.reset_peak_memory_stats()
        peak.reset()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(case, seed=i)]
        t0 = time.monotonic()
        record: dict[str, Any] = {k: case[k] for k in ("name", "batch", "tokens")}
        try:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            record["generated"] = [len(o.outputs[0].token_ids) for o in outputs]
            record["ok"] = all(n == spec["new_tokens"] for n in record["generated"])
        except Exception as exc:
            record["ok"] = False
            record["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        record["seconds"] = round(time.monotonic() - t0, 1)
        record["prefill_tok_s"] = round(case["batch"] * case["tokens"] / record["seconds"], 1)
        record.update(memory_view(peak))
        record["qsa_host_bytes"] = qsa_host_bytes()
        result["cases"].append(record)
        save()
        print(f"rank_fit_worker: {case['name']}: {record}", file=sys.stderr, flush=True)
        if not record["ok"]:
            ok = False
            break  # an engine that ran out of memory is not reusable
    result["ok"] = ok
    save()
    peak.stop()
    return 0 if ok else 1


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    return run(spec, Path(sys.argv[2]))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
