"""vLLM 0.33.0's V2 runner under PP=3 with MTP: what the non-last ranks learn.

No patch needed and none claimed (no `proves` marker): this must pass on the
stock and the patched tree alike. It answers issue 16's question against the
real code: after a step in which the last rank rejected a draft, do the
non-last ranks (a) get the new draft token ids to embed, and (b) correct
`num_computed_tokens`, the GDN accepted-token count (which picks the
speculative state slot the next step continues from) and the PLE n-gram
context that is derived from both?

Real code run: `PPHandler` (v1/worker/gpu/pp_utils.py: `broadcast`,
`broadcast_drafts` on the last rank; `receive`, `get_prev_sampled_outputs` on
rank 0, with its ring of pp_size in-flight steps), `GPUModelRunner`'s
`sample_tokens` (non-last branch), `update_pp_decode_requests`,
`postprocess_sampled`, `postprocess_num_computed_tokens`, the Triton kernel
bodies of `post_update`, `post_update_num_computed_tokens`,
`prepare_pos_seq_lens`, `combine_sampled_and_draft_tokens` and the mamba
accepted-count scatter (run by Triton's own interpreter: this host has no
GPU), `MambaHybridModelState.postprocess_state` and
`Qwen4ExpModelState._prepare_ngram_context`.

Replayed, not real: CUDA streams/events (cuda_stream_replay.py: logged,
never waited on; one thread here; vLLM's current_stream() returns the stream
it makes on a CUDA worker, which patch 0005's handler waits on), the
broadcast itself (the last rank's tensors are recorded and handed to rank
0's receive, which must ask for the same shapes and dtypes in the same
order), and the per-request buffers (plain CPU tensors of RequestState's
shapes and dtypes; RequestState pins host memory, which needs a driver).
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import numpy as np
import pytest
from cuda_stream_replay import cuda_worker_stream, install

PP_SIZE = 3
LAST = PP_SIZE - 1
NUM_SPEC = 2  # MTP num_speculative_tokens
MAX_REQS = 4
MAX_LEN = 64
REQ = 1  # the request's state slot
PROMPT = list(range(30, 40))  # 10 prompt tokens
FIRST_SAMPLED = 100  # sampled at position 10 by the step before
OLD_DRAFTS = [201, 202]  # drafted for positions 11, 12
# The step: verify [100, 201, 202]; 201 accepted, 202 rejected, 300 sampled.
SAMPLED = [201, 300, -1]
NUM_SAMPLED, NUM_REJECTED = 2, 1
NEW_DRAFTS = [401, 402]
EOS = 1


def _interpreted(kernel):
    """vLLM's kernel body under Triton's interpreter (CPU tensors)."""
    import triton
    import triton.language as real_tl
    from triton.runtime.interpreter import InterpretedFunction

    fn = getattr(kernel, "fn", kernel)  # a JITFunction on GPU hosts, the body here
    env = dict(fn.__globals__, tl=real_tl, triton=triton)
    body = types.FunctionType(fn.__code__, env, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__annotations__ = {
        name: real_tl.constexpr
        for name, ann in getattr(fn, "__annotations__", {}).items()
        if "constexpr" in repr(ann) or "constexpr" in str(ann)
    }
    return InterpretedFunction(body)


class Wire:
    """The pp_broadcast group: what the last rank sends, rank 0 receives in order."""

    def __init__(self) -> None:
        self.sent: list = []
        self.rank = LAST

    def broadcast(self, tensor, src, group=None) -> None:
        assert src == LAST and group == "pp_broadcast"
        if self.rank == LAST:
            self.sent.append(tensor.clone())
            return
        assert self.sent, "rank 0 waits on a broadcast the last rank never sent"
        want = self.sent.pop(0)
        assert (tuple(tensor.shape), tensor.dtype) == (tuple(want.shape), want.dtype)
        tensor.copy_(want)


def _pp_group(rank: int):
    return SimpleNamespace(
        rank_in_group=rank,
        world_size=PP_SIZE,
        is_first_rank=rank == 0,
        is_last_rank=rank == LAST,
        first_rank=0,
        last_rank=LAST,
        make_sibling_device_group=lambda group_desc: group_desc,
    )


@pytest.fixture
def v2(monkeypatch: pytest.MonkeyPatch):
    # Everything is imported before torch.cuda is replayed (annotations use it).
    import torch
    import vllm.models.qwen4_exp.nvidia.model_state  # noqa: F401
    import vllm.v1.worker.gpu.input_batch as input_batch
    import vllm.v1.worker.gpu.kv_connector  # noqa: F401
    import vllm.v1.worker.gpu.model_runner  # noqa: F401
    import vllm.v1.worker.gpu.model_states.mamba_hybrid as mamba_hybrid
    import vllm.v1.worker.gpu.pp_utils as pp_utils

    for module, name in (
        (input_batch, "_post_update_kernel"),
        (input_batch, "_post_update_num_computed_tokens_kernel"),
        (input_batch, "_prepare_pos_seq_lens_kernel"),
        (input_batch, "_combine_sampled_and_draft_tokens_kernel"),
        (mamba_hybrid, "_scatter_num_accepted_kernel"),
        (mamba_hybrid, "_fill_num_accepted_kernel"),
    ):
        monkeypatch.setattr(module, name, _interpreted(getattr(module, name)))
    import triton

    monkeypatch.setattr(input_batch, "triton", triton)  # next_power_of_2
    install(monkeypatch)
    cuda_worker_stream(monkeypatch)
    wire = Wire()
    monkeypatch.setattr(torch.distributed, "broadcast", wire.broadcast)
    return SimpleNamespace(pp_utils=pp_utils, wire=wire, monkeypatch=monkeypatch)


def _request_state():
    """RequestState's per-request tensors (shapes, dtypes), one decode request."""
    import torch

    all_token_ids = torch.zeros(MAX_REQS, MAX_LEN, dtype=torch.int32)
    history = PROMPT + [FIRST_SAMPLED]
    all_token_ids[REQ, : len(history)] = torch.tensor(history, dtype=torch.int32)
    draft_tokens = torch.zeros(MAX_REQS, NUM_SPEC, dtype=torch.int64)
    draft_tokens[REQ] = torch.tensor(OLD_DRAFTS)
    last_sampled = torch.zeros(MAX_REQS, 1, dtype=torch.int64)
    last_sampled[REQ] = FIRST_SAMPLED

    def counter(value: int):
        tensor = torch.zeros(MAX_REQS, dtype=torch.int32)
        tensor[REQ] = value
        return SimpleNamespace(gpu=tensor)

    return SimpleNamespace(
        num_computed_tokens=counter(len(PROMPT)),
        total_len=counter(len(history)),
        all_token_ids=SimpleNamespace(gpu=all_token_ids),
        last_sampled_tokens=last_sampled,
        draft_tokens=draft_tokens,
        prefill_len=SimpleNamespace(gpu=torch.full((MAX_REQS,), len(PROMPT), dtype=torch.int32)),
    )


