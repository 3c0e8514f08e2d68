"""Capture sizes that give every decode a FULL CUDA graph, with or without MTP.

Stdlib only: the GPU harnesses turn MTP on in engines of a plan made without
it, and import this to capture what the launcher's MTP plan would.
"""

from __future__ import annotations


def decode_capture_sizes(
    sizes: tuple[int, ...] | list[int], num_speculative_tokens: int
) -> list[int]:
    """The profile's capture sizes (requests in a decode forward) and, with K draft
    tokens, each times 1 + K. A decode of n requests is then n x (1 + K) tokens,
    and vLLM's V2 runner captures such a graph only up to the largest capture
    size (v1/worker/gpu/cudagraph_utils.py `_init_candidates`): with [1, 2, 4]
    alone and K=1, a decode of 3 or 4 requests (6 or 8 tokens) would run eager
    (checks/contract/test_vllm_contract.py asks vLLM)."""
    return sorted(set(sizes) | {s * (1 + num_speculative_tokens) for s in sizes})
