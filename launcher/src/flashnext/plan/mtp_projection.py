"""What MTP would gain in single-stream decode, on paper (issue 16).

A projection under the plan's decode roofline (planner.DecodeRoofline: weight
bytes read per token / one card's bandwidth), not a measurement. Its inputs:

- the acceptance rate alpha: the chance that a draft token is accepted, each
  position independently (the standard geometric model). It is a profile value
  with its source ([mtp] acceptance_rate, acceptance_source); a profile without
  one gets no projection (fail closed). The acceptance of an INT4-requantized
  drafter on this checkpoint is unmeasured until `flashnext bench` runs with MTP
  on the real machine.
- one speculative step with k draft tokens emits (1 - alpha^(k+1)) / (1 - alpha)
  tokens on average (k + 1 when alpha = 1): the accepted prefix plus the
  target's own token.
- its cost, in bytes read:
  - the target's verify pass over k + 1 tokens reads the dense weights once and
    the routed experts of each of the k + 1 tokens (experts_per_token of
    num_experts each; no two tokens assumed to share an expert, which
    overstates the reads a little: 10 of 512 experts per token here);
  - k drafter steps, each reading from VRAM the MTP layer's dense weights,
    fc/norms/HC mixer and the target's LM head, which the drafter shares on
    the last rank; and over the host link (PCIe), the routed experts of one
    token as INT4 g128 (after `flashnext checkpoint mtp-int4` when the
    checkpoint ships them BF16): with `--cpu-offload-params` they live in
    pinned host memory and the GPU reads them in place (plan/mtp.py). That
    read takes its bytes / the profile's `[gpu] host_link_bytes_per_s`; a
    profile without that figure gets no projection (fail closed).
- PP: a single stream runs the stages one after another (the drafter after the
  last stage, on the last card), so the step's bytes cross one card's bandwidth
  in sequence, as in the roofline; the cards' bandwidths do not add up.

Like the roofline it counts weights only: no K/V reads, kernel launches, PP
hops or sampling; the host link is taken at its figure, as if the experts'
rows streamed. With k = 0 it is the roofline itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

GOAL_TOKENS_PER_S = 150.0
"""Issue 16's single-stream goal with MTP on 3x3090, tokens/s."""
PROJECTED_K = (1, 2, 3)
"""num_speculative_tokens the projection tabulates."""

NO_HOST_LINK = (
    "no cited host-link bandwidth: the drafter reads its routed experts from pinned host "
    "memory over PCIe, and the profile's [gpu] has no host_link_bytes_per_s, so MTP's gain "
    "is not projected; add the figure with its source to the profile"
)
NO_CITED_RATE = (
    "no cited acceptance rate: the profile's [mtp] has no acceptance_rate with an "
    "acceptance_source, so MTP's gain is not projected; measure it with `flashnext bench` "
    "on the real machine and record it there"
)


def tokens_per_step(acceptance_rate: float, num_speculative_tokens: int) -> float:
    """Expected tokens one speculative step emits: (1 - a^(k+1)) / (1 - a)."""
    a, k = acceptance_rate, num_speculative_tokens
    if not 0 <= a <= 1 or k < 0:
        raise ValueError(f"acceptance rate {a} outside [0, 1] or k {k} < 0")
    if a == 1:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


@dataclass(frozen=True)
class StepCost:
    """Bytes one speculative step reads, by part (the roofline's inputs and the drafter's)."""

    target_dense_bytes: int
    """The target's non-expert weights, read once per forward (DecodeRoofline.dense_bytes)."""
    target_routed_bytes_per_token: int
    """The target's routed experts one token reads (routed x experts_per_token / num_experts)."""
    drafter_bytes: int
    """VRAM bytes of one drafter step (plan/mtp.py drafter_bytes_per_step)."""
    bandwidth_bytes_per_s: int
    """One card's memory bandwidth (the profile's)."""
    drafter_host_bytes: int = 0
    """Host bytes one drafter step reads over the host link (its routed experts,
    plan/mtp.py drafter_host_bytes_per_step)."""
    host_link_bytes_per_s: int | None = None
    """One card's host link (PCIe) bandwidth (the profile's); None: not known."""

    def bytes_per_step(self, num_speculative_tokens: int) -> int:
        """VRAM bytes of one step (the host reads are host_bytes_per_step)."""
        k = num_speculative_tokens
        verify = self.target_dense_bytes + (k + 1) * self.target_routed_bytes_per_token
        return verify + k * self.drafter_bytes

    def host_bytes_per_step(self, num_speculative_tokens: int) -> int:
        return num_speculative_tokens * self.drafter_host_bytes

    def seconds_per_step(self, num_speculative_tokens: int) -> float:
        """VRAM reads at the card's bandwidth, then the host reads at the link's:
        a draft step needs its experts before it goes on, so the two add up."""
        seconds = self.bytes_per_step(num_speculative_tokens) / self.bandwidth_bytes_per_s
        host = self.host_bytes_per_step(num_speculative_tokens)
        if host:
            if self.host_link_bytes_per_s is None:
                raise ValueError(NO_HOST_LINK)
            seconds += host / self.host_link_bytes_per_s
        return seconds

    def tokens_per_s(self, acceptance_rate: float, num_speculative_tokens: int) -> float:
        k = num_speculative_tokens
        return tokens_per_step(acceptance_rate, k) / self.seconds_per_step(k)


