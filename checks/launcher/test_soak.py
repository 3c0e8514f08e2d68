"""`flashnext bench --soak`: the request mix and arithmetic exactly, then whole soaks
against the stand-in `vllm` (vLLM 0.33.0's length refusals, queue, stop strings and
/metrics counters) and against servers that break, hang or die."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.cli import main  # noqa: E402
from flashnext.tools import soak  # noqa: E402
from harness import MODEL_NAME, start_standin  # noqa: E402

CTX = 2048

# ---------------------------------------------------------------- the mix, exactly


def test_the_request_mix_follows_its_stated_shares_and_bounds():
    cfg = soak.SoakConfig(url="http://127.0.0.1:1", model="m", max_tokens=64,
                          long_prompt_tokens=1500, stops=("x",))  # fmt: skip
    rng = random.Random(7)
    plans = [soak.plan_request(rng, cfg, CTX) for _ in range(20_000)]
    share = Counter(p.bucket for p in plans)
    for bucket, want in soak.PROMPT_MIX:
        assert abs(share[bucket] / len(plans) - want) < 0.015, (bucket, share)
    for p in plans:
        if p.bucket == "past_context":
            assert CTX < p.prompt_tokens <= CTX + soak.PAST_CONTEXT_EXTRA
        else:
            assert 16 <= p.prompt_tokens <= 1500
        assert 1 <= p.max_tokens <= 64
        assert p.disconnect_after is None or 1 <= p.disconnect_after < p.max_tokens
    assert abs(sum(p.stop == "x" for p in plans) / len(plans) - cfg.stop_share) < 0.015
    cut = sum(p.disconnect_after is not None for p in plans) / len(plans)
    assert abs(cut - cfg.disconnect_share * 63 / 64) < 0.015  # max_tokens 1 is never cut
    # the same seed, the same requests
    again = random.Random(7)
    assert [soak.plan_request(again, cfg, CTX) for _ in range(50)] == plans[:50]


def test_percentiles_are_nearest_rank():
    values = list(range(1, 101))
    assert soak.percentile(values, 50) == 50
    assert soak.percentile(values, 99) == 99
    assert soak.percentile([3.0], 99) == 3.0
    assert soak.percentile([], 50) is None


def test_intervals_count_tokens_latencies_and_ends_where_they_happened():
    tl = soak.Timeline(interval_s=2.0)
    tl.sent(0.1)
    tl.tokens(0.5, 1, ttft=0.4, gap=None)
    tl.tokens(1.5, 2, ttft=None, gap=1.0)  # two tokens in one chunk: 0.5 s each
    tl.tokens(2.5, 1, ttft=None, gap=1.0)
    tl.ended(2.5, "completed")
    rows = tl.rows(3.0)
    assert [(r["t0_s"], r["t1_s"], r["tokens"]) for r in rows] == [(0, 2, 3), (2, 3, 1)]
    assert rows[0]["decode_tok_s"] == 1.5 and rows[1]["decode_tok_s"] == 1.0
    assert rows[0]["itl_s"] == {"p50": 0.5, "p99": 0.5, "n": 2}
    assert rows[0]["ttft_s"]["p50"] == 0.4 and rows[1]["ended"] == {"completed": 1}
    overall = tl.overall(3.0)
    assert overall["tokens"] == 4 and overall["itl_s"]["n"] == 3


@pytest.mark.parametrize(
    ("change", "outcome", "why"),
    [
        ({}, "completed", None),
        ({"done": False}, "broken", "the stream ended without [DONE] and without an error"),
        ({"finish_reason": None}, "broken", "finish_reason None"),
        ({"usage_tokens": 9}, "broken", "usage says 9 tokens, 8 arrived"),
        ({"tokens": 7, "usage_tokens": 7}, "broken",
         "finish_reason length after 7 tokens, room for 8"),
        ({"finish_reason": "stop", "tokens": 3, "usage_tokens": 3}, "completed", None),
        ({"prompt_tokens": CTX - 5, "tokens": 5, "usage_tokens": 5}, "completed", None),
    ],
)  # fmt: skip
def test_a_stream_read_to_its_end_is_classified(change, outcome, why):
    rec = soak.SoakRecord(0, 0, "short", 100, 8, None, None, tokens=8, usage_tokens=8,
                          finish_reason="length", done=True)  # fmt: skip
    for k, v in change.items():
        setattr(rec, k, v)
    assert soak.classify_stream(rec, CTX) == (outcome, why)


def test_only_vllms_length_errors_count_as_refused_for_length():
    real = {"message": "This model's maximum context length is 2048 tokens. However, your "
            "prompt contains 2050 input tokens, ...", "type": "BadRequestError",
            "param": "input_tokens", "code": 400}  # fmt: skip
    assert soak.is_length_refusal(400, real)
    assert soak.is_length_refusal(400, {"param": "max_tokens", "message": "max_tokens must be"})
    assert not soak.is_length_refusal(400, {"param": "temperature", "message": "bad"})
    assert not soak.is_length_refusal(500, real)


# ---------------------------------------------------------------- whole soaks


@pytest.fixture
def standin():
    procs = []

    def start(**env):
        proc, url = start_standin(max_model_len=CTX, extra=("--max-num-seqs", "2"), **env)
        procs.append(proc)
        return proc, url

    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(10)


def soak_cli(url: str, *more: str) -> tuple[int, dict | str, float]:
    started = time.monotonic()
    res = CliRunner().invoke(main, ["bench", "--url", url, "--soak-interval", "1",
                                    "--soak-max-tokens", "24", "--soak-long-prompt", "1500",
                                    "--stop", " tok3", *more])  # fmt: skip
    took = time.monotonic() - started
    try:
        return res.exit_code, json.loads(res.stdout), took
    except ValueError:
        return res.exit_code, res.output, took


def test_a_soak_accounts_for_every_request(standin, tmp_path):
    _, url = standin(STANDIN_TOKEN_INTERVAL_S="0.004", STANDIN_PREFILL_TOK_S="500000")
    rc, doc, took = soak_cli(url, "--soak", "4", "--json", "--out", str(tmp_path / "o"))
    assert rc == 0, doc
    assert took < 4 + 15
    recs = doc["records"]
    assert len(recs) == doc["requests"] > 20
    outcomes = doc["outcomes"]
    assert sum(outcomes.values()) == doc["requests"] and doc["lost"] == 0
    assert outcomes["completed"] > 0 and outcomes["disconnected"] > 0
    past = [r for r in recs if r["bucket"] == "past_context"]
    assert outcomes["refused_length"] == len(past)
    assert all(r["status"] == 400 for r in past)
    assert any(r["finish_reason"] == "stop" for r in recs)  # the stop string ended some
    # 4 clients: 2 x the server's --max-num-seqs, read from its command line
    assert doc["config"]["clients"] == 4 and doc["server"]["max_num_seqs"] == 2
    assert doc["server"]["max_num_seqs_source"] == "the server's command line"
    assert all("waiting" in s["vllm"] for s in doc["samples"])  # its queue, followed
    assert {c["id"]: c["status"] for c in doc["checks"]} == {
        "soak.lost": "ok", "soak.past_context_refused": "ok",
        "soak.fitting_prompts_served": "ok", "soak.vllm_counters": "ok", "soak.vllm_tokens": "ok",
    }  # fmt: skip
    # the server runs here: its memory was sampled over time
    assert doc["server"]["local"] is True
    rss = doc["memory"]["rss"]
    assert 0 < rss["before"] <= rss["peak"] and rss["after"] <= rss["peak"]
    assert "gpu" in doc["memory"]  # numbers, or NVML's reason on a host without it
    assert doc["overall"]["decode_tok_s"] > 0 and doc["overall"]["itl_s"]["p99"] is not None
    assert len(doc["intervals"]) >= 4
    out = tmp_path / "o"
    assert (out / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "records.jsonl").read_text().splitlines()) == doc["requests"]
    saved = json.loads((out / "soak.json").read_text())
    assert saved["outcomes"] == outcomes


def test_the_table_for_people(standin):
    _, url = standin(STANDIN_TOKEN_INTERVAL_S="0.004")
    res = CliRunner().invoke(main, ["bench", "--url", url, "--soak", "2", "--soak-interval",
                                    "1", "--soak-max-tokens", "8"])  # fmt: skip
    assert res.exit_code == 0, res.output
    for title in ("soak per interval", "soak overall:", "lost (must be 0)", "server memory",
                  "soak checks", "pass --out DIR for the raw records"):  # fmt: skip
        assert title in res.output


def test_streams_cut_without_an_error_are_lost(standin):
    _, url = standin(STANDIN_TRUNCATE_AFTER="2", STANDIN_TOKEN_INTERVAL_S="0.002")
    rc, doc, _ = soak_cli(url, "--soak", "2", "--json", "--soak-disconnect-share", "0")
    assert rc == 1
    assert doc["lost"] == doc["outcomes"]["broken"] > 0
    assert {c["id"]: c["status"] for c in doc["checks"]}["soak.lost"] == "fail"
    broken = [r for r in doc["records"] if r["outcome"] == "broken"]
    assert {r["error"] for r in broken} == {"the stream ended without [DONE] and without an error"}


def test_a_server_that_stalls_cannot_hold_the_soak_past_the_deadlines():
    class Stall(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            body = json.dumps({"data": [{"id": MODEL_NAME, "max_model_len": CTX}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for _ in range(600):  # keep-alives, never a token
                    self.wfile.write(b": ping\n\n")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stall)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        rc, doc, took = soak_cli(url, "--soak", "1", "--request-deadline", "2", "--json",
                                 "--soak-clients", "3")  # fmt: skip
    finally:
        server.shutdown()
    assert rc == 1
    assert took < 1 + 2 + 12  # duration + request deadline + reading the counters
    assert doc["outcomes"]["timed_out"] == doc["requests"] - doc["outcomes"]["refused_length"]
    assert doc["lost"] == doc["outcomes"]["timed_out"] > 0
    checks = {c["id"]: c for c in doc["checks"]}
    assert checks["soak.vllm_counters"]["status"] == "skipped"  # this server has no /metrics


def test_a_server_killed_mid_soak_breaks_requests_without_a_hang(standin):
    proc, url = standin(STANDIN_TOKEN_INTERVAL_S="0.01")
    killer = threading.Timer(1.0, os.kill, (proc.pid, signal.SIGKILL))
    killer.start()
    rc, doc, took = soak_cli(url, "--soak", "3", "--json", "--request-deadline", "30")
    assert rc == 1 and took < 3 + 15
    assert doc["outcomes"]["broken"] > 0 and doc["outcomes"]["timed_out"] == 0


def test_without_matplotlib_the_soak_says_how_to_get_the_picture(standin, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    _, url = standin(STANDIN_TOKEN_INTERVAL_S="0.002")
    res = CliRunner().invoke(main, ["bench", "--url", url, "--soak", "1", "--soak-max-tokens",
                                    "4", "--out", str(tmp_path)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "bench --soak: no picture: matplotlib is not installed" in res.output
    assert "-m pip install 'matplotlib>=3.8'" in res.output
    assert not (tmp_path / "soak.png").exists() and (tmp_path / "soak.json").exists()


@pytest.mark.parametrize("value", ["0", "-5", "5x", "8d", "nan"])
def test_a_bad_duration_is_a_usage_error(value):
    res = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "--soak", value])
    assert res.exit_code == 2
    assert "expected a duration like 300, 90s, 5m or 2h" in res.output
