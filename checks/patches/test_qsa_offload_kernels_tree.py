"""Patch 0021 as the engine imports it: `vllm.models.qwen4_exp.nvidia.ops.
qsa_offload` from the vLLM tree, not the text read back out of the patch
(checks/qsa tests that one without vLLM, under the Triton interpreter).

On CPU the module's torch twin of the streamed prefill (the kernels' tile
order and roundings) must match the float64 reference of checks/qsa for
chunks smaller and larger than the context, and its host-side helpers must
agree with the launcher's planner and the engine's block tables.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "qsa"))
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.plan import qsa_sizing  # noqa: E402

PATCH = "0021-qsa-offload-kernels.patch"


def _tree_module():
    from vllm.models.qwen4_exp.nvidia.ops import qsa_offload

    assert Path(qsa_offload.__file__).is_relative_to(Path(sys.modules["vllm"].__file__).parent)
    return qsa_offload


@pytest.mark.proves(PATCH, raises=ImportError)
@pytest.mark.parametrize("chunk", [5, 64, 4096])
def test_tree_module_streams_prefill_like_the_float64_reference(chunk):
    from reference import bf16_close, make_case

    offload = _tree_module()
    case = make_case(seed=chunk, seq_lens=[40, 300], query_lens=[3, 9], width=64)
    out, held = offload.stream_prefill_torch(
        case.q, case.kv_cache, case.indices, case.block_table, case.token_to_req,
        case.seq_lens, case.gate, case.requests, chunk_tokens=chunk, block_n=16,
    )  # fmt: skip
    ok, worst = bf16_close(out, case.reference())
    assert ok, f"chunk {chunk}: error {worst:.2f}x the bf16 bound"
    assert held == chunk


@pytest.mark.proves(PATCH, raises=ImportError)
def test_tree_module_reads_block_rows_and_sizes_arenas_as_planned():
    import torch

    offload = _tree_module()
    table = torch.tensor([[3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    rows = offload.read_host_block_rows(
        table, torch.tensor([20, 33], dtype=torch.int32), [1], max_context=33, page_size=16
    )
    assert rows.lengths == {1: 33} and rows.blocks == {1: [6, 7, 8]}
    sizing = qsa_sizing.size_offload(550_000_000, pp_size=3)
    shape = qsa_sizing.QsaShape()
    per_layer = offload.arena_bytes(
        sizing.num_blocks, sizing.block_size_tokens, shape.num_key_value_heads, shape.head_dim
    )
    assert per_layer == sizing.host_bytes_per_layer