def _model_state():
    """Qwen4Exp's own model state class, its GDN and PLE buffers as __init__ makes them."""
    import torch
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    state = Qwen4ExpModelState.__new__(Qwen4ExpModelState)
    state.num_accepted_tokens_gpu = torch.ones(MAX_REQS, dtype=torch.int32)
    state.recoverssm = None
    state._align_mode = False
    state.uses_ngram_embedding = True
    state.ngram_context_len = 2  # ngram_size 3
    state.ngram_eos_token_id = EOS
    state.ngram_context = torch.full((MAX_REQS, 2), EOS, dtype=torch.int32)
    state.ngram_context_offsets = torch.arange(-2, 0, dtype=torch.int64)
    return state


def _decode_batch(query_len: int):
    """The step's InputBatch fields the PP path reads: one decode request."""
    import torch

    return SimpleNamespace(
        req_ids=["r"],
        num_reqs=1,
        idx_mapping=torch.tensor([REQ], dtype=torch.int32),
        idx_mapping_np=np.array([REQ], dtype=np.int32),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32),
        num_scheduled_tokens=np.array([query_len], dtype=np.int32),
        num_computed_tokens_np=np.array([len(PROMPT)], dtype=np.int32),
        prefill_len_np=np.array([len(PROMPT)], dtype=np.int32),
        is_prefilling_np=np.array([False]),
        max_seq_len_np=np.array([MAX_LEN], dtype=np.int32),
        num_draft_tokens=query_len - 1,
    )


