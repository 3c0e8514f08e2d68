"""Worker-side hooks for the PP=3 harness, sent to every vLLM worker through
`LLM.collective_rpc` (so they run in the rank's own process, PP=1 or PP=3).

Layer capture: forward hooks on each decoder layer this rank holds and on its
parts, every one keyed by token, so runs that batch tokens differently (PP=3
interleaves requests across steps) are still compared token by token:

    layer.N.gdn / .qsa / .moe / .ple   what that part returned
    layer.N.out                        the layer's residual, materialized
                                       (qwen4_exp hands the next layer a delayed
                                       combine; PP materializes it at a stage
                                       boundary, so that is what is comparable)
    final                              the inner model's output (last rank)

At the layers that start a PP=3 rank (4 and 8 of 12), in PP=1 and PP=3 alike:

    layer.N.in         the layer's input, materialized (PP=3: what the rank
                       received; PP=1: the pending combine, done here)
    layer.N.mix        the block input the HC module mixes from that
                       materialized input: what PP=3 computes
    layer.N.mix_fused  PP=1 only: the block input as PP=1 computes it, the
                       combine fused with the HC norm (hc_combine_norm)

A token's key is (position, input id): prompts are distinct random ids, and a
key seen twice in one engine (a collision or a padded row) is dropped by the
comparison.

The schedule as the rank saw it (point `#steps`): for every row of every
step, the step's number and its token count, so compare.py can tell each
row's prefill chunk and batch apart between engines (`row_contexts`) and
which rows past the prompt are an MTP verify step's draft positions
(`row_kinds`). And the Triton autotuners' choices in this process (`dump`'s
`autotune`): the FLA GDN kernels pick their config by timing, once per
process, so two engines can run the same GDN with different configs.

Captured rows are cloned on the GPU in the forward's stream (no
host sync, so the hooks cannot hide a race) and copied to the host only by
`dump`, between generate calls.

Sync probes (`install_sync`) are the bisection tool for the V2 runner crash:
each adds torch.cuda.synchronize() at one place; the place whose sync makes
the crash go away bounds where the unsynchronized read is.
"""

from __future__ import annotations

import math
from typing import Any

_STATE: dict[str, Any] = {
    "on": False,
    "rows": {},
    "hooks": [],
    "keys": None,
    "keep": None,
    "step": 0,
    "errors": [],  # what a diagnostic hook met, reported by dump instead of raised
}

STEPS = "#steps"  # per row: (step number, the step's token count); never thinned


def _rank() -> int:
    from vllm.distributed.parallel_state import get_pp_group

    return get_pp_group().rank_in_group


def _inner_model(worker):
    model = worker.model_runner.model
    for attr in ("language_model", "model"):
        while hasattr(model, attr) and not hasattr(model, "layers"):
            model = getattr(model, attr)
    return model


def _keys(positions, input_ids):
    pos = positions[0] if positions.dim() == 2 else positions
    return pos.detach().to("cuda").long().clone(), input_ids.detach().long().clone()


def _store(name: str, tensor) -> None:
    if not _STATE["on"] or _STATE["keys"] is None:
        return
    pos, ids = _STATE["keys"]
    rows = tensor.detach()
    n = min(rows.shape[0], pos.shape[0])
    pos, ids, rows = pos[:n], ids[:n], rows[:n]
    if _STATE["keep"] is not None:
        every, tail_from = _STATE["keep"]
        kept = ((pos % every) == 0) | (pos >= tail_from)
        # The rows left out still say whether they differ: an exact integer
        # fingerprint of their bytes (FINGERPRINT suffix), so a comparison
        # finds the first parting position among all rows, not only the kept.
        _STATE["rows"].setdefault(name + FINGERPRINT, []).append(
            (pos[~kept], ids[~kept], _fingerprint(rows[~kept]))
        )
        pos, ids, rows = pos[kept], ids[kept], rows[kept]
    _STATE["rows"].setdefault(name, []).append((pos, ids, rows.clone()))


FINGERPRINT = "#fp"


