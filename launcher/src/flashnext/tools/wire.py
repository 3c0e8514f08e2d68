"""What bench and soak read from a server, bounded and checked before use.

A server may be broken or hostile: every body is read up to a cap, every SSE line
up to a cap and a deadline (a server trickling keep-alives cannot hold a client
past it), and every JSON document is checked for the shape we index into, so
garbage is a clean `WireError` naming what was wrong, never a traceback.
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

MAX_BODY_BYTES = 16 << 20
"""/v1/models, /metrics and error bodies: vLLM's /metrics is a few hundred KiB."""
MAX_SSE_LINE_BYTES = 1 << 20
"""One `data:` line of a completion stream: a chunk of a few tokens is under 1 KiB."""
MAX_ERROR_TEXT = 300


class WireError(ValueError):
    """The server answered something that is not what the OpenAI API promises."""


class DeadlinePassed(WireError):
    """The request's deadline passed while the server kept the connection open."""


@dataclass(frozen=True)
class Target:
    """Where a server is, split once: the origin without credentials, and the
    credentials of http://user:pass@host as basic auth (never written anywhere)."""

    origin: str
    """scheme://host:port, an IPv6 host in brackets."""
    api_base: str
    """origin + the path up to and including /v1."""
    auth: tuple[str, str] | None
    public: str
    """The URL as results may show it: credentials replaced by <redacted>."""

    @property
    def completions(self) -> str:
        return self.api_base + "/completions"

    @property
    def models(self) -> str:
        return self.api_base + "/models"

    @property
    def metrics(self) -> str:
        return self.origin + "/metrics"

    @property
    def host(self) -> str:
        return urllib.parse.urlsplit(self.origin).hostname or ""