def _runner(v2, rank: int):
    import torch
    from vllm.v1.worker.gpu.kv_connector import NO_OP_KV_CONNECTOR
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    v2.monkeypatch.setattr(v2.pp_utils, "get_pp_group", lambda: _pp_group(rank))
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.is_last_pp_rank = rank == LAST
    runner.pp_handler = v2.pp_utils.PPHandler(
        max_num_reqs=MAX_REQS, num_speculative_steps=NUM_SPEC, device=torch.device("cpu")
    )
    runner.req_states = _request_state()
    runner.model_state = _model_state()
    runner.pcp_manager = None
    runner.kv_connector = NO_OP_KV_CONNECTOR
    runner.eplb = SimpleNamespace(step=lambda **kwargs: None)
    runner.sampler = SimpleNamespace(penalties_state=SimpleNamespace(output_bin_counts=None))
    return runner


def _execute_state(batch):
    from vllm.v1.worker.gpu.model_runner import ExecuteModelState

    return ExecuteModelState(
        input_batch=batch,
        attn_metadata=None,
        slot_mappings_by_layer=None,
        hidden_states=None,
        aux_hidden_states=None,
        dp_sync_state=None,
        finished_req_ids=set(),
        ec_connector_output=None,
        cudagraph_stats=None,
        num_spec_tokens_to_schedule=NUM_SPEC,
    )


def _last_rank_step(v2, batch):
    """The last rank's side of the step, in sample_tokens' order: broadcast the
    sampled tokens, update its own state, propose, broadcast the drafts."""
    import torch

    last = _runner(v2, LAST)
    v2.wire.rank = LAST
    sampled = torch.tensor([SAMPLED], dtype=torch.int64)
    num_sampled = torch.tensor([NUM_SAMPLED], dtype=torch.int32)
    num_rejected = torch.tensor([NUM_REJECTED], dtype=torch.int32)
    last.pp_handler.broadcast(sampled, num_sampled, num_rejected, batch)
    last.postprocess_sampled(
        batch.idx_mapping, sampled, num_sampled, num_rejected, batch.query_start_loc
    )
    drafts = torch.tensor([NEW_DRAFTS], dtype=torch.int64)  # the speculator's proposal
    last.req_states.draft_tokens[batch.idx_mapping] = drafts
    last.pp_handler.broadcast_drafts(last.req_states.draft_tokens[batch.idx_mapping])
    return last


def _next_step_inputs(runner, query_len: int):
    """Rank 0's input ids, positions and n-gram context for the request's next step."""
    import torch
    from vllm.v1.worker.gpu.input_batch import (
        combine_sampled_and_draft_tokens,
        prepare_pos_seq_lens,
    )

    rs = runner.req_states
    batch = _decode_batch(query_len)
    positions = torch.zeros(8, dtype=torch.int64)
    seq_lens = torch.zeros(MAX_REQS, dtype=torch.int32)
    prepare_pos_seq_lens(
        batch.idx_mapping, batch.query_start_loc, rs.num_computed_tokens.gpu, positions, seq_lens
    )
    input_ids = torch.zeros(8, dtype=torch.int32)
    combine_sampled_and_draft_tokens(
        input_ids,
        batch.idx_mapping,
        rs.last_sampled_tokens,
        batch.query_start_loc,
        seq_lens,
        rs.prefill_len.gpu,
        rs.draft_tokens,
        torch.tensor([0, query_len], dtype=torch.int32),
        query_len,
    )
    context = runner.model_state._prepare_ngram_context(batch, rs)
    # One row per batch index (the request is batch row 0).
    return input_ids[:query_len].tolist(), positions[:query_len].tolist(), context[0].tolist()