def _fingerprint(rows):
    """One int64 per row from its bytes, exact: equal rows, equal prints."""
    import torch

    # The width from the shape, not -1: a step whose rows are all kept (a
    # decode step) leaves zero rows here, and reshape cannot infer -1 from 0.
    width = math.prod(rows.shape[1:]) * rows.element_size()
    data = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], width).long()
    weights = (torch.arange(data.shape[1], device=data.device) * 2654435761 + 1) % 2147483647
    return (data * weights).sum(dim=1, keepdim=True)


# MTP verify rows at a rank's first GDN layer: the step's GDN metadata per row
# (run e2: rejected draft rows parted at 20000x4 where every other row agreed).
SPEC = "#spec"
SPEC_FIELDS = (
    "num_prefills", "num_decodes", "num_spec_decodes", "num_actual_tokens",
    "sequence_tokens", "offset", "num_accepted_tokens",
)  # fmt: skip


def spec_rows(meta, pos, ids):
    """The rows of a GDN step's spec-decode sequences (the verified token and
    its drafts): (positions, ids, one int row of SPEC_FIELDS each), or None
    when the step has none. Indices past the keys are left out rather than
    read: a device assert would end the engine."""
    import torch

    if meta is None or not meta.num_spec_decodes or meta.spec_token_indx is None:
        return None
    idx = meta.spec_token_indx.long()
    starts = meta.spec_query_start_loc.long()
    k = torch.arange(idx.numel(), device=idx.device)
    seq = (torch.searchsorted(starts, k, right=True) - 1).clamp(0, starts.numel() - 2)
    lengths = (starts[1:] - starts[:-1])[seq]
    accepted = meta.num_accepted_tokens
    accepted = (
        torch.full_like(k, -1)
        if accepted is None
        else accepted.long()[seq.clamp(max=accepted.numel() - 1)]
    )
    counts = [meta.num_prefills, meta.num_decodes, meta.num_spec_decodes, meta.num_actual_tokens]
    ints = torch.cat(
        [
            torch.tensor(counts, device=idx.device).expand(k.numel(), 4),
            torch.stack([lengths, k - starts[seq], accepted], dim=1),
        ],
        dim=1,
    )
    keep = idx < pos.numel()
    return pos[idx[keep]], ids[idx[keep]], ints[keep]


def _as_rows(tensor):
    """One row per token, its values flat; the width from the shape, as in
    _fingerprint, so that a part with no rows still concatenates."""
    return tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))


def _store_step() -> None:
    """One step's rows as the rank's first layer sees them: (step, tokens) per
    row, on the GPU (no host sync)."""
    import torch

    if not _STATE["on"] or _STATE["keys"] is None:
        return
    pos, ids = _STATE["keys"]
    _STATE["step"] += 1
    n = pos.shape[0]
    info = torch.empty((n, 2), dtype=torch.long, device=pos.device)
    info[:, 0] = _STATE["step"]
    info[:, 1] = n
    _STATE["rows"].setdefault(STEPS, []).append((pos, ids, info))


def step_pre(module, args, kwargs):
    _store_step()


def _tuner(obj):
    """The Triton autotuner behind a module-level object, or None.

    The autotuner may sit under other decorators: FLA's GDN kernels are
    `@triton.heuristics(...)` over `@triton.autotune(...)`, so the module
    holds a Heuristics whose `fn` is the Autotuner (run e2 found none for
    want of this). vLLM's placeholder modules (optional packages such as
    runai_model_streamer) raise ModuleNotFoundError on any attribute, so
    every probe is guarded."""
    for _ in range(4):  # decorators deep
        try:
            cache = getattr(obj, "cache", None)
            if isinstance(cache, dict) and hasattr(obj, "configs") and hasattr(obj, "fn"):
                return obj
            obj = getattr(obj, "fn", None)
        except Exception:  # noqa: BLE001 - a module-level object that is not a tuner
            return None
        if obj is None:
            return None
    return None


def _tuners() -> dict[str, Any]:
    """Every Triton autotuner vLLM's loaded modules hold: {module.kernel: tuner}."""
    import sys

    found: dict[str, Any] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("vllm") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            tuner = _tuner(obj)
            if tuner is not None:
                found[f"{mod_name}.{attr}"] = tuner
    return dict(sorted(found.items()))


