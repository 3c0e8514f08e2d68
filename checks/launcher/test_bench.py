"""bench: exact arithmetic on recorded arrivals, then the client against the stand-in."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.tools import bench  # noqa: E402
from flashnext.tools.bench import StreamRecord  # noqa: E402
from harness import (  # noqa: E402
    MODEL_NAME,
    free_port,
    start_standin,
)


def rec(t_sent, times, *, phase="decode", conc=1, run=0, prompt=128, per_chunk=1, **kw):
    r = StreamRecord(phase, conc, run, False, prompt, per_chunk * len(times), t_sent)
    r.arrivals = [(t, per_chunk) for t in times]
    r.completion_tokens = per_chunk * len(times)
    r.usage_prompt_tokens = prompt
    r.finish_reason = "length"
    r.done = True
    for k, v in kw.items():
        setattr(r, k, v)
    return r


# ---------------------------------------------------------------- arithmetic, exact


def test_single_stream_ttft_and_rate():
    # sent at 1.0, first token at 1.25, then one every 0.125 s: 8 tokens/s after the first
    r = rec(1.0, [1.25 + 0.125 * i for i in range(9)])
    assert bench.ttft_s(r) == 0.25
    assert bench.stream_decode_tok_s(r) == 8.0
    assert bench.aggregate_decode_tok_s([r]) == 8.0


def test_multi_token_chunks_count_by_usage():
    r = rec(0.0, [0.5, 1.0, 1.5], per_chunk=4)  # 12 tokens in 3 chunks
    assert r.tokens == 12
    assert bench.stream_decode_tok_s(r) == 8.0  # 8 tokens after the first chunk in 1 s


def test_aggregate_counts_only_the_window_where_all_streams_decode():
    a = rec(0.0, [1.0, 2.0, 3.0, 4.0, 5.0])
    b = rec(0.0, [2.5, 3.0, 3.5, 4.0, 4.5, 5.5])
    # window (2.5, 5.0]: a has 3.0, 4.0, 5.0; b has 3.0, 3.5, 4.0, 4.5 -> 7 tokens in 2.5 s
    assert bench.aggregate_decode_tok_s([a, b]) == 7 / 2.5
    # no overlap at all: no aggregate figure
    c = rec(0.0, [10.0, 11.0])
    assert bench.aggregate_decode_tok_s([a, c]) is None


def test_prefill_rate_is_aggregate_over_concurrent_prompts():
    # the seed's figure: 4 x 247,823 tokens, last first token 368 s after the first send
    recs = [rec(0.0, [368.0], phase="prefill", conc=4, prompt=247_823)] + [
        rec(0.0, [300.0 + i], phase="prefill", conc=4, prompt=247_823) for i in range(3)
    ]
    assert bench.prefill_tok_s(recs) == 4 * 247_823 / 368.0


def test_summary_takes_medians_over_runs_and_skips_warmups():
    recs = [
        rec(0.0, [0.5, 1.5, 2.5], run=0, warmup=True),  # 1 tok/s: would drag the median
        rec(0.0, [0.2, 0.7, 1.2], run=1),  # 2 tokens after the first in 1.0 s: 2 tok/s
        rec(0.0, [0.2, 0.3, 0.4], run=2),  # 10 tok/s
        rec(0.0, [0.1, 0.3, 0.5], run=3),  # 5 tok/s
    ]
    (d,) = bench.summarize(recs)["decode"]
    assert d["stream_tok_s"] == {"median": 5.0, "min": 2.0, "max": 10.0, "n": 3}
    assert d["ttft_s"]["median"] == pytest.approx(0.2)


def test_comparison_against_seed_and_roofline():
    summary = {
        "decode": [
            {"concurrency": 1, "aggregate_tok_s": {"median": 40.0}},
            {"concurrency": 4, "aggregate_tok_s": {"median": 153.5}},
        ],
        "prefill": [{"concurrency": 1, "prompt_tokens": 4096, "prefill_tok_s": {"median": 2000.0}}],
    }
    rows = {r["metric"]: r for r in bench.compare(summary, roofline_tok_s=160.0)}
    assert rows["decode tok/s, c=1"]["ratio"] == 0.5
    assert rows["decode tok/s, c=1 vs roofline"]["ratio"] == 0.25
    assert rows["decode tok/s, c=4"] == {
        "metric": "decode tok/s, c=4", "measured": 153.5, "reference": "152-155",
        "ratio": 1.0, "note": "",
    }  # fmt: skip
    pre = rows["prefill tok/s, 1x4096"]
    assert pre["reference"] == round(4 * 247_823 / 368, 3)
    assert pre["note"] == "reference shape 4x247823"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"done": False}, "stream ended without [DONE]"),
        ({"finish_reason": None}, "no finish_reason"),
        ({"completion_tokens": 3}, "usage says 3 tokens, asked for 4"),
        ({"usage_prompt_tokens": 7}, "server counted 7 prompt tokens, sent 128"),
        ({"error": "HTTP 500: boom"}, "HTTP 500: boom"),
    ],
)
def test_incomplete_streams_are_rejected(change, why):
    r = rec(0.0, [0.1, 0.2, 0.3, 0.4], **change)
    assert r.rejection() == why
    result = bench.build_result(
        bench.BenchConfig("http://x:1", "m"), [r], bench.fingerprint(None, None, None)
    )
    assert result["rejected"] == [{"phase": "decode", "concurrency": 1, "run": 0, "why": why}]
    assert result["comparison"] == [] and result["summary"] == {"decode": [], "prefill": []}


def test_roofline_read_from_plan_json():
    assert bench.roofline_from_plan({"decode": {"tokens_per_s": 160.53}}) == 160.53
    assert bench.roofline_from_plan({}) is None
    assert bench.roofline_from_plan(None) is None


def test_bad_url_is_refused_before_sending():
    with pytest.raises(bench.BenchError, match="is not an http\\(s\\) URL"):
        bench.run_bench(bench.BenchConfig("localhost:8000", "m"))


# ---------------------------------------------------------------- against the stand-in

INTERVAL_S = 0.02  # 50 tok/s per stream
TTFT_S = 0.1
PREFILL_TOK_S = 20000.0


@pytest.fixture
def server(tmp_path):
    def start(**env):
        log = tmp_path / "requests.jsonl"
        proc, url = start_standin(STANDIN_REQUEST_LOG=str(log), **env)
        started.append(proc)
        return url, log

    started: list[subprocess.Popen] = []
    yield start
    for p in started:
        p.terminate()
        p.wait(10)


def test_bench_against_standin_with_controlled_timing(server, tmp_path):
    url, log = server(
        STANDIN_TOKEN_INTERVAL_S=str(INTERVAL_S),
        STANDIN_TTFT_S=str(TTFT_S),
        STANDIN_PREFILL_TOK_S=str(PREFILL_TOK_S),
    )
    # 51 tokens: a 1 s decode span, so a few ms of scheduling jitter on a busy 2-core
    # machine stay small against it.
    cfg = bench.BenchConfig(
        url=url, model=MODEL_NAME, decode_tokens=51, decode_prompt_tokens=128,
        prompt_lengths=(2000,), warmup=1, runs=2,
    )  # fmt: skip
    records = bench.run_bench(cfg)
    assert len(records) == 3 * 1 + 3 * 4 + 3  # (warmup + runs) x (c=1, c=4, prefill)
    assert all(r.rejection() is None for r in records)
    result = bench.build_result(
        cfg, records, bench.fingerprint({"hostname": "h"}, {"decode": {"tokens_per_s": 160}}, {})
    )
    dec = {d["concurrency"]: d for d in result["summary"]["decode"]}
    # server emits token i at ttft + i * interval: 50 tok/s per stream, 4 x 50 at c=4
    assert dec[1]["stream_tok_s"]["median"] == pytest.approx(1 / INTERVAL_S, rel=0.12)
    assert dec[1]["aggregate_tok_s"]["median"] == pytest.approx(1 / INTERVAL_S, rel=0.12)
    assert dec[4]["aggregate_tok_s"]["median"] == pytest.approx(4 / INTERVAL_S, rel=0.12)
    # the server never emits early, so a measured TTFT is at least the scheduled one
    ttft = TTFT_S + 128 / PREFILL_TOK_S
    assert ttft <= dec[1]["ttft_s"]["min"] and dec[1]["ttft_s"]["median"] < ttft + 0.15
    (pre,) = result["summary"]["prefill"]
    ttft = TTFT_S + 2000 / PREFILL_TOK_S
    assert ttft <= pre["ttft_s"]["min"] and pre["ttft_s"]["median"] < ttft + 0.15
    assert 2000 / (ttft + 0.15) < pre["prefill_tok_s"]["median"] <= 2000 / ttft
    assert result["comparison"][0]["metric"] == "decode tok/s, c=1"

    # what went over the wire: exact token counts, streaming with usage, distinct prompts
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(sent) == len(records)
    assert all(s["ignore_eos"] and s["stream"] for s in sent)
    assert all(s["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               for s in sent)  # fmt: skip
    assert sorted({s["prompt_tokens"] for s in sent}) == [128, 2000]

    bench.write_results(tmp_path / "out", records, result)
    raw = (tmp_path / "out" / "raw.jsonl").read_text().splitlines()
    assert len(raw) == len(records)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["environment"]["sha256"]


def test_truncated_streams_are_rejected(server):
    url, _ = server(STANDIN_TRUNCATE_AFTER="3")
    cfg = bench.BenchConfig(url=url, model=MODEL_NAME, concurrency=(1,), decode_tokens=8,
                            prompt_lengths=(), warmup=0, runs=1)  # fmt: skip
    records = bench.run_bench(cfg)
    result = bench.build_result(cfg, records, bench.fingerprint(None, None, None))
    assert result["rejected"] == [
        {"phase": "decode", "concurrency": 1, "run": 0, "why": "stream ended without [DONE]"}
    ]


def test_http_errors_are_rejected(server):
    url, _ = server(STANDIN_COMPLETION_FAIL="1")
    cfg = bench.BenchConfig(url=url, model=MODEL_NAME, concurrency=(1,), decode_tokens=4,
                            prompt_lengths=(), warmup=0, runs=1)  # fmt: skip
    (r,) = bench.run_bench(cfg)
    # the message of vLLM's error body, not the body's JSON
    assert r.rejection() == "HTTP 500: stand-in told to fail completions"


def test_wrong_model_or_no_server_fails_fast_with_the_fix(server):
    url, log = server()
    with pytest.raises(bench.BenchError) as exc:
        bench.run_bench(bench.BenchConfig(url=url, model="wrong"))
    assert str(exc.value) == (
        f"{url}/v1/models: model 'wrong' not served (served: {MODEL_NAME}); start the server "
        "(`flashnext serve`) or fix --url/--served-model-name"
    )
    assert not log.exists()  # not one completion was sent
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(bench.BenchError, match=r"/v1/models: no answer; start the server"):
        bench.run_bench(bench.BenchConfig(url=dead, model=MODEL_NAME))


def test_prompts_longer_than_the_context_are_refused(server):
    url, _ = server()  # the stand-in serves --max-model-len 262144
    cfg = bench.BenchConfig(url=url, model=MODEL_NAME, prompt_lengths=(262144,))
    with pytest.raises(bench.BenchError, match="a request of 262145 tokens does not fit the "
                       "server's max_model_len 262144"):  # fmt: skip
        bench.run_bench(cfg)
