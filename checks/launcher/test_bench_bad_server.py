"""bench against a bad server (issue 39, class 8 and bench's part of class 1): garbage
is a clean error, time is bounded by --deadline, memory by the options, credentials in
the URL never reach the results, and an IPv6 URL works."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.cli import main  # noqa: E402
from flashnext.tools import bench  # noqa: E402
from harness import MODEL_NAME, start_standin  # noqa: E402

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"
CARD = {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "max_model_len": 4096}]}
CARD_BODY = json.dumps(CARD).encode()


def chunk(text="x", usage=None, finish=None):
    doc = {"id": "c", "object": "text_completion", "model": MODEL_NAME,
           "choices": [{"index": 0, "text": text, "finish_reason": finish}]}  # fmt: skip
    if usage is not None:
        doc["usage"] = usage
    return json.dumps(doc)


class Scripted:
    """A server whose /v1/models body and completion stream a test scripts."""

    def __init__(self, models: bytes, stream, status: int = 200) -> None:
        self.models, self.stream, self.status = models, stream, status
        script = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", str(len(script.models)))
                self.end_headers()
                self.wfile.write(script.models)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(script.status)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                try:
                    for piece in script.stream():
                        self.wfile.write(piece)
                        self.wfile.flush()
                except OSError:
                    pass  # the client left: what a bounded client does

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted():
    made: list[Scripted] = []

    def make(models=CARD_BODY, stream=lambda: iter(()), status=200):
        made.append(Scripted(models, stream, status))
        return made[-1].url

    yield make
    for s in made:
        s.close()


def one_decode(url: str, **kw) -> bench.StreamRecord:
    cfg = bench.BenchConfig(url=url, model=MODEL_NAME, concurrency=(1,), decode_tokens=4,
                            decode_prompt_tokens=8, prompt_lengths=(), warmup=0, runs=1,
                            **kw)  # fmt: skip
    (rec,) = bench.run_bench(cfg)
    return rec


@pytest.mark.parametrize(
    ("models", "why"),
    [
        (b"[1, 2]", "not an OpenAI model list"),
        (json.dumps({"data": ["a", "b"]}).encode(), "not an OpenAI model list"),
        (json.dumps({"data": {"id": MODEL_NAME}}).encode(), "not an OpenAI model list"),
        (b"[" * 100_000, "nested too deeply"),
        (b"\xff{", "is not JSON"),
        (json.dumps({"data": [{"id": MODEL_NAME, "max_model_len": "big"}]}).encode(),
         "max_model_len 'big' is not a token count"),
    ],
)  # fmt: skip
def test_garbage_model_lists_are_clean_errors(scripted, models, why):
    url = scripted(models=models)
    with pytest.raises(bench.BenchError, match=why):
        one_decode(url)


def test_garbage_model_list_through_the_cli_is_one_line_no_traceback(scripted):
    url = scripted(models=b"[[]]")
    res = CliRunner().invoke(main, ["bench", "--url", url, "--facts", str(FACTS),
                                    "--concurrency", "1", "--prompt-lengths", ""])  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "not an OpenAI model list" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ("[1, 2, 3]", "a stream chunk is a list, not an object"),
        (chunk(usage="lots"), "usage is a str, not an object"),
        (chunk(usage={"completion_tokens": "1"}), "usage.completion_tokens is '1'"),
        (json.dumps({"choices": {"text": "x"}}), "choices is not a list of objects"),
        (json.dumps({"choices": [{"text": 7}]}), "a choice's text is a int"),
        ("[" * 50_000, "nested too deeply"),
    ],
)
def test_garbage_stream_chunks_reject_the_stream(scripted, payload, why):
    url = scripted(stream=lambda: iter([f"data: {payload}\n\n".encode()]))
    rec = one_decode(url)
    assert why in rec.rejection()


def test_a_server_trickling_keepalives_cannot_outlast_the_deadline(scripted):
    def trickle():
        yield f"data: {chunk(usage={'completion_tokens': 1, 'prompt_tokens': 8})}\n\n".encode()
        while True:  # an SSE comment line every 50 ms, forever
            time.sleep(0.05)
            yield b": keep-alive\n"

    url = scripted(stream=trickle)
    started = time.monotonic()
    rec = one_decode(url, deadline_s=1.5)
    assert time.monotonic() - started < 5.0
    assert "deadline passed" in rec.rejection()


def test_the_deadline_option_through_the_cli(scripted):
    def silent():
        time.sleep(30)
        yield b""

    url = scripted(stream=silent)
    started = time.monotonic()
    res = CliRunner().invoke(main, ["bench", "--url", url, "--facts", str(FACTS),
                                    "--concurrency", "1", "--prompt-lengths", "",
                                    "--decode-tokens", "4", "--runs", "1", "--warmup", "0",
                                    "--deadline", "1"])  # fmt: skip
    assert time.monotonic() - started < 10.0
    assert res.exit_code == 1
    assert "bench: rejected decode c=1 run 0: ReadTimeout" in res.output


def test_a_line_without_end_is_cut_at_the_cap(scripted, monkeypatch):
    from flashnext.tools import wire

    monkeypatch.setattr(wire, "MAX_SSE_LINE_BYTES", 64 << 10)
    monkeypatch.setattr(wire.sse_lines, "__defaults__", (64 << 10,))

    def endless():
        while True:
            yield b"x" * 8192

    rec = one_decode(scripted(stream=endless))
    assert "an event-stream line exceeds 65536 bytes" in rec.rejection()


def test_more_tokens_than_asked_stop_the_stream(scripted):
    def flood():
        for n in range(1, 100_000):
            yield f"data: {chunk(usage={'completion_tokens': n, 'prompt_tokens': 8})}\n\n".encode()

    rec = one_decode(scripted(stream=flood))
    assert rec.rejection() == "the server sent 5 tokens, asked for 4"
    assert len(rec.arrivals) == 5


def test_a_huge_error_body_is_read_only_in_part(scripted):
    def endless():  # an error body that never ends (for 20 s; a client reading all waits)
        yield b'{"error": {"message": "'
        stop = time.monotonic() + 20
        while time.monotonic() < stop:
            yield b"y" * (1 << 20)

    started = time.monotonic()
    rec = one_decode(scripted(stream=endless, status=500))
    assert time.monotonic() - started < 10
    assert rec.rejection().startswith('HTTP 500: {"error": {"message": "yyy')
    assert len(rec.rejection()) < 400


def test_vllms_error_chunk_mid_stream_is_a_rejection(scripted):
    err = {"error": {"message": "The server had an error while processing your request.",
                     "type": "InternalServerError", "param": None, "code": 500}}  # fmt: skip
    url = scripted(stream=lambda: iter([f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()]))
    assert one_decode(url).rejection() == (
        "the server's error mid-stream: The server had an error while processing your request."
    )


@pytest.fixture
def standin():
    procs = []

    def start(**kw):
        proc, url = start_standin(**kw)
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def test_url_credentials_never_reach_the_results(standin, tmp_path):
    url = standin(STANDIN_TOKEN_INTERVAL_S="0.001")
    secret_url = url.replace("http://", "http://alice:s3cr3t@")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "--url", secret_url, "--facts", str(FACTS),
                                    "--concurrency", "1", "--prompt-lengths", "16",
                                    "--decode-tokens", "4", "--runs", "1", "--warmup", "0",
                                    "--out", str(out), "--json"])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["config"]["url"] == url.replace("http://", "http://<redacted>@")
    for text in (res.output, *(f.read_text() for f in out.iterdir())):
        assert "s3cr3t" not in text and "alice" not in text


def test_an_ipv6_url_works(standin):
    url = standin(host="::1", STANDIN_TOKEN_INTERVAL_S="0.001")
    assert url.startswith("http://[::1]:")
    rec = one_decode(url)
    assert rec.rejection() is None


def test_memory_is_bounded_by_the_options():
    # A batch's prompts are built in memory: their product is refused before any request
    # (nothing listens at this URL: a request would fail differently).
    res = CliRunner().invoke(main, ["bench", "--url", "http://127.0.0.1:9", "--facts",
                                    str(FACTS), "--prompt-lengths", "262144",
                                    "--prefill-concurrency", "64"])  # fmt: skip
    assert res.exit_code == 2, res.output
    assert (
        "--prefill-concurrency 64 x --prompt-lengths 262144 = 16777216 prompt tokens held "
        "at once, more than 8388608"
    ) in " ".join(res.output.split())