ONLY_CONFIG = "only config"


def autotune_choices() -> dict[str, dict[str, str]]:
    """The config each autotuner chose per key (its `cache`), for those that
    have tuned: {module.kernel: {key: config}}. One left with a single
    config (pinned, or written so) never fills its cache: it reports that
    config under ONLY_CONFIG, so two pinned engines' records compare."""
    found = {}
    for name, tuner in _tuners().items():
        if tuner.cache:
            found[name] = {str(k): str(v) for k, v in tuner.cache.items()}
        elif len(tuner.configs) == 1:
            found[name] = {ONLY_CONFIG: str(tuner.configs[0])}
    return found


def pin_autotune(worker) -> dict[str, str]:
    """Every autotuner from now on runs its first listed config, untimed.

    An autotuner picks by timing, and three engines timing on one GPU can
    pick differently, each config rounding its own way: the engines'
    layers then part where their inputs are equal. Pinned alike in every
    engine, the configs cannot part them. What was tuned before (the
    warm-up, graphs already captured) is forgotten or kept as it is; the
    cases run after. Returns {module.kernel: the pinned config}."""
    pinned = {}
    for name, tuner in _tuners().items():
        tuner.configs = tuner.configs[:1]  # one config: Triton runs it without timing
        tuner.cache.clear()
        pinned[name] = str(tuner.configs[0])
    return pinned


def install_capture(worker) -> dict[str, Any]:
    """Hook every decoder layer this rank runs, and its parts."""
    model = _inner_model(worker)
    start, end = model.start_layer, model.end_layer
    hooks = _STATE["hooks"]

    def layer_pre(module, args, kwargs):
        positions = kwargs.get("positions", args[3] if len(args) > 3 else None)
        input_ids = kwargs.get("input_ids")
        if positions is None or input_ids is None:
            _STATE["keys"] = None  # no raw ids on this rank: nothing keyed to store
        else:
            _STATE["keys"] = _keys(positions, input_ids)

    def layer_post(index):
        def hook(module, args, kwargs, output):
            hidden, block_output, injection = output
            if block_output is not None:
                hidden = module.mlp_hyper_connection.combine(hidden, block_output, injection)
            _store(f"layer.{index}.out", hidden)

        return hook

    def part(name):
        def hook(module, args, output):
            _store(name, output[0] if isinstance(output, tuple) else output)

        return hook

    def boundary_pre(index):
        def hook(module, args, kwargs):
            if not _STATE["on"]:
                return
            hidden = kwargs["hidden_states"]
            block_output, injection = kwargs.get("prev_block_output"), kwargs.get("prev_injection")
            attn_hc = module.attn_hyper_connection
            if block_output is not None:
                hidden = model.layers[index - 1].mlp_hyper_connection.combine(
                    hidden, block_output, injection
                )
                fused = attn_hc.combine_and_mix(kwargs["hidden_states"], block_output, injection)
                _store(f"layer.{index}.mix_fused", fused[1])
            _store(f"layer.{index}.in", hidden)
            _store(f"layer.{index}.mix", attn_hc.mix(hidden)[1])

        return hook

    def spec_pre(module, args):
        # A diagnosis must not end the engine: an error is kept and reported.
        if not _STATE["on"] or _STATE["keys"] is None:
            return
        try:
            from vllm.forward_context import get_forward_context

            metadata = get_forward_context().attn_metadata
            meta = metadata.get(module.prefix) if isinstance(metadata, dict) else None
            rows = spec_rows(meta, *_STATE["keys"])
        except Exception as exc:  # noqa: BLE001
            _STATE["errors"].append(f"{SPEC}: {type(exc).__name__}: {exc}")
            return
        if rows is not None:
            _STATE["rows"].setdefault(SPEC, []).append(rows)

    # The model's first GDN layer only (rank 0's): one record per row, as at PP=1.
    first_gdn = next(
        (i for i, layer in enumerate(model.layers) if getattr(layer, "linear_attn", None)), None
    )
    if first_gdn is not None and start <= first_gdn < end:
        hooks.append(model.layers[first_gdn].linear_attn.register_forward_pre_hook(spec_pre))

    from vllm.distributed.utils import get_pp_indices

    # Layer 0's input too (the embedding): where a draft row parts at layer
    # 0's GDN (e3), whether its input already did is then measured.
    boundaries = {0} | {get_pp_indices(len(model.layers), rank, 3)[0] for rank in (1, 2)}
    for index in range(start, end):
        layer = model.layers[index]
        hooks.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
        if index == start:
            hooks.append(layer.register_forward_pre_hook(step_pre, with_kwargs=True))
        if index in boundaries and getattr(layer, "ple", None) is None:
            hooks.append(layer.register_forward_pre_hook(boundary_pre(index), with_kwargs=True))
        hooks.append(layer.register_forward_hook(layer_post(index), with_kwargs=True))
        for attr, tag in (
            ("linear_attn", "gdn"),
            ("self_attn", "qsa"),
            ("mlp", "moe"),
            ("ple", "ple"),
        ):
            sub = getattr(layer, attr, None)
            if sub is not None:
                hooks.append(sub.register_forward_hook(part(f"layer.{index}.{tag}")))
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_last_rank:
        hooks.append(model.register_forward_hook(lambda m, a, out: _store("final", out)))
    return {"rank": _rank(), "layers": [start, end], "boundaries": sorted(boundaries)}


