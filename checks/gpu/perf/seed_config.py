"""Issue 40 item 2, pure: the projection first reproduces the field report.

The field report's serving configuration (shared/SPEC.md, "Serving
configuration that worked": no MTP, FULL_DECODE_ONLY graphs at [1, 2, 4],
the PLE gather outside `forward`) is the 3x3090 plan's own argv, which the
harness's `offload` engine serves. Its measured steps, projected by the same
rules as our configuration, must land within 15% of the report's 80.0 tok/s
at c=1 and 152-155 at c=4 before a projection of anything else is trusted.

Each rule of projection.RULES is projected and judged, so a miss shows which
term is wrong; `within_15pct` is the contract's rule's (projection.RULE).
Beside them, one ratio two runs measured directly: c=4 over c=1 decode tok/s,
the H200 emulation's and the report's.
"""

from __future__ import annotations

from typing import Any

from projection import RULE, RULES, Links, MeasuredStep, project_3090, project_step_ms

# shared/SPEC.md "Headline results", seed section 5.6: measured on 3x3090.
FIELD_REPORT_C1 = 80.0
FIELD_REPORT_C4 = (152.0, 155.0)
TOLERANCE = 0.15
CONFIGURATION = (
    "the offload engine: the 3x3090 plan's argv, the field report's configuration for decode "
    "(no MTP, FULL_DECODE_ONLY graphs at [1, 2, 4], the PLE gather outside forward: patch 0013)"
)


def miss(value: float, lo: float, hi: float) -> float:
    """How far a value lies outside [lo, hi], as a share of the nearer end (0 inside)."""
    if value < lo:
        return (lo - value) / lo
    return (value - hi) / hi if value > hi else 0.0


def judged(c1: float | None, c4: float | None) -> dict[str, Any]:
    """A projection's c=1 and c=4 beside the report's; None where either is missing."""
    out = {"c1_tok_s": c1, "c4_tok_s": c4, "within_15pct": None}
    if c1 is not None and c4 is not None:
        out["c1_miss"] = miss(c1, FIELD_REPORT_C1, FIELD_REPORT_C1)
        out["c4_miss"] = miss(c4, *FIELD_REPORT_C4)
        out["within_15pct"] = max(out["c1_miss"], out["c4_miss"]) <= TOLERANCE
    return out


def seed_config(
    c1: list[MeasuredStep] | None,
    c4: list[MeasuredStep] | None,
    links: Links,
    measured_tok_s: dict[int, float | None],
) -> dict[str, Any]:
    """`projection_3090.seed_config`: the offload engine's steps under every rule, the
    contract's rule's figures on top; `measured_tok_s` is the H200 run's own decode
    tok/s by concurrency (for the c=4 / c=1 ratio)."""
    by_rule = {}
    for rule in RULES:
        p = project_3090(c1 or [], c4, None, links, rule=rule)
        by_rule[rule] = judged(p["c1_tok_s"], p["c4_tok_s"])
    h1, h4 = measured_tok_s.get(1), measured_tok_s.get(4)
    return {
        "configuration": CONFIGURATION,
        "c1_tok_s": by_rule[RULE]["c1_tok_s"],
        "c4_tok_s": by_rule[RULE]["c4_tok_s"],
        "field_report_c1": FIELD_REPORT_C1,
        "field_report_c4": list(FIELD_REPORT_C4),
        "within_15pct": by_rule[RULE]["within_15pct"],
        "rule": RULE,
        "by_rule": by_rule,
        # Where a miss comes from: each rank's c=1 step by term under the contract's rule.
        "c1_ranks": [project_step_ms(s, links) for s in c1] if c1 else None,
        "c4_over_c1": {
            "h200_emulation": h4 / h1 if h1 and h4 else None,
            "field_report": [c / FIELD_REPORT_C1 for c in FIELD_REPORT_C4],
        },
    }
