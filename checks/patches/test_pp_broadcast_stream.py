"""Patch 0005: the V2 runner's PP token broadcast orders after the step's stream.

Stock vLLM 0.33.0's `PPHandler` (v1/worker/gpu/pp_utils.py) looks up
`torch.cuda.current_stream()` once, in `__init__`, and orders its side
stream after that stream. The model runner builds the handler while torch's
default stream is current; vLLM's `current_stream()` (utils/torch_utils.py)
then makes a stream of its own current on first use, and the steps run
there. The side stream keeps waiting on the default stream, which orders
nothing: with three ranks on one H200 (issue 24, checks/gpu/pp3) ranks 0 and
1 consumed stale fp32 bit patterns as sampled tokens and counts, and the
engine crashed. The patch looks `current_stream()` up at each call.

The proofs build the handlers while stream A (torch's default) is current,
let vLLM's `current_stream()` make its stream B current as on a CUDA worker,
then run one step of test_v2_pp_spec_decode's PP=3 MTP case (2 drafts
verified): the last rank's `broadcast` and `broadcast_drafts`, rank 0's
`receive` and, pp_size steps later, its `get_prev_sampled_outputs`. Each of
the three broadcasting calls must order the side stream after B before it
issues a broadcast; rank 0's receive buffers must be record_stream'd on B;
B must wait on the slot's event; and no call of the handlers names A.

Real code run: `PPHandler` (`__init__`, `broadcast`, `broadcast_drafts`,
`receive`, `get_prev_sampled_outputs`, `compute_need_sampled_mask`) and
vLLM's `current_stream()` with its `torch.cuda.set_stream` wrapper, on the
first-use branch a CUDA worker takes (the CPU platform answers `is_cuda()`
True for that one call).

Replayed, not real: CUDA streams and events (cuda_stream_replay.py: streams
with identity, the current stream per thread, every wait and record_stream
logged), the broadcast (test_v2_pp_spec_decode's `Wire`: the last rank's
tensors are handed to rank 0's receive in order; each call also logs the
stream current when it is issued), the PP group (rank, size, the sibling
group's name) and the InputBatch (test_v2_pp_spec_decode's one decode request).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cuda_stream_replay import Op, cuda_worker_stream, install
from test_v2_pp_spec_decode import (
    LAST,
    MAX_REQS,
    NEW_DRAFTS,
    NUM_REJECTED,
    NUM_SAMPLED,
    NUM_SPEC,
    PP_SIZE,
    SAMPLED,
    Wire,
    _decode_batch,
    _pp_group,
)

PATCH = "0005-v2-runner-pp-broadcast-orders-after-current-stream.patch"


@pytest.fixture
def pp(monkeypatch: pytest.MonkeyPatch):
    import torch
    import vllm.v1.worker.gpu.pp_utils as pp_utils

    streams = install(monkeypatch)
    wire = Wire()

    def broadcast(tensor, src, group=None) -> None:
        streams.log.append(Op("broadcast", streams.current_stream(), tensor))
        wire.broadcast(tensor, src, group)

    monkeypatch.setattr(torch.distributed, "broadcast", broadcast)
    return SimpleNamespace(pp_utils=pp_utils, streams=streams, wire=wire, monkeypatch=monkeypatch)


def _handler(pp, rank: int):
    import torch

    pp.monkeypatch.setattr(pp.pp_utils, "get_pp_group", lambda: _pp_group(rank))
    return pp.pp_utils.PPHandler(
        max_num_reqs=MAX_REQS, num_speculative_steps=NUM_SPEC, device=torch.device("cpu")
    )


def _logged(pp, call, *args):
    """call(*args) and the ops it logged."""
    start = len(pp.streams.log)
    result = call(*args)
    return result, pp.streams.log[start:]


def _ordering_problems(ops: list[Op], side, step, default, name: str) -> list[str]:
    """What is wrong with a broadcasting call's ops: it must broadcast on the
    side stream after making it wait on the step's stream (only), and never
    name the default stream."""
    casts = [i for i, op in enumerate(ops) if op.what == "broadcast"]
    if not casts:
        return [f"{name} issued no broadcast"]
    problems = []
    if {ops[i].stream for i in casts} != {side}:
        problems.append(f"{name} broadcast off the side stream {side}")
    waits = [(op.stream, op.on) for op in ops[: casts[0]] if op.what == "wait_stream"]
    if waits != [(side, step)]:
        problems.append(f"{name}: before broadcasting, waits {waits}, not [({side}, {step})]")
    problems += [f"{name} names {default}: {op}" for op in ops if op.touches(default)]
    return problems


def _last_rank_broadcasts(pp, last, batch):
    """The last rank's calls of the step, in sample_tokens' order; their ops."""
    import torch

    pp.wire.rank = LAST
    _, sent = _logged(
        pp,
        last.broadcast,
        torch.tensor([SAMPLED], dtype=torch.int64),
        torch.tensor([NUM_SAMPLED], dtype=torch.int32),
        torch.tensor([NUM_REJECTED], dtype=torch.int32),
        batch,
    )
    _, drafted = _logged(pp, last.broadcast_drafts, torch.tensor([NEW_DRAFTS], dtype=torch.int64))
    return sent, drafted


def test_vllm_current_stream_sees_the_replayed_streams(pp) -> None:
    """The replay as vLLM's current_stream() meets it (no patch involved)."""
    import torch
    from vllm.utils.torch_utils import current_stream

    default = pp.streams.default
    assert torch.cuda.current_stream() is default
    step = cuda_worker_stream(pp.monkeypatch)
    assert step is not default
    assert current_stream() is step and torch.cuda.current_stream() is step
    assert [(op.what, op.stream, op.on) for op in pp.streams.log] == [
        ("wait_stream", step, default)
    ]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream() is side and torch.cuda.current_stream() is side
    assert current_stream() is step and torch.cuda.current_stream() is step


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_last_rank_broadcasts_after_the_step_stream(pp) -> None:
    last = _handler(pp, LAST)  # built while torch's default stream is current
    default = pp.streams.default
    step = cuda_worker_stream(pp.monkeypatch)

    sent, drafted = _last_rank_broadcasts(pp, last, _decode_batch(query_len=1 + NUM_SPEC))

    side = last.broadcast_stream
    problems = _ordering_problems(sent, side, step, default, "broadcast")
    problems += _ordering_problems(drafted, side, step, default, "broadcast_drafts")
    assert not problems, "\n".join(problems)


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_receiving_rank_orders_and_waits_on_the_step_stream(pp) -> None:
    rank0 = _handler(pp, 0)  # both built while torch's default stream is current
    last = _handler(pp, LAST)
    default = pp.streams.default
    step = cuda_worker_stream(pp.monkeypatch)
    batch = _decode_batch(query_len=1 + NUM_SPEC)

    # Step T: rank 0 consumes the slot of step T - pp_size (none yet), the
    # last rank broadcasts, rank 0 posts its receive (recv_drafts: MTP).
    assert rank0.get_prev_sampled_outputs() is None
    _last_rank_broadcasts(pp, last, batch)
    pp.wire.rank = 0
    _, received = _logged(pp, rank0.receive, batch, True)
    assert pp.wire.sent == [], "rank 0 did not take every broadcast of the step"
    slot = rank0.queue[-1]
    events = [op.on for op in received if op.what == "record_event"]
    assert events == [slot.event] and slot.event.stream is rank0.broadcast_stream

    # Steps T+1 .. T+pp_size-1: other micro-batches; step T+pp_size takes the slot.
    for _ in range(PP_SIZE - 1):
        assert rank0.get_prev_sampled_outputs() is None
    outputs, consumed = _logged(pp, rank0.get_prev_sampled_outputs)
    assert outputs["sampled_tokens"].tolist() == [SAMPLED]
    assert outputs["draft_tokens"].tolist() == [NEW_DRAFTS]

    problems = _ordering_problems(received, rank0.broadcast_stream, step, default, "receive")
    # The buffers come from the side stream's pool and are read on the step's.
    buffers = [slot.sampled_tokens, slot.num_sampled._base, slot.draft_tokens]
    kept = [op for op in received if op.what == "record_stream"]
    if [id(op.on) for op in kept] != [id(t) for t in buffers]:
        problems.append(f"receive record_stream'd {len(kept)} tensors, not its 3 buffers")
    if [op.stream for op in kept] != [step] * 3:
        problems.append(f"receive record_stream'd its buffers on {[op.stream for op in kept]}")
    waits = [(op.what, op.stream, op.on) for op in consumed]
    if waits != [("wait_event", step, slot.event)]:
        problems.append(f"get_prev_sampled_outputs: {waits}, not {step} waiting {slot.event}")
    assert not problems, "\n".join(problems)