def start(worker, keep_every: int = 1, tail_from: int = 0) -> int:
    """Capture from now on: every row, or (keep_every > 1, for long prompts)
    the rows whose position is a multiple of keep_every or at least tail_from
    (the decode steps), so a 20,000-token case fits the host."""
    _STATE["rows"].clear()
    _STATE["keep"] = (keep_every, tail_from) if keep_every > 1 else None
    _STATE["step"] = 0
    _STATE["on"] = True
    return _rank()


def dump(worker, path: str) -> dict[str, Any]:
    """Stop capturing; write {point: (positions, ids, rows)} for this rank to
    PATH.rank{R}.pt (rows as float32 on the host; fingerprints and `#steps`
    as integers) and say how many, and the autotuners' choices so far."""
    import torch

    _STATE["on"] = False
    out: dict[str, tuple] = {}
    for name, parts in _STATE["rows"].items():
        pos = torch.cat([p for p, _, _ in parts]).cpu()
        ids = torch.cat([i for _, i, _ in parts]).cpu()
        rows = torch.cat([_as_rows(r) for _, _, r in parts]).cpu()
        exact = name.endswith(FINGERPRINT) or name in (STEPS, SPEC)
        out[name] = (pos, ids, rows if exact else rows.float())
    _STATE["rows"].clear()
    rank = _rank()
    target = f"{path}.rank{rank}.pt"
    torch.save(out, target)
    errors, _STATE["errors"] = _STATE["errors"], []
    return {
        "rank": rank,
        "points": len(out),
        "file": target,
        "autotune": autotune_choices(),
        "errors": errors[:20],
    }


# --- sync probes for the crash bisection -------------------------------------


def _sync():
    import torch

    torch.cuda.synchronize()


