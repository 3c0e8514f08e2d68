"""The stand-in `vllm` and the bench client speak vLLM 0.33.0's own OpenAI protocol.

The launcher tests run the supervisor and the bench against the stand-in; these
tests tie that double to the real thing: every body the stand-in sends parses
as vLLM's own response models, and the request the bench sends parses as
vLLM's CompletionRequest with no field left unknown (an unknown field would be
silently ignored by the server, e.g. a misspelt `ignore_eos`).
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from flashnext.tools import bench  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import (  # noqa: E402
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorResponse, ModelList  # noqa: E402

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"
sys.path.insert(0, str(STANDIN))
from harness import MODEL_NAME, start_standin  # noqa: E402


def strict(model_cls, doc):
    parsed = model_cls.model_validate(doc)
    assert not parsed.model_extra, f"{model_cls.__name__} ignores {sorted(parsed.model_extra)}"
    return parsed


@pytest.fixture(scope="module")
def url():
    proc, base = start_standin()
    yield base
    proc.terminate()
    proc.wait(10)


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_bench_request_is_a_vllm_completion_request():
    body = bench.completion_body(MODEL_NAME, [1000, 1001, 1002], 16)
    req = strict(CompletionRequest, body)
    assert req.ignore_eos is True and req.max_tokens == 16 and req.prompt == [1000, 1001, 1002]
    assert req.stream_options.include_usage and req.stream_options.continuous_usage_stats


def test_standin_model_list_is_vllms(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        models = strict(ModelList, json.loads(resp.read()))
    assert [(c.id, c.max_model_len) for c in models.data] == [(MODEL_NAME, 262144)]


def test_standin_completion_is_vllms(url):
    status, raw = post(
        url + "/v1/completions", {"model": MODEL_NAME, "prompt": "a b", "max_tokens": 3}
    )
    assert status == 200
    resp = strict(CompletionResponse, json.loads(raw))
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_standin_stream_chunks_are_vllms(url):
    status, raw = post(url + "/v1/completions", bench.completion_body(MODEL_NAME, [5] * 7, 4))
    assert status == 200
    events = [line[len(b"data: ") :] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [strict(CompletionStreamResponse, json.loads(e)) for e in events[:-1]]
    assert [c.usage.completion_tokens for c in chunks] == [1, 2, 3, 4, 4]
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []


def test_standin_errors_are_vllms(url):
    status, raw = post(url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert strict(ErrorResponse, json.loads(raw)).error.code == 404