def test_sampled_tokens_go_at_the_fixed_width(v2) -> None:
    """_sample_len: num_speculative_tokens + 1 columns whenever drafts were verified."""
    v2.monkeypatch.setattr(v2.pp_utils, "get_pp_group", lambda: _pp_group(0))
    import torch

    handler = v2.pp_utils.PPHandler(
        max_num_reqs=MAX_REQS, num_speculative_steps=NUM_SPEC, device=torch.device("cpu")
    )
    assert handler._sample_len(_decode_batch(NUM_SPEC + 1)) == NUM_SPEC + 1
    assert handler._sample_len(_decode_batch(1)) == 1


def test_rank0_catches_up_after_a_rejection(v2) -> None:
    batch = _decode_batch(query_len=1 + NUM_SPEC)
    rank0 = _runner(v2, 0)

    # Step T: rank 0 ran its layers, then (sample_tokens, non-last branch)
    # posts the receive and counts all 3 query tokens as computed.
    rank0.update_pp_decode_requests()
    last = _last_rank_step(v2, batch)
    v2.wire.rank = 0
    rank0.execute_model_state = _execute_state(batch)
    rank0.sample_tokens(None)
    assert v2.wire.sent == [], "rank 0 did not take every broadcast of the step"
    rs = rank0.req_states
    assert rs.num_computed_tokens.gpu[REQ].item() == len(PROMPT) + 3  # optimistic

    # Steps T+1, T+2: the other two micro-batches; this request's outputs wait.
    for _ in range(PP_SIZE - 1):
        rank0.update_pp_decode_requests()
        assert rs.num_computed_tokens.gpu[REQ].item() == len(PROMPT) + 3
        assert rs.draft_tokens[REQ].tolist() == OLD_DRAFTS

    # Step T+3, before the request's next inputs are built.
    rank0.update_pp_decode_requests()

    lrs = last.req_states
    # One rejected draft: 2 of the 3 positions stay computed, on both ranks.
    assert rs.num_computed_tokens.gpu[REQ].item() == len(PROMPT) + 2
    assert torch_equal(rs.num_computed_tokens.gpu, lrs.num_computed_tokens.gpu)
    # The GDN kernels continue from the state after 2 accepted tokens.
    assert rank0.model_state.num_accepted_tokens_gpu[REQ].item() == NUM_SAMPLED
    assert torch_equal(
        rank0.model_state.num_accepted_tokens_gpu, last.model_state.num_accepted_tokens_gpu
    )
    # Token history and the drafts, as the last rank has them.
    assert rs.last_sampled_tokens[REQ].item() == 300
    assert rs.draft_tokens[REQ].tolist() == NEW_DRAFTS
    for name in ("last_sampled_tokens", "draft_tokens"):
        assert torch_equal(getattr(rs, name), getattr(lrs, name)), name
    assert rs.total_len.gpu[REQ].item() == len(PROMPT) + 1 + NUM_SAMPLED
    assert torch_equal(rs.all_token_ids.gpu, lrs.all_token_ids.gpu)

    # The next step on rank 0 embeds the real ids: last sampled + the drafts,
    # at the corrected positions, with the PLE context of the accepted tokens.
    ids, positions, context = _next_step_inputs(rank0, query_len=1 + NUM_SPEC)
    assert ids == [300, *NEW_DRAFTS]
    assert positions == [12, 13, 14]
    assert context == [FIRST_SAMPLED, 201]  # positions 10, 11; not the rejected 202


def test_a_step_without_drafts_broadcasts_none(v2) -> None:
    """num_spec_tokens 0 (e.g. skip_drafts): width 1 and no draft broadcast."""
    import torch

    batch = _decode_batch(query_len=1)
    last = _runner(v2, LAST)
    v2.wire.rank = LAST
    last.pp_handler.broadcast(
        torch.tensor([[300]]), torch.tensor([1], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32), batch,
    )  # fmt: skip
    rank0 = _runner(v2, 0)
    v2.wire.rank = 0
    state = _execute_state(batch)._replace(num_spec_tokens_to_schedule=0)
    rank0.execute_model_state = state
    rank0.sample_tokens(None)
    assert v2.wire.sent == []
    pending = rank0.pp_handler.queue[-1]
    assert tuple(pending.sampled_tokens.shape) == (1, 1)
    assert pending.draft_tokens is None


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