def install_sync(worker, where: str) -> str:
    """torch.cuda.synchronize() at one place of every step on this rank."""
    import vllm.v1.worker.gpu_worker as gw

    runner = worker.model_runner
    if where == "none":
        return where
    if where == "recv":
        real_wait = gw.AsyncIntermediateTensors.wait_for_comm

        def wait_then_sync(self):
            real_wait(self)
            _sync()

        gw.AsyncIntermediateTensors.wait_for_comm = wait_then_sync
    elif where in ("pre_forward", "post_forward"):
        model = runner.model
        if where == "pre_forward":
            model.register_forward_pre_hook(lambda m, a: _sync())
        else:
            model.register_forward_hook(lambda m, a, o: _sync())
    elif where == "step_start":
        real = runner.execute_model

        def synced(*args, **kwargs):
            _sync()
            return real(*args, **kwargs)

        runner.execute_model = synced
    elif where == "sample":
        real = runner.sample_tokens

        def synced_sample(*args, **kwargs):
            result = real(*args, **kwargs)
            _sync()
            return result

        runner.sample_tokens = synced_sample
    elif where == "layers":
        # Sync before and after every decoder layer and part; name the first
        # module whose kernels fail (the error surfaces at its sync).
        model = _inner_model(worker)

        def named(name):
            def pre(m, a):
                try:
                    _sync()
                except Exception as exc:
                    print(
                        f"pp3 sync probe: error before {name} on rank {_rank()}: {exc}", flush=True
                    )
                    raise

            def post(m, a, o):
                try:
                    _sync()
                except Exception as exc:
                    print(f"pp3 sync probe: error in {name} on rank {_rank()}: {exc}", flush=True)
                    raise

            return pre, post

        for index in range(model.start_layer, model.end_layer):
            layer = model.layers[index]
            for attr in ("ple", "linear_attn", "self_attn", "mlp", None):
                sub = layer if attr is None else getattr(layer, attr, None)
                if sub is None:
                    continue
                pre, post = named(f"layer.{index}.{attr or 'all'}")
                sub.register_forward_pre_hook(pre)
                sub.register_forward_hook(post)
    elif where in _PROBES:
        for install in _PROBES[where]:
            install(runner)
    else:
        raise ValueError(f"unknown sync probe {where!r}")
    return where


def _queue(runner) -> object:
    """The PP receive ring as request indices per slot (None: nothing pending)."""
    if runner.pp_handler is None:
        return "-"
    return [None if s is None else s.idx_mapping_np.tolist() for s in runner.pp_handler.queue]


def _install_trace(runner) -> None:
    """Log each step's request bookkeeping on this rank, read after a sync:
    the GPU's num_computed_tokens / total_len next to the CPU mirror, and each
    consumed PP receive slot."""
    import torch

    rank = _rank()
    state = {"step": 0}
    req = runner.req_states
    real_execute = runner.execute_model

    def traced_execute(scheduler_output, *args, **kwargs):
        if not kwargs.get("dummy_run"):
            torch.cuda.synchronize()
            state["step"] += 1
            print(
                f"pp3 trace rank {rank} step {state['step']}: scheduled "
                f"{dict(scheduler_output.num_scheduled_tokens)} "
                f"computed_gpu {req.num_computed_tokens.gpu[:4].tolist()} "
                f"computed_np {req.num_computed_tokens_np[:4].tolist()} "
                f"total_len {req.total_len.gpu[:4].tolist()} "
                f"prefill_len {req.prefill_len.np[:4].tolist()} queue {_queue(runner)}",
                flush=True,
            )
        return real_execute(scheduler_output, *args, **kwargs)

    runner.execute_model = traced_execute
    if runner.pp_handler is not None:
        handler = runner.pp_handler
        real_get = handler.get_prev_sampled_outputs

        def traced_get():
            out = real_get()
            if out is not None:
                torch.cuda.synchronize()
                print(
                    f"pp3 trace rank {rank} consume: idx {out['idx_mapping'].tolist()} "
                    f"sampled {out['sampled_tokens'].tolist()} "
                    f"num_sampled {out['num_sampled'].tolist()} "
                    f"num_rejected {out['num_rejected'].tolist()}",
                    flush=True,
                )
            return out

        handler.get_prev_sampled_outputs = traced_get


def _install_trace2(runner) -> None:
    """What the last rank broadcasts and what the others hold right after
    receiving it (after a sync), beside the consume trace."""
    import torch

    _install_trace(runner)
    handler, rank = runner.pp_handler, _rank()
    if handler is None:
        return
    if handler.is_last_rank:
        real_broadcast = handler.broadcast

        def traced_broadcast(sampled, num_sampled, num_rejected, input_batch):
            torch.cuda.synchronize()
            print(
                f"pp3 trace rank {rank} send: sampled {sampled.tolist()} "
                f"num_sampled {num_sampled.tolist()} num_rejected {num_rejected.tolist()}",
                flush=True,
            )
            return real_broadcast(sampled, num_sampled, num_rejected, input_batch)

        handler.broadcast = traced_broadcast
    else:
        real_receive = handler.receive

        def traced_receive(input_batch, recv_drafts):
            result = real_receive(input_batch, recv_drafts)
            slot = handler.queue[-1]
            if slot is not None:
                torch.cuda.synchronize()
                print(
                    f"pp3 trace rank {rank} received: sampled {slot.sampled_tokens.tolist()} "
                    f"num_sampled {slot.num_sampled.tolist()}",
                    flush=True,
                )
            return result

        handler.receive = traced_receive


