"""The MTP drafter the profile asks for, against the last rank's room (plan/mtp.py)."""

from __future__ import annotations

from collections.abc import Iterator

from flashnext.checks.finding import Finding
from flashnext.checks.inputs import PreflightInput, _ok
from flashnext.plan.mtp import INT4_FIX
from flashnext.plan.qsa_sizing import RequestCapacity
from flashnext.units import gib


def mtp_fit(inp: PreflightInput) -> Iterator[Finding]:
    """The profile asks for MTP: the drafter must fit on the last rank (plan/mtp.py),
    loading (its pass through VRAM) and serving (the KV pool it shares)."""
    if inp.plan is None:  # rank_fit's plan check says why
        return
    mtp = inp.plan.mtp
    if mtp is None:
        return
    load = mtp.load
    off = "--mtp 0 (serve without MTP)"
    if load is None:  # no MTP tensors
        yield Finding("mtp.fit", "fail", "no MTP tensors", "an MTP layer (mtp.*)",
                      f"MTP does not fit: {mtp.reason}", off)  # fmt: skip
        return
    if mtp.fits:
        yield _ok("mtp.fit", f"{gib(load.transient_bytes)} while loading",
                  f"<= {gib(load.room_bytes)} on rank {mtp.rank}", mtp.reason,
                  measured_bytes=load.transient_bytes, required_bytes=load.room_bytes)  # fmt: skip
        return
    if not load.fits:
        yield Finding(
            "mtp.fit",
            "fail",
            f"{gib(load.transient_bytes)} while loading",
            f"<= {gib(load.room_bytes)} on rank {mtp.rank}",
            f"MTP does not fit: {mtp.reason}",
            f"{INT4_FIX} --model {inp.model_dir or 'MODEL_DIR'}" if mtp.experts_bf16 else off,
            measured_bytes=load.transient_bytes,
            required_bytes=load.room_bytes,
        )
        return
    cap = mtp.requests
    longest = cap.longest_request_tokens if cap is not None else 0
    fix = off
    if longest:
        fix = f"{off}, or --max-model-len {longest}"
    elif fewer := _fewer_drafts(cap, inp.profile.mtp.num_speculative_tokens):
        fix = f"{off}, or {fewer}"
    yield Finding(
        "mtp.fit",
        "fail",
        f"{cap.usable_blocks if cap else 0} KV blocks with the drafter",
        f">= {cap.blocks_per_request if cap else 1} (one request of "
        f"{inp.plan.max_model_len.value} tokens)",
        f"MTP does not fit: {mtp.reason}",
        fix,
    )


def _fewer_drafts(cap: RequestCapacity | None, drafts: int) -> str | None:
    """Where K drafts' state alone outgrows the pool (it fits at no length): the
    most drafts whose state leaves room for a request, and the length it then
    fits at (the pool itself does not change with K)."""
    if cap is None:
        return None
    for n in range(drafts - 1, 0, -1):
        longest = cap.with_fewer_drafts(drafts - n).longest_request_tokens
        if longest:
            return f"--mtp {n} --max-model-len {min(longest, cap.max_model_len)}"
    return None
