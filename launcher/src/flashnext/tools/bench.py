"""Benchmark a running server through its OpenAI-compatible streaming completions API.

Measures, each as `warmup` discarded runs then `runs` measured ones:
- decode at each concurrency (default 1 and 4): TTFT, per-stream tok/s, and the
  aggregate tok/s over the window in which every stream was decoding;
- prefill at each prompt length: TTFT and prompt tokens / TTFT (prompts are
  token-id lists, so their length is exact without a tokenizer, and differ per
  run so no prefix cache can help).

With MTP on, the server's own spec-decode counters (its Prometheus /metrics,
read before and after) give the acceptance rate over the bench: accepted /
drafted tokens, the figure the plan's MTP projection assumes (another
client's requests during the bench would count too).

A stream counts only if it ends with a finish_reason, usage and `[DONE]` and
generated exactly the tokens asked for (`ignore_eos`); anything else is
rejected and makes the whole bench fail. Arithmetic lives in pure functions
over recorded arrival times, so it is tested exactly.

Against a bad server (tools/wire.py): memory is bounded by the options (the
prompts of one batch, concurrency x prompt length token ids, plus capped
bodies and lines), time by `deadline_s` over the whole bench, and garbage is a
rejection or a BenchError, never a traceback. Credentials in the URL are used
as basic auth and never written into results.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flashnext.atomic import write_text_atomic
from flashnext.plan import speed_basis
from flashnext.tools import wire

BENCH_SCHEMA_VERSION = 1

# The seed report's figures (SPEC.md "Headline results"), measured on 3x RTX 3090.
REFERENCE = {
    "decode_c1_tok_s": 80.0,
    "decode_c4_tok_s": [152.0, 155.0],
    "prefill": {"requests": 4, "prompt_tokens": 247_823, "seconds": 368.0},
}

MAX_BATCH_PROMPT_TOKENS = 1 << 23
"""Token ids held in memory at once (a batch's prompts; the soak's clients' prompts):
~40 B each as a Python list and its JSON, so 8M tokens is ~350 MB, 32 full contexts
of 262144 tokens."""

TOKEN_ID_RANGE = (1_000, 100_000)
"""Prompt token ids are drawn from [lo, hi): ordinary vocabulary, clear of special tokens.
A model with a smaller vocabulary (the tiny test checkpoint: 32768) needs its own range:
vLLM rejects a prompt holding an id beyond the vocabulary."""


class BenchError(Exception):
    """The bench could not produce trustworthy figures (the message says why)."""


@dataclass(frozen=True)
class BenchConfig:
    url: str
    """Server base URL, e.g. http://127.0.0.1:8000 (with or without /v1)."""
    model: str
    api_key: str | None = None
    concurrency: tuple[int, ...] = (1, 4)
    decode_tokens: int = 256
    decode_prompt_tokens: int = 128
    prompt_lengths: tuple[int, ...] = (4096,)
    prefill_concurrency: int = 1
    warmup: int = 1
    runs: int = 3
    timeout_s: float = 600.0
    """Longest wait for one read; a request also ends at the bench's deadline."""
    deadline_s: float = 3600.0
    """The whole bench ends within this (a phase it cannot finish is a BenchError)."""
    seed: int = 0
    token_id_range: tuple[int, int] = TOKEN_ID_RANGE
    """Prompt token ids are drawn from [lo, hi)."""


@dataclass
class StreamRecord:
    """One request as it happened; times are seconds since the bench started."""

    phase: str
    """"decode" or "prefill"."""
    concurrency: int
    run: int
    warmup: bool
    prompt_tokens: int
    max_tokens: int
    t_sent: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    """(time, tokens in this chunk) for each chunk that carried tokens (text or not)."""
    completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    def rejection(self) -> str | None:
        """Why this stream cannot be used, or None when it is complete."""
        if self.error:
            return self.error
        if not self.done:
            return "stream ended without [DONE]"
        if self.finish_reason is None:
            return "no finish_reason"
        if self.completion_tokens != self.max_tokens:
            return f"usage says {self.completion_tokens} tokens, asked for {self.max_tokens}"
        if self.tokens != self.max_tokens:
            return f"received {self.tokens} tokens in chunks, asked for {self.max_tokens}"
        if self.usage_prompt_tokens != self.prompt_tokens:
            counted = self.usage_prompt_tokens
            return f"server counted {counted} prompt tokens, sent {self.prompt_tokens}"
        return None


# ---------------------------------------------------------------- arithmetic (pure)


def ttft_s(rec: StreamRecord) -> float:
    return rec.arrivals[0][0] - rec.t_sent


def stream_decode_tok_s(rec: StreamRecord) -> float | None:
    """Tokens after the first / time from first to last token (TTFT excluded)."""
    span = rec.arrivals[-1][0] - rec.arrivals[0][0]
    after_first = rec.tokens - rec.arrivals[0][1]
    return after_first / span if span > 0 else None


def aggregate_decode_tok_s(recs: Sequence[StreamRecord]) -> float | None:
    """Tokens arriving while *all* streams decode, over that window's length.

    The window opens at the last stream's first token and closes at the first
    stream's last token, so ramp-up and tail (fewer streams) do not dilute it.
    """
    start = max(r.arrivals[0][0] for r in recs)
    end = min(r.arrivals[-1][0] for r in recs)
    if end <= start:
        return None
    n = sum(k for r in recs for t, k in r.arrivals if start < t <= end)
    return n / (end - start)


def prefill_tok_s(recs: Sequence[StreamRecord]) -> float:
    """All prompt tokens / (last first token - first send): aggregate for concurrent prompts."""
    span = max(r.arrivals[0][0] for r in recs) - min(r.t_sent for r in recs)
    return sum(r.prompt_tokens for r in recs) / span


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(records: Sequence[StreamRecord]) -> dict[str, Any]:
    """Per (phase, concurrency, prompt length): statistics over the measured runs."""
    groups: dict[tuple[str, int, int], dict[int, list[StreamRecord]]] = {}
    for rec in records:
        if rec.warmup:
            continue
        key = (rec.phase, rec.concurrency, rec.prompt_tokens if rec.phase == "prefill" else 0)
        groups.setdefault(key, {}).setdefault(rec.run, []).append(rec)
    decode: list[dict[str, Any]] = []
    prefill: list[dict[str, Any]] = []
    for (phase, conc, plen), runs in sorted(groups.items()):
        recs = [r for rs in runs.values() for r in rs]
        ttfts = [ttft_s(r) for r in recs]
        if phase == "decode":
            per_stream = [v for r in recs if (v := stream_decode_tok_s(r)) is not None]
            agg = [v for rs in runs.values() if (v := aggregate_decode_tok_s(rs)) is not None]
            decode.append({
                "concurrency": conc,
                "tokens_per_request": recs[0].max_tokens,
                "ttft_s": _stats(ttfts),
                "stream_tok_s": _stats(per_stream),
                "aggregate_tok_s": _stats(agg),
            })  # fmt: skip
        else:
            rates = [prefill_tok_s(rs) for rs in runs.values()]
            prefill.append({
                "concurrency": conc,
                "prompt_tokens": plen,
                "ttft_s": _stats(ttfts),
                "prefill_tok_s": _stats(rates),
            })  # fmt: skip
    return {"decode": decode, "prefill": prefill}


def compare(summary: dict[str, Any], roofline_tok_s: float | None) -> list[dict[str, Any]]:
    """Measured medians next to the seed's figures and the plan's decode roofline."""
    rows: list[dict[str, Any]] = []
    by_conc = {d["concurrency"]: d for d in summary["decode"] if d["aggregate_tok_s"]}
    if 1 in by_conc:
        got = by_conc[1]["aggregate_tok_s"]["median"]
        rows.append(_row("decode tok/s, c=1", got, REFERENCE["decode_c1_tok_s"]))
        if roofline_tok_s:
            rows.append(_row("decode tok/s, c=1 vs roofline", got, roofline_tok_s))
    if 4 in by_conc:
        lo, hi = REFERENCE["decode_c4_tok_s"]
        got = by_conc[4]["aggregate_tok_s"]["median"]
        rows.append(_row("decode tok/s, c=4", got, (lo + hi) / 2, f"{lo:g}-{hi:g}"))
    ref = REFERENCE["prefill"]
    ref_rate = ref["requests"] * ref["prompt_tokens"] / ref["seconds"]
    for p in summary["prefill"]:
        shape = f"{p['concurrency']}x{p['prompt_tokens']}"
        same = p["concurrency"] == ref["requests"] and p["prompt_tokens"] == ref["prompt_tokens"]
        note = "same shape" if same else f"reference shape {ref['requests']}x{ref['prompt_tokens']}"
        rows.append(
            _row(f"prefill tok/s, {shape}", p["prefill_tok_s"]["median"], ref_rate, note=note)
        )
    return rows


def _row(what: str, got: float, ref: float, ref_text: str | None = None, note: str = "") -> dict:
    return {
        "metric": what,
        "measured": round(got, 3),
        "reference": ref_text or round(ref, 3),
        "ratio": round(got / ref, 4) if ref else None,
        "note": note,
    }


# ---------------------------------------------------------------- client


def _split_url(url: str) -> wire.Target:
    try:
        return wire.parse_target(url)
    except wire.WireError as exc:
        raise BenchError(str(exc)) from None


def prompt_ids(n: int, rng: random.Random, id_range: tuple[int, int] = TOKEN_ID_RANGE) -> list[int]:
    lo, hi = id_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming /v1/completions request that generates exactly `max_tokens` tokens."""
    return {
        "model": model,
        "prompt": prompt,  # token ids: exact length, no tokenizer needed here
        "max_tokens": max_tokens,
        "ignore_eos": True,  # vLLM extension: never stop early
        "temperature": 0,
        "stream": True,
        # usage on every chunk: a chunk may carry several tokens
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


def stream_completion(
    cfg: BenchConfig,
    prompt: list[int],
    max_tokens: int,
    rec: StreamRecord,
    clock: Callable,
    deadline: float = float("inf"),
) -> None:
    """Send one streaming request and fill `rec` with what arrived, when (server-sent
    events: one `data: {json}` line per chunk, then `data: [DONE]`). `deadline`
    (time.monotonic()) ends it, whatever the server keeps sending."""
    target = _split_url(cfg.url)
    body = completion_body(cfg.model, prompt, max_tokens)
    deadline = min(deadline, time.monotonic() + cfg.timeout_s)
    read_s = max(0.01, min(cfg.timeout_s, deadline - time.monotonic()))
    try:
        with httpx.Client(timeout=read_s, auth=target.auth) as client:
            rec.t_sent = clock()
            headers = wire.headers_for(cfg.api_key, stream=True)
            with client.stream("POST", target.completions, json=body, headers=headers) as resp:
                if resp.status_code != 200:
                    rec.error = wire.error_text(resp.status_code, _head(resp))
                    return
                _read_events(wire.sse_lines(resp, deadline), rec, clock)
        if not rec.arrivals and rec.error is None:
            rec.error = "no tokens arrived"
    except (httpx.HTTPError, OSError, ValueError) as exc:  # WireError is a ValueError
        rec.error = f"{type(exc).__name__}: {exc}"


def _head(resp: httpx.Response, limit: int = 4096) -> bytes:
    """The first bytes of an error body (a server may send gigabytes)."""
    got = bytearray()
    for piece in resp.iter_bytes():
        got += piece
        if len(got) >= limit:
            break
    return bytes(got[:limit])


def _read_events(lines: Iterable[str], rec: StreamRecord, clock: Callable) -> None:
    seen = 0  # cumulative completion tokens per continuous usage stats
    for line in lines:
        now = clock()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec.done = True
            break
        chunk = wire.parse_chunk(data)
        if chunk.error is not None:
            rec.error = f"the server's error mid-stream: {str(chunk.error.get('message'))[:300]}"
            return
        if chunk.completion_tokens is not None or chunk.prompt_tokens is not None:
            rec.completion_tokens = chunk.completion_tokens
            rec.usage_prompt_tokens = chunk.prompt_tokens
        for text in chunk.texts:
            # A chunk may carry several tokens; usage says how many so far. It
            # carries them even when its text is empty: the detokenizer holds back
            # a partial UTF-8 character and drops special tokens.
            total = chunk.completion_tokens
            if total is not None:
                if total > seen:
                    rec.arrivals.append((now, total - seen))
                    seen = total
            elif text:
                rec.arrivals.append((now, 1))
                seen += 1
        if chunk.finish_reason:
            rec.finish_reason = chunk.finish_reason
        if seen > rec.max_tokens:  # memory: arrivals never outgrow what was asked for
            rec.error = f"the server sent {seen} tokens, asked for {rec.max_tokens}"
            return


def _run_batch(
    cfg: BenchConfig,
    phase: str,
    prompts: list[list[int]],
    max_tokens: int,
    run: int,
    warmup: bool,
    clock: Callable,
    deadline: float = float("inf"),
) -> list[StreamRecord]:
    """Send len(prompts) requests at once (threads released together by a barrier)."""
    recs = [
        StreamRecord(phase, len(prompts), run, warmup, len(p), max_tokens, 0.0) for p in prompts
    ]
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait()
        stream_completion(cfg, prompts[i], max_tokens, recs[i], clock, deadline)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return recs


def served_context(target: wire.Target, api_key: str | None, model: str) -> int | None:
    """The served model's max_model_len from /v1/models (None: the server gives none);
    BenchError with the fix when nothing serves it (bench and the soak alike)."""
    fix = "start the server (`flashnext serve`) or fix --url/--served-model-name"
    try:
        status, body = wire.get_capped(target, target.models, api_key, timeout_s=30.0)
        if status != 200:
            raise BenchError(f"{target.models}: {wire.error_text(status, body)}; {fix}")
        return wire.parse_model_list(body, target.models, model)
    except httpx.HTTPError:
        raise BenchError(f"{target.models}: no answer; {fix}") from None
    except wire.WireError as exc:
        raise BenchError(f"{exc}; {fix}") from None


def check_server(cfg: BenchConfig) -> int | None:
    """Fail fast, with the fix, when nothing serves the model; returns its max_model_len."""
    target = _split_url(cfg.url)
    max_len = served_context(target, cfg.api_key, cfg.model)
    longest = max(
        [cfg.decode_prompt_tokens + cfg.decode_tokens, *(n + 1 for n in cfg.prompt_lengths)]
    )
    if max_len is not None and longest > max_len:
        raise BenchError(
            f"a request of {longest} tokens does not fit the server's max_model_len {max_len}; "
            "lower --prompt-lengths / --decode-tokens"
        )
    return max_len


def run_bench(
    cfg: BenchConfig, progress: Callable[[str], None] | None = None
) -> list[StreamRecord]:
    """All phases, warmup first; returns every record (warmups included, flagged)."""
    check_server(cfg)
    rng = random.Random(cfg.seed)
    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.deadline_s

    def in_time(what: str) -> float:
        if time.monotonic() >= deadline:
            raise BenchError(
                f"the bench's deadline of {cfg.deadline_s:g} s passed before {what}; raise "
                "--deadline, or ask for fewer --runs, shorter --prompt-lengths or fewer "
                "--decode-tokens"
            )
        return deadline

    def clock() -> float:
        return time.perf_counter() - t0

    say = progress or (lambda _msg: None)
    records: list[StreamRecord] = []
    for conc in cfg.concurrency:
        for i in range(cfg.warmup + cfg.runs):
            warm = i < cfg.warmup
            which = f"warmup {i + 1}" if warm else f"run {i - cfg.warmup + 1}"
            say(f"decode c={conc} {which}")
            prompts = [
                prompt_ids(cfg.decode_prompt_tokens, rng, cfg.token_id_range) for _ in range(conc)
            ]
            at = in_time(f"decode c={conc} {which}")
            records += _run_batch(cfg, "decode", prompts, cfg.decode_tokens, i, warm, clock, at)
    for plen in cfg.prompt_lengths:
        for i in range(cfg.warmup + cfg.runs):
            warm = i < cfg.warmup
            which = f"warmup {i + 1}" if warm else f"run {i - cfg.warmup + 1}"
            say(f"prefill {cfg.prefill_concurrency}x{plen} {which}")
            prompts = [
                prompt_ids(plen, rng, cfg.token_id_range) for _ in range(cfg.prefill_concurrency)
            ]
            at = in_time(f"prefill {which}")
            records += _run_batch(cfg, "prefill", prompts, 1, i, warm, clock, at)
    return records


# ---------------------------------------------------------------- spec decode

# vLLM 0.33.0's counters (v1/spec_decode/metrics.py), as prometheus_client
# exposes a counter: its name plus `_total`, one sample per engine.
SPEC_DECODE_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+(\S+)")


def parse_spec_decode(text: str) -> dict[str, float] | None:
    """The spec-decode counters of a /metrics page, summed over engines; None
    when the server drafts nothing (MTP off: vLLM then exports none of them)."""
    by_name = {name: key for key, name in SPEC_DECODE_COUNTERS.items()}
    found: dict[str, float] = {}
    for line in text.splitlines():
        sample = _SAMPLE.match(line)
        if sample is None or sample[1] not in by_name:
            continue
        try:
            value = float(sample[2])
        except ValueError:
            continue
        key = by_name[sample[1]]
        found[key] = found.get(key, 0.0) + value
    return found if "draft_tokens" in found else None


def read_spec_decode(cfg: BenchConfig) -> dict[str, float] | None:
    """The server's spec-decode counters now; None when it has none or no /metrics."""
    target = _split_url(cfg.url)
    try:
        status, body = wire.get_capped(target, target.metrics, cfg.api_key, timeout_s=10.0)
    except (httpx.HTTPError, wire.WireError):
        return None
    return parse_spec_decode(body.decode("utf-8", "replace")) if status == 200 else None


def spec_decode_window(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, Any] | None:
    """What the bench's requests drafted and had accepted: the counters' growth.
    None when the server does not draft (or only started to during the bench)."""
    if before is None or after is None:
        return None
    grew = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in SPEC_DECODE_COUNTERS}
    drafted, drafts = grew["draft_tokens"], grew["drafts"]
    return {
        **{key: int(value) for key, value in grew.items()},
        "acceptance_rate": grew["accepted_tokens"] / drafted if drafted else None,
        "mean_acceptance_length": 1 + grew["accepted_tokens"] / drafts if drafts else None,
    }