def _receive_into(handler, buffers_for) -> None:
    """Make the handler's real receive() broadcast into the tensors
    buffers_for(input_batch) returns (in its torch.empty order: the sampled
    tokens, then num_sampled/num_rejected), leaving the rest of it as it is."""
    import torch

    real_empty, real_receive = torch.empty, handler.receive

    def receive(input_batch, recv_drafts):
        handed = list(buffers_for(input_batch))

        def take(*args, **kwargs):
            if handed and kwargs.get("device") is not None:
                return handed.pop(0)
            return real_empty(*args, **kwargs)

        torch.empty = take
        try:
            return real_receive(input_batch, recv_drafts)
        finally:
            torch.empty = real_empty

    handler.receive = receive


def _install_recv_on_main_stream(runner) -> None:
    """Candidate fix A: the receive buffers come from the main stream's pool
    (allocated before the side stream starts), not the side stream's."""
    import torch

    handler = runner.pp_handler
    if handler is None or handler.is_last_rank:
        return

    def from_main_stream(input_batch):
        n, width = input_batch.num_reqs, handler._sample_len(input_batch)
        with torch.cuda.stream(torch.cuda.current_stream(handler.device)):
            return [
                torch.empty(n, width, dtype=torch.int64, device=handler.device),
                torch.empty(2, n, dtype=torch.int32, device=handler.device),
            ]

    _receive_into(handler, from_main_stream)


def _install_send_holds_buffers(runner) -> None:
    """Candidate fix B: the last rank broadcasts copies it made on the main
    stream and keeps them alive for pp_size + 1 steps."""
    import collections

    handler = runner.pp_handler
    if handler is None or not handler.is_last_rank:
        return
    held = collections.deque(maxlen=8)
    real_broadcast = handler.broadcast

    def broadcast(sampled, num_sampled, num_rejected, input_batch):
        copies = (sampled.clone(), num_sampled.clone(), num_rejected.clone())
        held.append(copies)
        return real_broadcast(*copies, input_batch)

    handler.broadcast = broadcast


def _install_recv_then_sync(runner) -> None:
    """Candidate fix D (measured to mask the crash as trace2's side effect):
    the non-last rank's CPU waits for the sampled-token broadcast it just
    posted, so nothing else is queued while it is in flight."""
    handler = runner.pp_handler
    if handler is None or handler.is_last_rank:
        return
    real_receive = handler.receive

    def receive(input_batch, recv_drafts):
        result = real_receive(input_batch, recv_drafts)
        handler.broadcast_stream.synchronize()
        return result

    handler.receive = receive


def _install_recv_persistent(runner) -> None:
    """Candidate fix E: each ring slot receives into buffers of its own,
    allocated once and never freed (the caching allocator never hands a
    slot's memory to anyone else while the slot waits to be consumed)."""
    import torch

    handler = runner.pp_handler
    if handler is None or handler.is_last_rank:
        return
    depth = len(handler.queue) + 1
    max_reqs, width = runner.max_num_reqs, handler.max_sample_len
    pool = [
        (
            torch.empty(max_reqs * width, dtype=torch.int64, device=handler.device),
            torch.empty(2 * max_reqs, dtype=torch.int32, device=handler.device),
        )
        for _ in range(depth)
    ]
    turn = {"next": 0}

    def next_slot(input_batch):
        sampled, combined = pool[turn["next"] % depth]
        turn["next"] += 1
        n, w = input_batch.num_reqs, handler._sample_len(input_batch)
        # Contiguous views (NCCL takes no strided tensors).
        return [sampled[: n * w].view(n, w), combined[: 2 * n].view(2, n)]

    _receive_into(handler, next_slot)