@dataclass(frozen=True)
class ProjectionRow:
    num_speculative_tokens: int
    tokens_per_step: float
    bytes_per_step: int
    """VRAM bytes read in one step."""
    host_bytes_per_step: int
    """Host bytes read over the host link in one step."""
    tokens_per_s: float
    speedup: float
    """tokens_per_s over the roofline without MTP."""
    meets_goal: bool
    """tokens_per_s >= GOAL_TOKENS_PER_S."""

    def to_json(self) -> dict[str, Any]:
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "tokens_per_step": round(self.tokens_per_step, 3),
            "bytes_per_step": self.bytes_per_step,
            "host_bytes_per_step": self.host_bytes_per_step,
            "tokens_per_s": round(self.tokens_per_s, 2),
            "speedup": round(self.speedup, 3),
            "meets_goal": self.meets_goal,
        }


def project_row(cost: StepCost, acceptance_rate: float, k: int) -> ProjectionRow:
    tps = cost.tokens_per_s(acceptance_rate, k)
    return ProjectionRow(
        num_speculative_tokens=k,
        tokens_per_step=tokens_per_step(acceptance_rate, k),
        bytes_per_step=cost.bytes_per_step(k),
        host_bytes_per_step=cost.host_bytes_per_step(k),
        tokens_per_s=tps,
        speedup=tps / cost.tokens_per_s(0.0, 0),
        meets_goal=tps >= GOAL_TOKENS_PER_S,
    )


def projection_table(
    cost: StepCost, acceptance_rates: tuple[float, ...], ks: tuple[int, ...] = PROJECTED_K
) -> list[ProjectionRow]:
    """One row per (rate, k), rates outer: the README's table."""
    return [project_row(cost, a, k) for a in acceptance_rates for k in ks]


@dataclass(frozen=True)
class MtpProjection:
    acceptance_rate: float | None
    acceptance_source: str | None
    num_speculative_tokens: int
    """The profile's k (its row is among `rows`)."""
    no_mtp_tokens_per_s: float
    drafter_bytes_per_step: int
    drafter_host_bytes_per_step: int
    rows: tuple[ProjectionRow, ...]
    """Empty without a cited acceptance rate or host-link bandwidth."""
    reason: str
    cost: StepCost
    """What a step reads: projection_table(cost, rates) gives the README's grid."""

    def to_json(self) -> dict[str, Any]:
        return {
            "acceptance_rate": self.acceptance_rate,
            "acceptance_source": self.acceptance_source,
            "num_speculative_tokens": self.num_speculative_tokens,
            "goal_tokens_per_s": GOAL_TOKENS_PER_S,
            "no_mtp_tokens_per_s": round(self.no_mtp_tokens_per_s, 2),
            "drafter_bytes_per_step": self.drafter_bytes_per_step,
            "drafter_host_bytes_per_step": self.drafter_host_bytes_per_step,
            "host_link_bytes_per_s": self.cost.host_link_bytes_per_s,
            "rows": [r.to_json() for r in self.rows],
            "reason": self.reason,
        }


def project_mtp(
    cost: StepCost,
    *,
    acceptance_rate: float | None,
    acceptance_source: str | None,
    num_speculative_tokens: int,
) -> MtpProjection:
    """The projection at the profile's cited rate, for k in PROJECTED_K and the profile's
    k; no rows, and the reason says so, without a rate and its source or without the
    host link's bandwidth."""
    base = cost.tokens_per_s(0.0, 0)
    refusal = None
    if acceptance_rate is None or not acceptance_source:
        refusal = NO_CITED_RATE
    elif cost.drafter_host_bytes and cost.host_link_bytes_per_s is None:
        refusal = NO_HOST_LINK
    if refusal is not None:
        return MtpProjection(acceptance_rate, acceptance_source, num_speculative_tokens, base,
                             cost.drafter_bytes, cost.drafter_host_bytes, (), refusal,
                             cost)  # fmt: skip
    ks = tuple(sorted({*PROJECTED_K, num_speculative_tokens}))
    rows = tuple(project_row(cost, acceptance_rate, k) for k in ks)
    mine = next(r for r in rows if r.num_speculative_tokens == num_speculative_tokens)
    verdict = "meets" if mine.meets_goal else "misses"
    already = "as it does" if base >= GOAL_TOKENS_PER_S else "which it misses"
    reason = (
        f"on paper, not measured: at acceptance rate {acceptance_rate} (acceptance_source) "
        f"k={num_speculative_tokens} emits {mine.tokens_per_step:.2f} tokens per step for "
        f"{mine.bytes_per_step / 1e9:.2f} GB read from VRAM and "
        f"{mine.host_bytes_per_step / 1e6:.1f} MB over the host link: "
        f"{mine.tokens_per_s:.0f} tok/s under the "
        f"single-stream roofline, x{mine.speedup:.2f} its {base:.0f} tok/s without MTP; "
        f"{verdict} the {GOAL_TOKENS_PER_S:.0f} tok/s goal on paper, {already} without MTP. "
        "The roofline counts weight reads only and measured decode runs below it: the "
        "speedup is the projection, the tok/s an upper bound"
    )
    return MtpProjection(acceptance_rate, acceptance_source, num_speculative_tokens, base,
                         cost.drafter_bytes, cost.drafter_host_bytes, rows, reason,
                         cost)  # fmt: skip