# ---------------------------------------------------------------- results


def fingerprint(facts: dict | None, plan: dict | None, versions: dict | None) -> dict[str, Any]:
    """The environment a figure belongs to, with a hash to group comparable results."""
    env = {"facts": facts, "plan": plan, "versions": versions or {}}
    canon = json.dumps(env, sort_keys=True, separators=(",", ":"))
    return {**env, "sha256": hashlib.sha256(canon.encode()).hexdigest()}


def roofline_from_plan(plan: dict | None) -> float | None:
    """`flashnext plan --json` carries decode.tokens_per_s, the single-stream bound."""
    try:
        return float(plan["decode"]["tokens_per_s"]) if plan else None
    except (KeyError, TypeError, ValueError):
        return None


def cited_acceptance(plan: dict | None) -> float | None:
    """The acceptance rate the plan's MTP projection assumed (the profile's cited figure)."""
    try:
        return float(plan["mtp"]["projection"]["acceptance_rate"]) if plan else None
    except (KeyError, TypeError, ValueError):
        return None


def build_result(
    cfg: BenchConfig,
    records: Sequence[StreamRecord],
    env_fingerprint: dict[str, Any],
    spec_decode: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`spec_decode`: spec_decode_window() over the bench, when the server drafts."""
    rejected = [
        {"phase": r.phase, "concurrency": r.concurrency, "run": r.run, "why": why}
        for r in records
        if (why := r.rejection()) is not None
    ]
    ok = [r for r in records if r.rejection() is None]
    summary = summarize(ok) if not rejected else {"decode": [], "prefill": []}
    config = asdict(cfg)
    config.pop("api_key")
    config["url"] = _split_url(cfg.url).public  # never user:pass@
    comparison = compare(summary, roofline_from_plan(env_fingerprint.get("plan")))
    rate, cited = (
        (spec_decode or {}).get("acceptance_rate"),
        cited_acceptance(env_fingerprint.get("plan")),
    )
    if rate is not None and cited is not None and not rejected:
        comparison.append(_row("MTP acceptance rate", rate, cited, note="the plan's projection"))
    return {
        "bench_schema_version": BENCH_SCHEMA_VERSION,
        "config": config,
        "environment": env_fingerprint,
        "rejected": rejected,
        "summary": summary,
        "spec_decode": spec_decode,
        "comparison": comparison if not rejected else [],
        "projection": speed_basis.bench_comparison(summary, env_fingerprint.get("plan")),
        "reference": REFERENCE,
    }


def _atomic_write(path: Path, text: str) -> None:
    write_text_atomic(path, text)


def write_results(out_dir: Path, records: Sequence[StreamRecord], result: dict[str, Any]) -> None:
    """raw.jsonl (every request, warmups flagged) and summary.json, each written atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = "".join(json.dumps(asdict(r), sort_keys=True) + "\n" for r in records)
    _atomic_write(out_dir / "raw.jsonl", raw)
    _atomic_write(out_dir / "summary.json", json.dumps(result, sort_keys=True, indent=2) + "\n")
