"""Probes into a running vLLM engine that more than one harness uses: vLLM's
spec-decode counters, and a rewrite of the QSA offload kernels' selection
(the A/B's sensitivity run, the PP=3 harness's dropped-token run).

Imported by workers too (collective_rpc pickles functions by reference): the
folder must be on their PYTHONPATH.
"""

from __future__ import annotations

SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


def spec_decode_counts(metrics) -> dict[str, int]:
    """vLLM's spec-decode counters (v1/spec_decode/metrics.py), summed over engines."""
    counts = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0)
    for metric in metrics:
        key = SPEC_DECODE_COUNTERS.get(metric.name.removesuffix("_total"))
        if key is not None and hasattr(metric, "value"):
            counts[key] += int(metric.value)
    return counts


def rewrite_offload_selection(transform) -> None:
    """Make the QSA offload kernels (patch 0021), prefill and decode alike,
    read the selected-token index rows transform(indices) returns."""
    from vllm.models.qwen4_exp.nvidia.ops import qsa_offload

    decode, prefill = qsa_offload.qsa_offload_decode, qsa_offload.qsa_offload_prefill

    def decode_rewritten(q, k, v, indices, *args, **kwargs):
        return decode(q, k, v, transform(indices), *args, **kwargs)

    def prefill_rewritten(q, arena, indices, *args, **kwargs):
        return prefill(q, arena, transform(indices), *args, **kwargs)

    qsa_offload.qsa_offload_decode = decode_rewritten
    qsa_offload.qsa_offload_prefill = prefill_rewritten
