"""The plan on this host: the plan itself, the PLE layers on rank 0, the KV pool's
full-length requests, each rank's VRAM and each card's free memory for its start."""

from __future__ import annotations

from collections.abc import Iterator

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _ok
from flashnext.units import gib


def plan_fits(inp: PreflightInput) -> Iterator[Finding]:
    plan = inp.plan
    if plan is None:
        if inp.model is not None:  # without a model, model.dir already says why
            yield Finding(
                "plan",
                "fail",
                inp.plan_error or "no plan",
                "a plan",
                f"cannot plan: {inp.plan_error}",
                "fix what the message names, then re-run",
            )
        return
    bad = [r for r in plan.ple_ranks if r != 0]
    if bad:
        yield Finding(
            "pp.ple_rank",
            "fail",
            f"PLE layer(s) {list(plan.ple_layers)} on rank(s) {bad}",
            "rank 0",
            "the PLE n-gram embedding needs the raw token ids, which only PP rank 0 has",
            "change VLLM_PP_LAYER_PARTITION so its first entry covers layer "
            f"{max(plan.ple_layers) + 1} or more (default: unset)",
        )
    else:
        yield _ok(
            "pp.ple_rank",
            f"PLE on rank {list(plan.ple_ranks)}",
            "rank 0",
            f"partition {[e - s for s, e in plan.pp_ranges]}",
        )
    yield from _kv_capacity(inp)
    for r in plan.ranks:
        if r.headroom_bytes < 0:
            yield Finding(
                f"rank{r.rank}.vram",
                "fail",
                gib(r.committed_bytes),
                f"<= {gib(r.vram_usable_bytes)}",
                f"rank {r.rank} needs {gib(r.committed_bytes)} (weights {gib(r.weight_bytes)}, KV "
                f"{gib(r.kv_cache_bytes)}), more than its usable {gib(r.vram_usable_bytes)}",
                "lower --kv-cache-memory-bytes or rebalance with VLLM_PP_LAYER_PARTITION",
                measured_bytes=r.committed_bytes,
                required_bytes=r.vram_usable_bytes,
            )
        else:
            yield _ok(
                f"rank{r.rank}.vram",
                gib(r.committed_bytes),
                f"<= {gib(r.vram_usable_bytes)}",
                f"headroom {gib(r.headroom_bytes)}",
                measured_bytes=r.committed_bytes,
                required_bytes=r.vram_usable_bytes,
            )
    yield from _start_peaks(inp)


def _start_peaks(inp: PreflightInput) -> Iterator[Finding]:
    """Each card's free memory against what its rank is predicted to hold while
    starting (plan/start_peak.py: the load-time repack is beyond the plan's serving
    budget). A warning: its CUDA context term is an H200's figure."""
    peaks = [r.start_peak for r in inp.plan.ranks]
    devices = sorted(inp.facts.gpu.devices, key=lambda d: d.index)
    if not peaks or None in peaks or len(devices) < len(peaks):
        return
    for rank, (peak, d) in enumerate(zip(peaks, devices, strict=False)):
        tag = f"rank{rank}.start"
        need = peak.predicted_bytes
        terms = " + ".join(f"{t.name} {gib(t.bytes)}" for t in peak.terms if t.bytes)
        if d.memory_free_bytes >= need:
            yield _ok(tag, f"GPU {d.index}: {gib(d.memory_free_bytes)} free", f">= {gib(need)}",
                      f"start peak predicted {gib(need)} ({peak.phase})",
                      measured_bytes=d.memory_free_bytes, required_bytes=need)  # fmt: skip
            continue
        yield Finding(
            tag,
            "warn",
            f"GPU {d.index}: {gib(d.memory_free_bytes)} free",
            f">= {gib(need)}",
            f"rank {rank} is predicted to hold up to {gib(need)} while starting "
            f"({peak.phase}: {terms}; `flashnext plan --json` ranks[].start_peak says why); "
            f"GPU {d.index} has {gib(d.memory_free_bytes)} free, so the start may run out "
            "of memory",
            f"free memory on GPU {d.index} (nvidia-smi lists what holds it: a display server "
            "or another process)",
            measured_bytes=d.memory_free_bytes,
            required_bytes=need,
        )


def _kv_capacity(inp: PreflightInput) -> Iterator[Finding]:
    """Requests of --max-model-len tokens the pool holds, counted in blocks as vLLM
    counts them: each takes its K/V blocks and, whatever its length, its state blocks
    (qsa_sizing.RequestCapacity)."""
    cap, seqs = inp.plan.kv_capacity, inp.profile.scheduler.max_num_seqs
    if cap is None:
        return
    max_len, per = cap.max_model_len, cap.blocks_per_request
    each = (
        f"a full-length request (--max-model-len {max_len}) takes {per} blocks of "
        f"{cap.block_size_tokens} tokens "
        f"({cap.kv_blocks_per_request} of K/V, {cap.state_blocks_per_request} of GDN, PLE and "
        f"ring state), the pool has {cap.usable_blocks}"
    )
    vllm = f"vLLM: {cap.max_concurrency:.2f}x, {cap.kv_cache_tokens} tokens"
    if not cap.starts:
        longest = cap.longest_request_tokens
        yield Finding(
            "kv.capacity",
            "fail",
            f"{cap.usable_blocks} blocks",
            f">= {per} (one request of {max_len} tokens)",
            f"{each}: vLLM refuses to start",
            "raise --kv-cache-memory-bytes"
            + (f", or lower --max-model-len to {longest}" if longest else ""),
        )
    elif cap.full_length_requests < seqs:
        yield Finding(
            "kv.capacity",
            "warn",
            f"{cap.full_length_requests} full-length requests",
            f">= {seqs} (--max-num-seqs)",
            f"{each}: {cap.full_length_requests} run at once, more queue ({vllm}); shorter "
            "requests fit more",
            f"accept it, or --max-model-len {cap.longest_for(seqs)} for {seqs} at once"
            if cap.longest_for(seqs)
            else "accept it, or raise --kv-cache-memory-bytes if VRAM allows",
        )
    else:
        yield _ok(
            "kv.capacity",
            f"{cap.full_length_requests} full-length requests",
            f">= {seqs}",
            f"{each}: {seqs} fit ({vllm})",
        )
