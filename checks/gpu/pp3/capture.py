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

A token's key is (position, input id): prompts are distinct random ids, and a
key seen twice in one engine (a collision or a padded row) is dropped by the
comparison. Captured rows are cloned on the GPU in the forward's stream (no
host sync, so the hooks cannot hide a race) and copied to the host only by
`dump`, between generate calls.

Sync probes (`install_sync`) are the bisection tool for the V2 runner crash:
each adds torch.cuda.synchronize() at one place; the place whose sync makes
the crash go away bounds where the unsynchronized read is.
"""

from __future__ import annotations

from typing import Any

_STATE: dict[str, Any] = {"on": False, "rows": {}, "hooks": [], "keys": None}


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
    _STATE["rows"].setdefault(name, []).append((pos[:n], ids[:n], rows[:n].clone()))


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

    for index in range(start, end):
        layer = model.layers[index]
        hooks.append(layer.register_forward_pre_hook(layer_pre, with_kwargs=True))
        hooks.append(layer.register_forward_hook(layer_post(index), with_kwargs=True))
        for attr, tag in (("linear_attn", "gdn"), ("self_attn", "qsa"), ("mlp", "moe"), ("ple", "ple")):
            sub = getattr(layer, attr, None)
            if sub is not None:
                hooks.append(sub.register_forward_hook(part(f"layer.{index}.{tag}")))
    from vllm.distributed.parallel_state import get_pp_group

    if get_pp_group().is_last_rank:
        hooks.append(model.register_forward_hook(lambda m, a, out: _store("final", out)))
    return {"rank": _rank(), "layers": [start, end]}


def start(worker) -> int:
    _STATE["rows"].clear()
    _STATE["on"] = True
    return _rank()


def dump(worker, path: str) -> dict[str, Any]:
    """Stop capturing; write {point: (positions, ids, rows)} for this rank to
    PATH.rank{R}.pt (rows as float32 on the host) and say how many."""
    import torch

    _STATE["on"] = False
    out: dict[str, tuple] = {}
    for name, parts in _STATE["rows"].items():
        pos = torch.cat([p for p, _, _ in parts]).cpu()
        ids = torch.cat([i for _, i, _ in parts]).cpu()
        rows = torch.cat([r.reshape(r.shape[0], -1) for _, _, r in parts]).float().cpu()
        out[name] = (pos, ids, rows)
    _STATE["rows"].clear()
    rank = _rank()
    target = f"{path}.rank{rank}.pt"
    torch.save(out, target)
    return {"rank": rank, "points": len(out), "file": target}


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
                    print(f"pp3 sync probe: error before {name} on rank {_rank()}: {exc}", flush=True)
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
    else:
        raise ValueError(f"unknown sync probe {where!r}")
    return where
