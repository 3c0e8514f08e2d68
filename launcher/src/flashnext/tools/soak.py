"""`flashnext bench --soak DURATION`: a mixed workload held for a while, and every
request's end accounted for.

`clients` threads each send one streaming /v1/completions request after another
until the duration is over (or `max_requests` were sent). Each request is drawn
from the stated mix (`PROMPT_MIX`): prompt lengths up to and past the server's
context, random max_tokens, a share that stop at a stop string and a share we
disconnect mid-stream. With more clients than the server's --max-num-seqs, some
wait in its queue.

Every request ends as one outcome (`OUTCOMES`); `lost` counts those that did not
end in a completion, a clear HTTP error (a status >= 400, or vLLM's error chunk
in the stream) or our own disconnect: cut, broken or past their deadline. Time
is bounded: no request is sent after the duration, each ends by its deadline, so
the soak ends within duration + request deadline (+ the idle stretch, when asked
for, in which only memory is sampled: tools/growth.py judges it). Memory is bounded by the
options: clients x the longest prompt of token ids, and one record per request
(at most max_requests), its latencies in a float array.
"""

from __future__ import annotations

import math
import random
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from flashnext.tools import growth, prom, wire
from flashnext.tools.bench import TOKEN_ID_RANGE, BenchError, prompt_ids, served_context

SOAK_SCHEMA_VERSION = 1

OUTCOMES = (
    "completed",  # finish_reason length/stop, usage agrees, [DONE]
    "refused_length",  # HTTP 400 for the context length (vLLM's input_tokens/max_tokens)
    "http_error",  # any other status >= 400, or vLLM's error chunk mid-stream
    "disconnected",  # we closed it mid-stream, on purpose
    "broken",  # the server cut it without an error, or answered garbage
    "timed_out",  # still open at its deadline
)
LOST = ("broken", "timed_out")

# The prompt-length mix: (bucket, share). With C the server's context and L the long
# cap (min(--soak-long-prompt, C - 1)): short U[16, 256], medium U[256, L/8],
# long U[L/8, L], past_context U[C + 1, C + 64] (refused by the server with a 400).
PROMPT_MIX = (("short", 0.60), ("medium", 0.25), ("long", 0.10), ("past_context", 0.05))
PAST_CONTEXT_EXTRA = 64


@dataclass(frozen=True)
class SoakConfig:
    url: str
    model: str
    api_key: str | None = None
    duration_s: float = 300.0
    clients: int = 8
    """Requests in flight at once: above the server's --max-num-seqs, so some queue."""
    max_tokens: int = 256
    """Each request's max_tokens is drawn from [1, this]."""
    disconnect_share: float = 0.1
    stop_share: float = 0.2
    stops: tuple[str, ...] = ("\n\n",)
    long_prompt_tokens: int = 32768
    interval_s: float = 10.0
    request_deadline_s: float = 600.0
    max_requests: int = 100_000
    idle_s: float = 0.0
    """After the soak, sample memory this long with nothing sent (tools/growth.py)."""
    seed: int = 0
    token_id_range: tuple[int, int] = TOKEN_ID_RANGE


@dataclass(frozen=True)
class RequestPlan:
    bucket: str
    prompt_tokens: int
    max_tokens: int
    stop: str | None
    disconnect_after: int | None
    """Close the stream after this many tokens (None: read it to its end)."""


