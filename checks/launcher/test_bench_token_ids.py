"""bench against a small vocabulary, and streams whose chunks carry tokens without text.

The tiny test checkpoint has 32768 ids (vLLM refuses a prompt id beyond them), and a
byte-level tokenizer: vLLM's detokenizer holds back the text of a partial UTF-8
character and drops special tokens, so a chunk can carry a token and no text; the
usage counts say how many tokens arrived.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.tools import bench

MODEL = "tiny"
MAX_LEN = 24576


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, texts: list[str]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.texts = texts
        """The text of each generated token, cycled ("" = held back by the detokenizer)."""
        self.prompts: list[list[int]] = []


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.dumps({"data": [{"id": MODEL, "max_model_len": MAX_LEN}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.prompts.append(req["prompt"])
        n, texts = req["max_tokens"], self.server.texts
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        usage = {"prompt_tokens": len(req["prompt"])}
        for i in range(n):
            choice = {"index": 0, "text": texts[i % len(texts)]}
            choice["finish_reason"] = "length" if i == n - 1 else None
            chunk = {"choices": [choice], "usage": {**usage, "completion_tokens": i + 1}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {"choices": [], "usage": {**usage, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def server():
    def start(texts: list[str]) -> tuple[_Server, str]:
        srv = _Server(texts)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    started: list[_Server] = []
    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


def test_tokens_without_text_still_count(server):
    # The last token of every stream is text-less: the whole of a 1-token prefill request.
    srv, url = server(["a", "", "b", ""])
    cfg = bench.BenchConfig(url=url, model=MODEL, concurrency=(1, 4), decode_tokens=8,
                            prompt_lengths=(300,), warmup=0, runs=1)  # fmt: skip
    records = bench.run_bench(cfg)
    assert [r.rejection() for r in records] == [None] * len(records)
    assert all(r.tokens == r.max_tokens for r in records)
    decode = [r for r in records if r.phase == "decode"]
    # chunks with text a, "", b, "": arrivals of 1 token each, none dropped
    assert [n for _, n in decode[0].arrivals] == [1] * 8


def test_prompt_ids_stay_inside_the_given_range(server):
    srv, url = server(["x"])
    cfg = bench.BenchConfig(url=url, model=MODEL, concurrency=(1,), decode_tokens=4,
                            prompt_lengths=(2000,), warmup=0, runs=1,
                            token_id_range=(1000, 32760))  # fmt: skip
    bench.run_bench(cfg)
    ids = [t for p in srv.prompts for t in p]
    assert len(ids) == 128 + 2000 and min(ids) >= 1000 and max(ids) < 32760


def test_the_default_range_is_unchanged():
    # Same seed, same default range: the prompts earlier benches sent.
    import random

    assert bench.BenchConfig("u", "m").token_id_range == (1000, 100_000)
    a = bench.prompt_ids(50, random.Random(0))
    b = bench.prompt_ids(50, random.Random(0), (1000, 100_000))
    assert a == b and max(a) >= 32768  # beyond the tiny vocabulary: hence the option


def test_cli_takes_the_range_and_records_it(server, tmp_path):
    srv, url = server(["y"])
    facts = tmp_path / "facts.json"
    facts.write_text("{}")
    result = CliRunner().invoke(
        main,
        ["bench", "--url", url, "--served-model-name", MODEL, "--concurrency", "1",
         "--decode-tokens", "4", "--prompt-lengths", "100", "--warmup", "0", "--runs", "1",
         "--token-id-range", "1000,32760", "--facts", str(facts), "--json"],
        catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output[result.output.index("{") :])
    assert doc["config"]["token_id_range"] == [1000, 32760]
    assert max(t for p in srv.prompts for t in p) < 32760


@pytest.mark.parametrize("value", ["5", "10,5", "1,2,3", "a,b", "-1,5"])
def test_cli_refuses_a_bad_range(value):
    result = CliRunner().invoke(main, ["bench", "--url", "http://x:1", "--token-id-range", value])
    assert result.exit_code == 2 and "LO,HI" in result.output
