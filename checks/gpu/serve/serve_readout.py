"""What the launcher's JSON files say, one line each, as serve-tiny records them
in its steps (pure but for reading the file; stdlib only)."""

from __future__ import annotations

import json
from pathlib import Path


def preflight_lines(path: Path) -> list[str]:
    """Each finding that is not ok, then the counts, as lines (indented two spaces)."""
    try:
        doc = json.loads(path.read_text())
        lines = []
        for f in doc["findings"]:
            if f["level"] != "ok":
                lines.append(
                    f"  {f['level']:4} {f['id']}: {f['measured']} (required {f['required']}): "
                    f"{f['message']}" + (f"; fix: {f['fix']}" if f["fix"] else "")
                )
        counts = {
            lvl: sum(f["level"] == lvl for f in doc["findings"]) for lvl in ("ok", "warn", "fail")
        }
        lines.append(
            f"  profile {doc['profile']}: {counts['fail']} failed, {counts['warn']} warnings, "
            f"{counts['ok']} ok"
        )
        return lines
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"no preflight JSON ({exc})"]


def plan_line(plan: dict | None) -> str:
    """The plan in one line, "PP 3 - MTP K=1 - kv N bytes, pinned N bytes" ("" when
    the plan cannot be read)."""
    try:
        argv = plan["argv"]
        pp = (
            argv[argv.index("--pipeline-parallel-size") + 1]
            if "--pipeline-parallel-size" in argv
            else "1"
        )
        spec = (
            json.loads(argv[argv.index("--speculative-config") + 1])
            if "--speculative-config" in argv
            else None
        )
        mtp = f"K={spec['num_speculative_tokens']}" if spec else "off"
        return (
            f"PP {pp} - MTP {mtp} - kv {plan['kv_cache_memory_bytes']['value']} bytes, "
            f"pinned {plan['pinned_bytes_needed']} bytes"
        )
    except (TypeError, KeyError, ValueError, IndexError):
        return ""


def bench_line(path: Path, mtp_k: int) -> tuple[bool, str]:
    """(passed, what the bench measured): c=1 and c=4 decoded, nothing rejected, and
    with MTP the server's /metrics counted drafts."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return False, f"no bench JSON ({exc})"
    try:
        seen, parts = set(), []
        for d in doc["summary"]["decode"]:
            seen.add(d["concurrency"])
            agg = d["aggregate_tok_s"]
            parts.append(
                f"c={d['concurrency']} {agg['median']:.1f} tok/s"
                if agg
                else f"c={d['concurrency']} (no aggregate window)"
            )
            parts[-1] += f", TTFT {d['ttft_s']['median'] * 1000:.0f} ms"
        for p in doc["summary"]["prefill"]:
            parts.append(
                f"prefill {p['prompt_tokens']} tokens {p['prefill_tok_s']['median']:.0f} tok/s"
            )
        for r in doc["rejected"]:
            parts.append(f"rejected {r['phase']} c={r['concurrency']} run {r['run']}: {r['why']}")
        spec = doc.get("spec_decode")
        if spec and spec["acceptance_rate"] is not None:
            parts.append(
                f"MTP K={mtp_k}: {spec['accepted_tokens']} of {spec['draft_tokens']} draft "
                f"tokens accepted (rate {spec['acceptance_rate']:.3f})"
            )
        elif mtp_k:
            parts.append(f"MTP K={mtp_k} asked, but the server's /metrics counted no draft tokens")
        drafted = not mtp_k or bool(spec and spec["acceptance_rate"] is not None)
        return seen >= {1, 4} and not doc["rejected"] and drafted, "; ".join(parts)
    except (KeyError, TypeError, ValueError) as exc:
        return False, f"bench JSON without {exc}"


def patch_line(path: Path) -> str:
    """Whether the report's patch stamp matches this checkout."""
    try:
        a = json.loads(path.read_text())["vllm_applied_patches"]
        if a.get("matches_checkout") is True:
            return "patch stamp matches this checkout"
        return "patch stamp: " + json.dumps(a)[:200]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"report JSON without the patch stamp ({exc!r})"