def parse_target(url: str) -> Target:
    """`url` as http(s)://[user:pass@]host[:port][/path][/v1]; WireError when it is not."""
    try:
        parsed = urllib.parse.urlsplit(url)
        port = parsed.port
    except ValueError as exc:  # a bad port or a bracket left open
        raise WireError(f"--url {_redact(url)!r} is not a valid URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise WireError(f"--url {_redact(url)!r} is not an http(s) URL, e.g. http://127.0.0.1:8000")
    host = parsed.hostname
    if ":" in host:
        host = f"[{host}]"  # IPv6: the brackets urlsplit took off
    port = port or (443 if parsed.scheme == "https" else 80)
    origin = f"{parsed.scheme}://{host}:{port}"
    base = parsed.path.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    auth = None
    if parsed.username is not None or parsed.password is not None:
        auth = (
            urllib.parse.unquote(parsed.username or ""),
            urllib.parse.unquote(parsed.password or ""),
        )
    return Target(origin, origin + base, auth, _redact(url))


def _redact(url: str) -> str:
    """`url` with any user:pass@ replaced (it is shown in errors and results)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        netloc = "<redacted>@" + netloc.rpartition("@")[2]
    return f"{scheme}://{netloc}{slash}{path}"


def headers_for(api_key: str | None, stream: bool = False) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"} if stream else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def read_capped(resp: httpx.Response, limit: int = MAX_BODY_BYTES) -> bytes:
    """The body of a streamed response, at most `limit` bytes (WireError beyond)."""
    got = bytearray()
    for piece in resp.iter_bytes():
        got += piece
        if len(got) > limit:
            raise WireError(f"{resp.url}: the answer exceeds {limit} bytes")
    return bytes(got)


def get_capped(
    target: Target, url: str, api_key: str | None, timeout_s: float, limit: int = MAX_BODY_BYTES
) -> tuple[int, bytes]:
    """(status, body) of a GET; httpx errors propagate (the caller says what failed)."""
    with (
        httpx.Client(timeout=timeout_s, auth=target.auth) as client,
        client.stream("GET", url, headers=headers_for(api_key)) as resp,
    ):
        return resp.status_code, read_capped(resp, limit)


def error_text(status: int, body: bytes) -> str:
    """`HTTP 400: message` from an OpenAI error body, else its first bytes."""
    try:
        message = json.loads(body)["error"]["message"]
        if isinstance(message, str):
            return f"HTTP {status}: {message[:MAX_ERROR_TEXT]}"
    except (ValueError, KeyError, TypeError, RecursionError):
        pass
    return f"HTTP {status}: {body[:MAX_ERROR_TEXT].decode('utf-8', 'replace')}"


def error_of(status: int, body: bytes) -> dict[str, Any]:
    """The OpenAI error object of a body ({} when there is none): message, type, param."""
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}
    return err if isinstance(err, dict) else {}


def sse_lines(
    resp: httpx.Response, deadline: float, limit: int = MAX_SSE_LINE_BYTES
) -> Iterator[str]:
    """The lines of an event stream; DeadlinePassed once time.monotonic() passes
    `deadline` (checked after every read), WireError on a line over `limit`."""
    pending = bytearray()
    for piece in resp.iter_raw():
        if time.monotonic() > deadline:
            raise DeadlinePassed("the deadline passed while the server kept the stream open")
        pending += piece
        while (cut := pending.find(b"\n")) >= 0:
            line = bytes(pending[:cut]).rstrip(b"\r")
            del pending[: cut + 1]
            yield line.decode("utf-8", "replace")
        if len(pending) > limit:
            raise WireError(f"an event-stream line exceeds {limit} bytes")
    if pending:
        yield bytes(pending).decode("utf-8", "replace")


def parse_json(data: str | bytes, what: str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise WireError(f"{what} is nested too deeply to be an API answer") from None
    except ValueError as exc:
        raise WireError(f"{what} is not JSON: {exc}") from None


@dataclass(frozen=True)
class Chunk:
    """What one streamed completion chunk says, its types checked."""

    texts: tuple[str, ...]
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None
    error: dict[str, Any] | None
    """vLLM's mid-stream error chunk ({"error": {...}}), its message and code."""


def _count(value: object, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise WireError(f"{where} is {value!r}, not a token count")
    return value


def parse_chunk(data: str) -> Chunk:
    """One `data:` payload of a completion stream (not [DONE])."""
    doc = parse_json(data, "a stream chunk")
    if not isinstance(doc, dict):
        raise WireError(f"a stream chunk is a {type(doc).__name__}, not an object")
    if "error" in doc:
        err = doc["error"]
        return Chunk((), None, None, None, err if isinstance(err, dict) else {"message": err})
    usage = doc.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise WireError(f"a stream chunk's usage is a {type(usage).__name__}, not an object")
    usage = usage or {}
    choices = doc.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise WireError("a stream chunk's choices is not a list of objects")
    texts: list[str] = []
    finish = None
    for choice in choices:
        text, why = choice.get("text"), choice.get("finish_reason")
        if text is not None and not isinstance(text, str):
            raise WireError(f"a choice's text is a {type(text).__name__}, not a string")
        if why is not None and not isinstance(why, str):
            raise WireError(f"a choice's finish_reason is {why!r}, not a string")
        texts.append(text or "")
        finish = why or finish
    return Chunk(
        tuple(texts),
        finish,
        _count(usage.get("completion_tokens"), "usage.completion_tokens"),
        _count(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        None,
    )


def parse_model_list(body: bytes, models_url: str, model: str) -> int | None:
    """max_model_len of `model` in a /v1/models answer (None when not given);
    WireError when the answer is not a model list or does not serve `model`."""
    doc = parse_json(body, f"{models_url}'s answer")
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise WireError(f"{models_url}: not an OpenAI model list (no list of objects in data)")
    for card in cards:
        if card.get("id") == model:
            max_len = card.get("max_model_len")
            if max_len is None:
                return None
            if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
                raise WireError(f"{models_url}: max_model_len {max_len!r} is not a token count")
            return max_len
    names = ", ".join(str(c.get("id"))[:80] for c in cards[:20]) or "none"
    raise WireError(f"{models_url}: model {model!r} not served (served: {names})")
