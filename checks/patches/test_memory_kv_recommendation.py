"""Patch 0003: the `--kv-cache-memory-bytes` recommendation counts CUDA graphs once.

The worker prints the recommendation (and saves it as the startup plan) at the
end of `Worker._compile_or_warm_up_model`, after capturing the graphs. That
block is taken from the installed vLLM's own source and run on a worker that
replays what `determine_available_memory` recorded on a 24 GiB card (the
memory facts a GPU would produce; nothing else of the worker is needed).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest

PATCH = "0003-kv-cache-memory-recommendation.patch"
GiB = 1 << 30
MiB = 1 << 20
BUFFER = 150 * MiB  # vLLM's redundancy buffer, unchanged by the patch

# One PP rank of the 3x3090 plan, in bytes (illustrative, not measured).
TOTAL = 24 * GiB
FREE_AT_START = 23 * GiB + 512 * MiB
UTILIZATION = 0.97
REQUESTED = int(TOTAL * UTILIZATION)
CONSUMED = 21 * GiB + 700 * MiB  # weights + non-torch
TRANSIENT_PEAK = 420 * MiB  # profiled activation peak
GRAPH_ESTIMATE = 180 * MiB  # profile_cudagraph_memory()
GRAPH_CAPTURED = 176 * MiB  # capture_model()


def recommendation_block():
    """The `if kv_cache_memory_bytes is None ...` block of the real method."""
    from vllm.v1.worker import gpu_worker

    source = textwrap.dedent(inspect.getsource(gpu_worker.Worker._compile_or_warm_up_model))
    function = ast.parse(source).body[0]
    blocks = [
        node
        for node in ast.walk(function)
        if isinstance(node, ast.If) and "kv_cache_memory_bytes is None" in ast.unparse(node.test)
    ]
    assert len(blocks) == 1, "the recommendation block moved; re-read gpu_worker.py"
    module = ast.Module(body=blocks, type_ignores=[])
    return compile(module, gpu_worker.__file__, "exec"), gpu_worker


def replay_worker(estimate_applied: bool) -> SimpleNamespace:
    """Attributes determine_available_memory sets, as a GPU run would."""
    applied = GRAPH_ESTIMATE if estimate_applied else 0
    return SimpleNamespace(
        cache_config=SimpleNamespace(
            kv_cache_memory_bytes=None, gpu_memory_utilization=UTILIZATION
        ),
        init_snapshot=SimpleNamespace(free_memory=FREE_AT_START, total_memory=TOTAL),
        requested_memory=REQUESTED,
        total_consumed=CONSUMED,
        # stock 0.33.0 name and meaning: activations + applied graph estimate
        peak_activation_memory=TRANSIENT_PEAK + applied,
        # the patch's name for the activations alone
        transient_peak_memory=TRANSIENT_PEAK,
        cudagraph_memory_estimate=GRAPH_ESTIMATE,
        available_kv_cache_memory_bytes=REQUESTED - CONSUMED - TRANSIENT_PEAK - applied,
    )


def run_block(worker: SimpleNamespace) -> tuple[str, int]:
    code, module = recommendation_block()
    logged: list[str] = []
    saved: list[int] = []
    namespace = dict(vars(module))
    namespace["logger"] = SimpleNamespace(info=lambda msg, *a: logged.append(msg % a if a else msg))
    namespace["maybe_save_startup_plan"] = lambda w, nbytes: saved.append(nbytes)
    namespace.update(self=worker, cuda_graph_memory_bytes=GRAPH_CAPTURED)
    exec(code, namespace)
    assert len(logged) == 1 and len(saved) == 1
    return logged[0], saved[0]


TO_REQUESTED = REQUESTED - CONSUMED - TRANSIENT_PEAK - GRAPH_CAPTURED - BUFFER
TO_GPU = FREE_AT_START - CONSUMED - TRANSIENT_PEAK - GRAPH_CAPTURED - BUFFER


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_recommendation_counts_cuda_graphs_once() -> None:
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, the default.
    message, startup_plan_bytes = run_block(replay_worker(estimate_applied=True))

    assert startup_plan_bytes == TO_REQUESTED, (TO_REQUESTED - startup_plan_bytes) // MiB
    assert f"={TO_REQUESTED}`" in message
    assert f"={TO_GPU}`" in message


def test_recommendation_without_graph_estimate_is_unchanged() -> None:
    # VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0 never double-counted.
    message, startup_plan_bytes = run_block(replay_worker(estimate_applied=False))

    assert startup_plan_bytes == TO_REQUESTED
    assert f"={TO_GPU}`" in message


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_recommendation_names_the_real_flag() -> None:
    message, _ = run_block(replay_worker(estimate_applied=True))

    # 0.33.0's flag; `--kv-cache-memory` only works as an argparse prefix.
    assert f"`--kv-cache-memory-bytes={TO_REQUESTED}`" in message
    assert "--kv-cache-memory=" not in message


@pytest.mark.proves(PATCH, raises=ImportError)
def test_helper_arithmetic() -> None:
    from vllm.v1.worker.gpu_worker import recommend_kv_cache_memory_bytes

    to_requested, to_gpu = recommend_kv_cache_memory_bytes(
        free_memory=10 * GiB,
        requested_memory=9 * GiB,
        consumed_memory=6 * GiB,
        transient_peak_memory=GiB,
        cudagraph_memory=512 * MiB,
    )
    assert to_requested == 9 * GiB - 6 * GiB - GiB - 512 * MiB - BUFFER
    assert to_gpu == to_requested + GiB
    # Nothing left: a negative figure, not a silently clamped one.
    low, _ = recommend_kv_cache_memory_bytes(
        free_memory=GiB,
        requested_memory=GiB,
        consumed_memory=GiB,
        transient_peak_memory=0,
        cudagraph_memory=0,
        redundancy_buffer_memory=0,
    )
    assert low == 0
