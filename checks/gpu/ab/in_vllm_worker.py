"""One engine run of the in-vLLM A/B: start vLLM, record greedy outputs, stop.

    python checks/gpu/ab/in_vllm_worker.py SPEC.json OUT.json

Run by checks/gpu/ab/in_vllm_ab.py, one process per run, with PYTHONPATH naming
the stock or the patched vLLM tree (checks/gpu/kit). SPEC holds the plan
(`flashnext plan --json` of the h200-tiny profile: argv and env), the run's
overrides by name (the PLE backend, eager, MTP: in_vllm_ab.run_overrides,
mtp_equality.engine_spec), the prompts and whether to time decode. The engine's
LLM(...) arguments are the plan's argv through vLLM's own parser with those
overrides (checks/gpu/common/plan_settings.py); OUT records the overrides that
changed something. The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the timing hooks and the sensitivity
run's selection permutation see the real worker.

Everything here runs under `if __name__ == "__main__"`: vLLM's engine may
re-import the main module.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

GPU = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(GPU / "common"))

from engine_probes import rewrite_offload_selection, spec_decode_counts  # noqa: E402
from plan_settings import engine_settings  # noqa: E402

TOP_K = 5
MAX_NEW_TOKENS = 16
TIMED_NEW_TOKENS = 128


def engine_kwargs(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """LLM(...) arguments: the plan's with this run's overrides; and the overrides
    that changed something (a patched-only flag overridden to None leaves the
    argv before stock's parser sees it)."""
    kwargs, _, applied = engine_settings(spec["plan"], spec["overrides"])
    return kwargs, applied


def install_selection_permutation() -> None:
    """Sensitivity run: every offloaded QSA read attends to the token at half
    each selected position (t -> t // 2) instead of the selected one. An A/B
    that cannot tell this from the real selection proves nothing."""

    def permuted(indices):
        out = indices.clone()
        columns = out[:, :-1]
        valid = columns >= 0
        columns[valid] = columns[valid] // 2
        return out

    rewrite_offload_selection(permuted)


class GatherTimer:
    """Wall time of the PLE host gather (`prepare_host_rows`) per engine step,
    with the step's token count (decode steps have at most max_num_seqs)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def install(self) -> bool:
        try:
            from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding
        except ImportError:
            return False
        real = getattr(Qwen4ExpNGramEmbedding, "prepare_host_rows", None)
        if real is None:  # stock: the lookup runs inside forward (UVA)
            return False
        timer = self

        def timed(module, input_ids, *args, **kwargs):
            start = time.perf_counter()
            try:
                return real(module, input_ids, *args, **kwargs)
            finally:
                timer.steps.append((input_ids.numel(), time.perf_counter() - start))

        Qwen4ExpNGramEmbedding.prepare_host_rows = timed
        return True

    def take(self, max_tokens: int | None = None) -> dict[str, float]:
        """Stats of the steps since the last take (only those of at most
        max_tokens tokens, when given), then forget them."""
        steps, self.steps = self.steps, []
        samples = sorted(s for n, s in steps if max_tokens is None or n <= max_tokens)
        if not samples:
            return {"steps": 0}
        return {
            "steps": len(samples),
            "mean_us": 1e6 * sum(samples) / len(samples),
            "p50_us": 1e6 * samples[len(samples) // 2],
        }


def record(outputs) -> list[dict[str, Any]]:
    """The parts of RequestOutput the comparison reads, in JSON-able form."""
    requests = []
    for out in outputs:
        completion = out.outputs[0]
        requests.append(
            {
                "output_ids": list(completion.token_ids),
                "output_logprobs": [
                    {str(t): lp.logprob for t, lp in step.items()} for step in completion.logprobs
                ],
                "prompt_logprobs": [
                    None if step is None else {str(t): lp.logprob for t, lp in step.items()}
                    for step in out.prompt_logprobs or []
                ],
            }
        )
    return requests


def mean_top1_logprob(requests: list[dict[str, Any]]) -> float | None:
    """How peaked the model is: a flat one gives -ln(vocab)."""
    tops = [max(step.values()) for r in requests for step in r["prompt_logprobs"] if step]
    return sum(tops) / len(tops) if tops else None


def time_decode(
    llm, prompts: list[list[int]], gather: GatherTimer, max_num_seqs: int
) -> dict[str, Any]:
    """TTFT (1 new token) and decode tok/s (128 more) for this batch of prompts."""
    from vllm import SamplingParams

    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    first = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    longer = SamplingParams(
        temperature=0, max_tokens=1 + TIMED_NEW_TOKENS, ignore_eos=True, detokenize=False
    )
    llm.generate(inputs, first, use_tqdm=False)  # warm this batch shape
    gather.take()
    start = time.perf_counter()
    llm.generate(inputs, first, use_tqdm=False)
    ttft = time.perf_counter() - start
    prefill_gather = gather.take()
    start = time.perf_counter()
    llm.generate(inputs, longer, use_tqdm=False)
    total = time.perf_counter() - start
    decode_gather = gather.take(max_tokens=max_num_seqs)  # decode steps only
    decode_s = max(total - ttft, 1e-9)
    return {
        "batch": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "ttft_s": ttft,
        "decode_tok_s": len(prompts) * TIMED_NEW_TOKENS / decode_s,
        "ple_gather_prefill": prefill_gather,
        "ple_gather_decode": decode_gather,
    }


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm import LLM, SamplingParams

    if spec.get("permute_selection"):
        install_selection_permutation()
    gather = GatherTimer()
    gather_hooked = gather.install()
    kwargs, applied = engine_kwargs(spec)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - started
    params = SamplingParams(
        temperature=0,
        max_tokens=spec.get("max_new_tokens", MAX_NEW_TOKENS),
        logprobs=TOP_K,
        prompt_logprobs=TOP_K if spec.get("prompt_logprobs", True) else None,
        ignore_eos=bool(spec.get("ignore_eos", False)),
        detokenize=False,
    )
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, prompts in spec["cases"].items():
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False
        )
        cases[case] = record(outputs)
    # Before the timed runs, so the counts are those of the compared cases.
    mtp = kwargs.get("speculative_config")
    spec_decode = spec_decode_counts(llm.get_metrics()) if mtp else None
    gather.take()
    seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs  # the plan's
    timing = [time_decode(llm, batch, gather, seqs) for batch in spec.get("timed_batches", [])]
    return {
        "spec_decode": spec_decode,
        "run": spec["run"],
        "overrides": applied,
        "startup_s": startup_s,
        "ple_gather_hooked": gather_hooked,
        "peak_vram_bytes": torch.cuda.max_memory_allocated(),
        "vram_allocated_bytes": torch.cuda.memory_allocated(),
        "mean_top1_logprob": mean_top1_logprob([r for rs in cases.values() for r in rs]),
        "cases": cases,
        "timing": timing,
    }


def main() -> int:
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    spec = json.loads(spec_path.read_text())
    os.environ.update(spec.get("env", {}))
    result = run(spec)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