def plan_request(rng: random.Random, cfg: SoakConfig, context: int) -> RequestPlan:
    """One request of the mix (pure: the same rng state gives the same request)."""
    bucket = rng.choices([b for b, _ in PROMPT_MIX], [w for _, w in PROMPT_MIX])[0]
    long_cap = max(16, min(cfg.long_prompt_tokens, context - 1))
    lo, hi = {
        "short": (16, 256),
        "medium": (256, max(256, long_cap // 8)),
        "long": (max(16, long_cap // 8), long_cap),
        "past_context": (context + 1, context + PAST_CONTEXT_EXTRA),
    }[bucket]
    if bucket != "past_context":
        lo, hi = min(lo, long_cap), min(hi, long_cap)
    prompt = rng.randint(lo, hi)
    max_tokens = rng.randint(1, cfg.max_tokens)
    stop = rng.choice(cfg.stops) if cfg.stops and rng.random() < cfg.stop_share else None
    cut = None
    if max_tokens >= 2 and rng.random() < cfg.disconnect_share:
        cut = rng.randint(1, max_tokens - 1)
    return RequestPlan(bucket, prompt, max_tokens, stop, cut)


@dataclass
class SoakRecord:
    """One request; times are seconds since the soak started."""

    id: int
    client: int
    bucket: str
    prompt_tokens: int
    max_tokens: int
    stop: str | None
    disconnect_after: int | None
    t_sent: float = 0.0
    t_first: float | None = None
    t_end: float | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    status: int | None = None
    outcome: str | None = None
    error: str | None = None


# ---------------------------------------------------------------- arithmetic (pure)


def percentile(values: Any, q: float) -> float | None:
    """Nearest-rank percentile (q in 0-100) of `values`; None when empty."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, min(len(data), math.ceil(q / 100 * len(data))))
    return data[rank - 1]


@dataclass
class Bucket:
    """One interval's arrivals (tokens, TTFTs, inter-token latencies) and ends."""

    tokens: int = 0
    ttft: array = field(default_factory=lambda: array("d"))
    itl: array = field(default_factory=lambda: array("d"))
    sent: int = 0
    ended: Counter = field(default_factory=Counter)


class Timeline:
    """Per-interval accumulators, filled by the client threads as things happen."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.buckets: dict[int, Bucket] = {}
        self.lock = threading.Lock()

    def _at(self, t: float) -> Bucket:
        return self.buckets.setdefault(int(t // self.interval_s), Bucket())

    def sent(self, t: float) -> None:
        with self.lock:
            self._at(t).sent += 1

    def tokens(self, t: float, n: int, ttft: float | None, gap: float | None) -> None:
        """`n` tokens arrived at `t`; the first of a request gives its TTFT, later
        ones the gap since the request's previous chunk, shared by its tokens."""
        with self.lock:
            b = self._at(t)
            b.tokens += n
            if ttft is not None:
                b.ttft.append(ttft)
            if gap is not None and n > 0:
                b.itl.extend([gap / n] * n)

    def ended(self, t: float, outcome: str) -> None:
        with self.lock:
            self._at(t).ended[outcome] += 1

    def rows(self, until: float) -> list[dict[str, Any]]:
        """One row per interval up to `until` (the last one possibly shorter)."""
        out = []
        last = int(until // self.interval_s) if until > 0 else 0
        with self.lock:
            for i in range(last + 1):
                b = self.buckets.get(i, Bucket())
                t0 = i * self.interval_s
                span = min(self.interval_s, until - t0)
                if span <= 0:
                    continue
                out.append(
                    {
                        "t0_s": round(t0, 3),
                        "t1_s": round(t0 + span, 3),
                        "sent": b.sent,
                        "ended": dict(sorted(b.ended.items())),
                        "tokens": b.tokens,
                        "decode_tok_s": b.tokens / span,
                        "ttft_s": _pcts(b.ttft),
                        "itl_s": _pcts(b.itl),
                    }
                )
        return out

    def overall(self, span: float) -> dict[str, Any]:
        with self.lock:
            tokens = sum(b.tokens for b in self.buckets.values())
            ttft = array("d", (v for b in self.buckets.values() for v in b.ttft))
            itl = array("d", (v for b in self.buckets.values() for v in b.itl))
        return {
            "tokens": tokens,
            "decode_tok_s": tokens / span if span > 0 else None,
            "ttft_s": _pcts(ttft),
            "itl_s": _pcts(itl),
        }


def _pcts(values: Any) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "n": len(values)}


# ---------------------------------------------------------------- one request


def request_body(cfg: SoakConfig, prompt: list[int], plan: RequestPlan) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": cfg.model,
        "prompt": prompt,  # token ids: exact length, no tokenizer needed here
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if plan.stop is not None:
        body["stop"] = [plan.stop]
    return body


def is_length_refusal(status: int, err: dict[str, Any]) -> bool:
    """vLLM 0.33.0's 400 for a prompt past the context (renderers/params.py, param
    input_tokens) or no room left for output (SamplingParams, param max_tokens)."""
    if status != 400:
        return False
    message = str(err.get("message", ""))
    return err.get("param") in ("input_tokens", "max_tokens") or (
        "maximum context length" in message
    )


def run_request(
    target: wire.Target,
    cfg: SoakConfig,
    plan: RequestPlan,
    prompt: list[int],
    rec: SoakRecord,
    timeline: Timeline,
    clock: Callable[[], float],
    context: int,
) -> None:
    """Send one request, fill `rec` and the timeline, and set rec.outcome."""
    deadline = time.monotonic() + cfg.request_deadline_s
    rec.t_sent = clock()
    timeline.sent(rec.t_sent)
    try:
        with httpx.Client(timeout=cfg.request_deadline_s, auth=target.auth) as client:
            headers = wire.headers_for(cfg.api_key, stream=True)
            body = request_body(cfg, prompt, plan)
            with client.stream("POST", target.completions, json=body, headers=headers) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    head = _head(resp)
                    err = wire.error_of(resp.status_code, head)
                    rec.error = wire.error_text(resp.status_code, head)
                    length = is_length_refusal(resp.status_code, err)
                    rec.outcome = "refused_length" if length else "http_error"
                    if resp.status_code < 400:  # 1xx/3xx: not a clear error
                        rec.outcome = "broken"
                    return
                _read_stream(wire.sse_lines(resp, deadline), rec, timeline, clock)
                if rec.outcome is None:
                    rec.outcome, rec.error = classify_stream(rec, context)
    except (wire.DeadlinePassed, httpx.TimeoutException) as exc:
        rec.outcome, rec.error = "timed_out", f"{type(exc).__name__}: {exc}"
    except (httpx.HTTPError, OSError, ValueError) as exc:  # WireError is a ValueError
        rec.outcome, rec.error = "broken", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.t_end = clock()
        timeline.ended(rec.t_end, rec.outcome or "timed_out")


def _head(resp: httpx.Response, limit: int = 4096) -> bytes:
    got = bytearray()
    for piece in resp.iter_bytes():
        got += piece
        if len(got) >= limit:
            break
    return bytes(got[:limit])


def _read_stream(lines: Any, rec: SoakRecord, timeline: Timeline, clock: Callable) -> None:
    last: float | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            rec.done = True
            return
        now = clock()
        chunk = wire.parse_chunk(data)
        if chunk.error is not None:
            code = chunk.error.get("code")
            rec.status = code if isinstance(code, int) else rec.status
            rec.outcome = "http_error"
            rec.error = f"error mid-stream: {str(chunk.error.get('message'))[:300]}"
            return
        if chunk.completion_tokens is not None:
            rec.usage_tokens = chunk.completion_tokens
            new = max(0, chunk.completion_tokens - rec.tokens)
        else:
            new = sum(1 for t in chunk.texts if t)
        if chunk.finish_reason:
            rec.finish_reason = chunk.finish_reason
        if new:
            first = rec.t_first is None
            if first:
                rec.t_first = now
            timeline.tokens(
                now, new, now - rec.t_sent if first else None, None if first else now - last
            )
            rec.tokens += new
            last = now
        if rec.tokens > rec.max_tokens:
            raise wire.WireError(f"the server sent {rec.tokens} tokens, asked for {rec.max_tokens}")
        if rec.disconnect_after is not None and rec.tokens >= rec.disconnect_after:
            rec.outcome = "disconnected"
            return  # leaving the with-blocks closes the connection mid-stream


def classify_stream(rec: SoakRecord, context: int) -> tuple[str, str | None]:
    """(outcome, why) of a stream read to its end (pure)."""
    if not rec.done:
        return "broken", "the stream ended without [DONE] and without an error"
    if rec.finish_reason not in ("length", "stop"):
        return "broken", f"finish_reason {rec.finish_reason!r}"
    if rec.usage_tokens is not None and rec.usage_tokens != rec.tokens:
        return "broken", f"usage says {rec.usage_tokens} tokens, {rec.tokens} arrived"
    room = min(rec.max_tokens, context - rec.prompt_tokens)
    if rec.finish_reason == "length" and rec.tokens != room:
        return "broken", f"finish_reason length after {rec.tokens} tokens, room for {room}"
    return "completed", None


# ---------------------------------------------------------------- the soak


@dataclass
class SoakRun:
    records: list[SoakRecord]
    timeline: Timeline
    span_s: float
    context: int
    samples: list[dict[str, Any]]
    counters_before: dict[str, float] | None
    counters_after: dict[str, float] | None
    idle_from_s: float = 0.0
    """When the idle stretch began (soak time): after the counters settled."""


def read_context(target: wire.Target, cfg: SoakConfig) -> int:
    context = served_context(target, cfg.api_key, cfg.model)
    if context is None:
        raise BenchError(
            f"{target.models} gives no max_model_len: the soak draws prompts up "
            "to and past the context, so it needs it"
        )
    return context


def read_counters(target: wire.Target, api_key: str | None) -> dict[str, float] | None:
    try:
        status, body = wire.get_capped(target, target.metrics, api_key, timeout_s=10.0)
    except (httpx.HTTPError, wire.WireError):
        return None
    return prom.parse(body.decode("utf-8", "replace")) if status == 200 else None


def run_soak(
    cfg: SoakConfig,
    sampler: Callable[[], dict[str, Any]] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SoakRun:
    """Drive the workload; `sampler()` (server memory) is called every half interval."""
    target = wire.parse_target(cfg.url)
    context = read_context(target, cfg)
    say = progress or (lambda _m: None)
    t0 = time.monotonic()

    def clock() -> float:
        return time.monotonic() - t0

    timeline = Timeline(cfg.interval_s)
    records: list[SoakRecord] = []
    lock = threading.Lock()
    stop_sending = t0 + cfg.duration_s
    counters_before = read_counters(target, cfg.api_key)
    samples: list[dict[str, Any]] = []
    sampling_done = threading.Event()

    def take_sample() -> None:
        row: dict[str, Any] = {"t_s": round(clock(), 3)}
        if sampler is not None:
            row.update(sampler())
        counters = read_counters(target, cfg.api_key)
        if counters is not None:
            row["vllm"] = counters
        samples.append(row)

    def sample_loop() -> None:
        while not sampling_done.wait(max(0.5, cfg.interval_s / 2)):
            take_sample()

    def client(index: int) -> None:
        rng = random.Random(cfg.seed * 100_003 + index)
        while True:
            with lock:
                if time.monotonic() >= stop_sending or len(records) >= cfg.max_requests:
                    return
                plan = plan_request(rng, cfg, context)
                rec = SoakRecord(
                    len(records),
                    index,
                    plan.bucket,
                    plan.prompt_tokens,
                    plan.max_tokens,
                    plan.stop,
                    plan.disconnect_after,
                )
                records.append(rec)
            prompt = prompt_ids(plan.prompt_tokens, rng, cfg.token_id_range)
            run_request(target, cfg, plan, prompt, rec, timeline, clock, context)
            del prompt
            if rec.outcome in LOST:
                time.sleep(0.2)  # a dead server must not make us spin

    take_sample()
    sampler_thread = threading.Thread(target=sample_loop, daemon=True)
    sampler_thread.start()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(cfg.clients)]
    for t in threads:
        t.start()
    say(f"soak: {cfg.clients} clients for {cfg.duration_s:g} s against {target.public}")
    next_note = t0 + cfg.interval_s
    give_up = stop_sending + cfg.request_deadline_s + 30.0
    while any(t.is_alive() for t in threads) and time.monotonic() < give_up:
        for t in threads:
            t.join(0.2)
        if time.monotonic() >= next_note:
            next_note += cfg.interval_s
            with lock:
                ended = sum(1 for r in records if r.outcome is not None)
                n = len(records)
            say(f"soak: {clock():.0f} s, {n} sent, {ended} ended")
    sampling_done.set()
    sampler_thread.join(5.0)
    span = clock()
    counters_after = settle_counters(target, cfg.api_key, counters_before)
    idle_from = clock()
    take_sample()
    if cfg.idle_s > 0:
        say(f"soak: idle for {cfg.idle_s:g} s, sampling memory")
        while clock() < idle_from + cfg.idle_s:
            time.sleep(
                max(0.0, min(max(0.5, cfg.interval_s / 2), idle_from + cfg.idle_s - clock()))
            )
            take_sample()
    for rec in records:
        if rec.outcome is None:  # a thread still stuck past every deadline
            rec.outcome, rec.error = "timed_out", "never ended"
    return SoakRun(
        records, timeline, span, context, samples, counters_before, counters_after, idle_from
    )


def settle_counters(
    target: wire.Target, api_key: str | None, before: dict[str, float] | None, wait_s: float = 10.0
) -> dict[str, float] | None:
    """The counters once the last requests are counted: read until two reads 1 s
    apart agree (vLLM counts a request when the engine's output reaches the API server)."""
    if before is None:
        return None
    last = read_counters(target, api_key)
    deadline = time.monotonic() + wait_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(1.0)
        now = read_counters(target, api_key)
        if now == last:
            break
        last = now
    return last


# ---------------------------------------------------------------- verdict


def outcome_counts(records: list[SoakRecord]) -> dict[str, int]:
    counts = Counter(r.outcome for r in records)
    return {k: counts.get(k, 0) for k in OUTCOMES}


def checks(run: SoakRun) -> list[dict[str, Any]]:
    """(id, status, message) of what the soak must show; status ok, fail or skipped."""
    out = []
    counts = outcome_counts(run.records)
    lost = sum(counts[k] for k in LOST)
    out.append(
        _check(
            "soak.lost",
            lost == 0,
            f"{lost} request(s) lost "
            f"({counts['broken']} broken, {counts['timed_out']} past their deadline)",
        )
    )
    past = [r for r in run.records if r.bucket == "past_context"]
    bad = [r for r in past if r.outcome not in ("refused_length",) + LOST]
    out.append(
        _check(
            "soak.past_context_refused",
            not bad,
            f"{len(past) - len(bad)} of {len(past)} prompts past the context "
            "refused with HTTP 400 for length",
        )
    )
    wrong = [r for r in run.records if r.bucket != "past_context" and r.outcome == "refused_length"]
    out.append(
        _check(
            "soak.fitting_prompts_served",
            not wrong,
            f"{len(wrong)} prompt(s) within the context refused for length",
        )
    )
    if run.counters_before is None or run.counters_after is None:
        out.append(
            {
                "id": "soak.vllm_counters",
                "status": "skipped",
                "message": "the server has no /metrics: outcomes not cross-checked",
            }
        )
    else:
        grew = prom.delta(run.counters_before, run.counters_after)
        finished = grew.get("success_length", 0) + grew.get("success_stop", 0)
        ours = counts["completed"]
        # A request we disconnected counts as finished when the engine finished it before
        # the abort reached it (vLLM counts no client abort: output_processor.abort_requests).
        cut = counts["disconnected"]
        out.append(
            _check(
                "soak.vllm_counters",
                ours <= int(finished) <= ours + cut,
                f"vLLM counted {int(finished)} requests finished by length or stop "
                f"(vllm:request_success_total); the soak saw {ours} completed and {cut} it "
                "disconnected, which vLLM may have finished first (another client of this "
                "server during the soak counts too)",
            )
        )
        got = sum(r.tokens for r in run.records)
        made = grew.get("generation_tokens", 0)
        out.append(
            _check(
                "soak.vllm_tokens",
                made >= got,
                f"vLLM generated {int(made)} tokens (vllm:generation_tokens_total), "
                f"{got} reached the soak",
            )
        )
    return out


def _check(cid: str, ok: bool, message: str) -> dict[str, Any]:
    return {"id": cid, "status": "ok" if ok else "fail", "message": message}


def memory_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """{rss, pinned, gpu}: before (first sample), after (last), peak; or why not."""
    out: dict[str, Any] = {}
    for key, field_name in growth.fields(samples).items():
        values = [s[field_name] for s in samples if s.get(field_name) is not None]
        if values:
            out[key] = {"before": values[0], "after": values[-1], "peak": max(values)}
        else:
            reasons = [s.get("unavailable", {}).get(key) for s in samples]
            out[key] = {"unavailable": next((r for r in reasons if r), "not sampled")}
    return out


def build_result(cfg: SoakConfig, run: SoakRun, server: dict[str, Any]) -> dict[str, Any]:
    counts = outcome_counts(run.records)
    config = asdict(cfg)
    config.pop("api_key")
    config["url"] = wire.parse_target(cfg.url).public
    grew = (
        prom.delta(run.counters_before, run.counters_after)
        if run.counters_before is not None and run.counters_after is not None
        else None
    )
    return {
        "soak_schema_version": SOAK_SCHEMA_VERSION,
        "config": config,
        "prompt_mix": {
            "shares": dict(PROMPT_MIX),
            "sent": dict(Counter(r.bucket for r in run.records)),
        },
        "server": {**server, "max_model_len": run.context},
        "duration_s": round(run.span_s, 3),
        "requests": len(run.records),
        "outcomes": counts,
        "lost": sum(counts[k] for k in LOST),
        "overall": run.timeline.overall(run.span_s),
        "intervals": run.timeline.rows(run.span_s),
        "memory": memory_summary(run.samples),
        "growth": growth.judge(
            run.samples, cfg.interval_s, run.span_s, run.idle_from_s, cfg.idle_s
        ),
        "samples": run.samples,
        "vllm_counters": {
            "before": run.counters_before,
            "after": run.counters_after,
            "delta": grew,
        },
        "checks": checks(run),
    }


def raw_records(run: SoakRun) -> list[dict[str, Any]]:
    return [asdict(r) for r in run.records]
