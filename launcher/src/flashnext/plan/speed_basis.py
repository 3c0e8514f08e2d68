"""What a serving-speed figure rests on: a named, dated run, or nothing yet.

`MEASURED` holds, per profile, the serving figures a run produced for it (issue
40 item 5): decode tok/s at c=1 and c=4 and TTFT, with the run's results file,
its date and what kind of figure it is (a projection from an H200 emulation is
not a 3090 measurement, and says so). A profile without an entry has "no
measured basis yet": `plan` says that instead of a speed, and `bench` compares
its measurement with nothing but the roofline and the field report.

An entry's figures are a results contract's, as `from_contract` reads them
(the package cannot read checks/ at run time, so they are written out here):
checks/launcher/test_speed_basis.py holds every entry to its file, so a figure
no run produced fails. A contract whose projection does not reproduce the
field report (`seed_config.within_15pct` not true) gives no basis.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

NO_BASIS = "no measured basis yet"
# What the PP=3 perf harness's projection is (checks/gpu/perf/README.md).
EMULATION = (
    "projected to 3x3090 from an H200 emulation (three PP ranks on one GPU, dummy weights, "
    "our pinned vLLM on the host's torch), not measured on 3090s"
)


@dataclass(frozen=True)
class SpeedBasis:
    profile: str
    run: str
    """The results file the figures are read from (repository path)."""
    date: str
    """The run's date, YYYY-MM-DD."""
    what: str
    decode_c1_tok_s: float | None
    decode_c4_tok_s: float | None
    ttft_s: float | None
    ttft_prompt_tokens: int | None


MEASURED: dict[str, SpeedBasis] = {}


def from_contract(profile: str, run: str, date: str, doc: dict[str, Any]) -> SpeedBasis:
    """A basis from a pp3_perf-RUN.json contract's `projection_3090` (its TTFT only
    where the projection has one: a TTFT measured on the H200 is not a 3090's)."""
    p = doc["projection_3090"]
    if (p.get("seed_config") or {}).get("within_15pct") is not True:
        raise ValueError(
            f"{run}: its projection does not reproduce the field report within 15% "
            "(projection_3090.seed_config.within_15pct): fix the rule first (issue 40 item 2)"
        )
    return SpeedBasis(profile, run, date, EMULATION, p.get("c1_tok_s"), p.get("c4_tok_s"),
                      p.get("ttft_s"), p.get("ttft_prompt_tokens"))  # fmt: skip


def basis_for(profile: str | None) -> SpeedBasis | None:
    return MEASURED.get(profile) if profile else None


def describe(basis: SpeedBasis | None) -> str:
    if basis is None:
        return NO_BASIS
    return f"run {basis.run} ({basis.date}): {basis.what}"


def to_json(profile: str | None) -> dict[str, Any]:
    basis = basis_for(profile)
    return {"profile": profile, "basis": asdict(basis) if basis else None, "says": describe(basis)}


def _median(entry: dict[str, Any] | None, key: str) -> float | None:
    stats = (entry or {}).get(key) or {}
    return stats.get("median")


def bench_comparison(summary: dict[str, Any], plan: dict[str, Any] | None) -> dict[str, Any]:
    """`bench --json`'s `projection`: the basis its figures are held to (the plan's
    profile's), and per quantity the measured median beside the projected figure."""
    profile = (plan or {}).get("profile")
    doc = to_json(profile)
    basis = basis_for(profile)
    tokens = basis.ttft_prompt_tokens if basis else None
    decode = {d["concurrency"]: d for d in summary.get("decode", [])}
    prefill = {(p["concurrency"], p["prompt_tokens"]): p for p in summary.get("prefill", [])}
    wanted = [
        ("decode tok/s, c=1", _median(decode.get(1), "aggregate_tok_s"),
         basis.decode_c1_tok_s if basis else None),
        ("decode tok/s, c=4", _median(decode.get(4), "aggregate_tok_s"),
         basis.decode_c4_tok_s if basis else None),
        (f"TTFT s, {tokens} tokens" if tokens else "TTFT s",
         _median(prefill.get((1, tokens)), "ttft_s") if tokens else None,
         basis.ttft_s if basis else None),
    ]  # fmt: skip
    doc["rows"] = [
        {"metric": metric, "measured": got, "projected": ref,
         "ratio": round(got / ref, 4) if got is not None and ref else None}
        for metric, got, ref in wanted
    ]  # fmt: skip
    return doc
