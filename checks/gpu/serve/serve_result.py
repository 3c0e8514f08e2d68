"""serve-tiny's results: OUT_DIR/serve-tiny.json and the table it prints (pure
but for reading the files the steps wrote; stdlib only).

The JSON: ok, seconds, profile, pp_size, emulated, devices (GPUs that really
serve), card (which card ran, as the facts preflight judged have it: a call for
the H200 may get an H100), replayed_facts, emulation, mtp, and the serve block
of issue 24's results contract ({"health", "smoke", "bench_c1_tok_s",
"bench_c4_tok_s", "clean_stop"}), then every step (verdict, seconds, detail).
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MTP_KEYS = (
    "acceptance_rate",
    "mean_acceptance_length",
    "draft_tokens",
    "accepted_tokens",
    "drafts",
)


@dataclass
class Step:
    step: str
    verdict: str  # ok | FAILED | skipped
    seconds: int
    detail: str


@dataclass
class Facts:
    """What the run learnt on its way, for the summary; None: not known (yet)."""

    profile: str
    emulated: bool
    mtp_k: int
    pp_size: int | None = None
    gpu_count: int | None = None  # the profile's
    host_gpus: int | None = None  # the host's, under the emulation
    replay: str = ""  # the facts file every step judged; "": probed
    replay_from: str = ""
    shim_env: list[str] = field(default_factory=list)  # KEY=VALUE, as serve got them
    shim_in_vllm: bool | None = None
    health: bool = False
    smoke: bool = False


def _json_file(path: Path | str) -> Any:
    with open(path) as fh:
        return json.load(fh)


def gpus_in(facts_path: str) -> int | None:
    try:
        return len(_json_file(facts_path)["gpu"]["devices"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def card_in(preflight_path: Path, facts: Facts) -> dict[str, Any] | None:
    """GPU 0 of the facts preflight judged (None: preflight wrote none)."""
    try:
        device = _json_file(preflight_path)["facts"]["gpu"]["devices"][0]
        name, total = device["name"], device["memory_total_bytes"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None
    where = facts.replay_from or "probed on this host by preflight"
    return {"name": name, "memory_total_bytes": total, "source": f"preflight.json's facts: {where}"}


def decode_tok_s(bench: dict[str, Any] | None, concurrency: int) -> float | None:
    """The bench's median aggregate decode rate at `concurrency`, None when it has none."""
    for d in (bench or {}).get("summary", {}).get("decode", []):
        if d.get("concurrency") == concurrency and d.get("aggregate_tok_s"):
            return d["aggregate_tok_s"]["median"]
    return None


def document(facts: Facts, steps: list[Step], failed: bool, seconds: int, out: Path):
    """The results JSON from the steps and the files they wrote in `out`."""
    verdicts = {s.step: s.verdict for s in steps}
    bench = None
    if verdicts.get("bench") in ("ok", "FAILED"):  # written by this run
        with contextlib.suppress(OSError, ValueError):
            bench = _json_file(out / "bench.json")
    ran = verdicts.get("preflight") in ("ok", "FAILED")  # written by this run
    spec = (bench or {}).get("spec_decode")
    return {
        "ok": not failed,
        "seconds": seconds,
        "profile": facts.profile,
        "pp_size": facts.pp_size,
        "emulated": facts.emulated,
        # GPUs that really serve: the host's one under the emulation, else the profile's
        "devices": facts.host_gpus if facts.emulated else facts.gpu_count,
        "card": card_in(out / "preflight.json", facts) if ran else None,
        "replayed_facts": {
            "file": facts.replay,
            "from": facts.replay_from,
            "gpus": gpus_in(facts.replay),
        }
        if facts.replay
        else None,
        "emulation": {
            "shim_env": dict(kv.split("=", 1) for kv in facts.shim_env),
            "shim_env_in_vllm": facts.shim_in_vllm,
        }
        if facts.emulated
        else None,
        # from the server's /metrics over the bench; null when it counted no drafts
        "mtp": {"k": facts.mtp_k, **{key: (spec or {}).get(key) for key in MTP_KEYS}}
        if facts.mtp_k
        else None,
        "serve": {
            "health": facts.health,
            "smoke": facts.smoke,
            "bench_c1_tok_s": decode_tok_s(bench, 1),
            "bench_c4_tok_s": decode_tok_s(bench, 4),
            "clean_stop": verdicts.get("stop") == "ok"
            and verdicts.get("processes") == "ok"
            and verdicts.get("gpu") in ("ok", "skipped"),
        },
        "steps": [vars(s) for s in steps],
    }


def write(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n")


def table(steps: list[Step]) -> str:
    rows = [f"{'step':<10} {'verdict':<8} {'s':>5}  detail"]
    rows += [f"{s.step:<10} {s.verdict:<8} {s.seconds:>5}  {s.detail[:150]}" for s in steps]
    return "\n".join(rows)