def _install_send_after_sync(runner) -> None:
    """Probe: the last rank waits for its GPU before it broadcasts the
    sampled tokens (the sender half of trace2's two waits)."""
    import torch

    handler = runner.pp_handler
    if handler is None or not handler.is_last_rank:
        return
    real_broadcast = handler.broadcast

    def broadcast(*args, **kwargs):
        torch.cuda.synchronize()
        return real_broadcast(*args, **kwargs)

    handler.broadcast = broadcast


def _stream_report(handler) -> str:
    """The stream the handler orders its side stream after, beside the
    stream this thread runs on now (torch's own lookup: vLLM's current_stream()
    would set a stream itself on first use)."""
    import torch

    current = torch.cuda.current_stream(handler.device).cuda_stream
    default = torch.cuda.default_stream(handler.device).cuda_stream
    held = getattr(handler, "main_stream", None)
    if held is None:  # patch 0005: the handler looks the stream up at each call
        return f"handler.main_stream none current {current:#x} default {default:#x}"
    return (
        f"handler.main_stream {held.cuda_stream:#x} current {current:#x} "
        f"default {default:#x} same {held.cuda_stream == current}"
    )


def _wrap_handler_calls(handler, before) -> None:
    """Call before(name) ahead of each of the handler's stream-ordering methods."""
    for name in ("receive", "broadcast", "broadcast_drafts", "get_prev_sampled_outputs"):
        real = getattr(handler, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            before(_name)
            return _real(*args, **kwargs)

        setattr(handler, name, wrapped)


def _install_streams(runner) -> None:
    """Log which stream the PP handler waits on and which one the step runs
    on, for the first calls of each method (no sync: it must not hide a race)."""
    import threading

    handler, rank = runner.pp_handler, _rank()
    if handler is None:
        return
    print(f"pp3 streams rank {rank} install: {_stream_report(handler)}", flush=True)
    seen: dict[str, int] = {}

    def log(name: str) -> None:
        seen[name] = seen.get(name, 0) + 1
        if seen[name] <= 3:
            print(
                f"pp3 streams rank {rank} {name}#{seen[name]} thread "
                f"{threading.get_ident():#x}: {_stream_report(handler)}",
                flush=True,
            )

    _wrap_handler_calls(handler, log)


def _install_fix_stream(runner) -> None:
    """Candidate fix F: the handler orders its side stream after (and waits
    its events on) the stream current at each call, not the one current when
    the runner was built."""
    import torch

    handler = runner.pp_handler
    if handler is None:
        return

    def refresh(name: str) -> None:
        handler.main_stream = torch.cuda.current_stream(handler.device)

    _wrap_handler_calls(handler, refresh)
    _install_streams(runner)  # wraps outside refresh: it logs the stream before the refresh


# --- sensitivity probes: a known wrong answer the comparison must catch -------

SHIFTED_POSITION = 50


def _install_boundary_shift(runner) -> None:
    """At the stage boundary into PP rank 1, hand its first layer the hidden
    state of the token before for every token at SHIFTED_POSITION (a
    misaligned intermediate tensor, one row per request)."""
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().world_size < 2 or get_pp_group().rank_in_group != 1:
        return
    model = runner.model
    for attr in ("language_model", "model"):
        while hasattr(model, attr) and not hasattr(model, "layers"):
            model = getattr(model, attr)
    first = model.layers[model.start_layer]

    def shift(module, args, kwargs):
        positions = kwargs["positions"]
        pos = positions[0] if positions.dim() == 2 else positions
        rows = (pos == SHIFTED_POSITION).nonzero().flatten()
        rows = rows[rows > 0]
        if rows.numel() == 0:
            return None
        hidden = kwargs["hidden_states"].clone()
        hidden[rows] = hidden[rows - 1]
        return args, {**kwargs, "hidden_states": hidden}

    first.register_forward_pre_hook(shift, with_kwargs=True)


def _drop_last_selected(indices):
    """The selected-token index rows with each row's last valid entry set to -1."""
    out = indices.clone()
    cols = out[:, :-1]
    valid = cols >= 0
    last = valid.long().cumsum(1).eq(valid.long().sum(1, keepdim=True)) & valid
    cols[last] = -1
    return out


def _install_drop_one_token(runner) -> None:
    """In the QSA offload path (patch 0021's kernels), drop one selected token
    per query row, prefill and decode alike."""
    from engine_probes import rewrite_offload_selection  # checks/gpu/common, on PYTHONPATH

    rewrite_offload_selection(_drop_last_selected)


# --- the unwritten-row probe: what no kernel writes in a GDN step is NaN ---------

_POISON = {"on": False}
_EMPTY_OPS = ("empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided")


def nan_empty():
    """A torch dispatch mode under which every empty-like allocation of a
    floating dtype comes back filled with NaN; every other op runs as it is.
    Memory a kernel writes is unchanged; memory it does not write reads NaN."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NanEmpty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ in _EMPTY_OPS and out.is_floating_point():
                out.fill_(float("nan"))
            return out

    return NanEmpty()


def poison_mixed_spec(meta, core_attn_out, body):
    """Run BODY (the GDN core) with, in a mixed step (prefill chunks beside
    spec-decode sequences), the output rows it must write set to NaN first and
    the spec recurrent kernel's output allocated as NaN (see
    `_install_poison_gdn_out`). Other steps run as they are."""
    mixed = (
        meta is not None
        and getattr(meta, "spec_sequence_masks", None) is not None
        and meta.num_prefills > 0
    )
    if not mixed:
        return body()
    # The merge (index_copy_ by spec_token_indx and non_spec_token_indx) must
    # write each of the step's scheduled rows (the builder's token counts,
    # padding excluded); forward_cuda's torch.zeros left them 0.
    real = meta.num_prefill_tokens + meta.num_decode_tokens + meta.num_spec_decode_tokens
    core_attn_out[:real].fill_(float("nan"))
    _POISON["on"] = True
    try:
        return body()
    finally:
        _POISON["on"] = False


def _install_poison_gdn_out(runner) -> None:
    """qwen4_exp's GDN layers (QwenGatedDeltaNetAttention, the Triton path the
    tiny model takes): in mixed prefill + spec-decode steps, the rows of the
    layer's core output and of the spec recurrent kernel's output
    (fused_sigmoid_gating_delta_rule_update's `o = q.new_empty(...)`, which
    the kernel skips for a sequence whose state slot is the null block) are
    NaN until a kernel writes them. A draft row that stays NaN at layer.N.gdn
    was never written; one that is a number was computed differently."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn

    cls = gdn.QwenGatedDeltaNetAttention
    if getattr(cls._forward_core, "_poisoned", False):
        return
    real_core, real_update = cls._forward_core, gdn.fused_sigmoid_gating_delta_rule_update

    def forward_core(self, mixed_qkv, b, a, core_attn_out):
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        return poison_mixed_spec(
            meta, core_attn_out, lambda: real_core(self, mixed_qkv, b, a, core_attn_out)
        )

    def update(*args, **kwargs):
        if not _POISON["on"]:
            return real_update(*args, **kwargs)
        with nan_empty():
            return real_update(*args, **kwargs)

    forward_core._poisoned = True
    update.__wrapped__ = real_update
    forward_core.__wrapped__ = real_core
    cls._forward_core = forward_core
    gdn.fused_sigmoid_gating_delta_rule_update = update


# Trace and candidate-fix probes (install_sync's names): what each installs, in order.
_PROBES = {
    "trace": (_install_trace,),
    "trace2": (_install_trace2,),
    "fix_recv": (_install_recv_on_main_stream, _install_trace),
    "fix_recv_sync": (_install_recv_then_sync,),
    "send_sync": (_install_send_after_sync,),
    "fix_recv_persistent": (_install_recv_persistent,),
    "fix_send": (_install_send_holds_buffers, _install_trace),
    "streams": (_install_streams,),
    "fix_stream": (_install_fix_stream,),
    "boundary_shift": (_install_boundary_shift,),
    "drop_one_token": (_install_drop_one_token,),
    "poison_gdn_out": (_install_poison_gdn_out,),
}
