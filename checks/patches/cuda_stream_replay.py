"""CUDA streams and events replayed on CPU: which stream is current, and every wait.

For proofs of vLLM code that orders work across CUDA streams (e.g. the V2
runner's PPHandler, v1/worker/gpu/pp_utils.py) on a host without a GPU.
`install(monkeypatch)` puts a `StreamModel` in place of:

- `torch.cuda.Stream(...)`: a `Stream` with identity, named in creation order
  ("default" is torch's legacy default stream, then "s1", "s2", ...);
  `wait_stream`, `wait_event` and `record_event` append an `Op` to
  `StreamModel.log` instead of reaching a driver;
- `torch.cuda.current_stream(device)`: the thread's current stream (torch
  keeps it per thread), the default stream until one is set;
- torch's setter under `torch.cuda.set_stream`: vLLM wraps that function at
  import (utils/torch_utils.py `_patched_set_stream`) to keep the stream in a
  thread-local of its own, which its `current_stream()` returns. The wrapper
  stays vLLM's; it calls the model where it called torch (`prev_set_stream`);
- `torch.cuda.stream(s)`: enters and leaves as torch's StreamContext does,
  through `torch.cuda.set_stream` (vLLM's wrapper), so vLLM's thread-local
  follows it as on a GPU;
- `Tensor.record_stream(s)`: logged.

It also empties vLLM's thread-local (monkeypatch puts it back), so a test
starts where a fresh worker thread does: nothing set, torch's default stream
current. `cuda_worker_stream` then makes vLLM's own stream current as its
`current_stream()` does on first use on a CUDA worker.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import pytest


@dataclass(frozen=True, eq=False)
class Op:
    """One logged call. `stream` waits (wait_stream, wait_event), records an
    event (record_event) or is the one named (record_stream, and "broadcast":
    the stream current when a test's replayed collective was issued); `on` is
    the stream or event waited on, the event recorded, or the tensor."""

    what: str
    stream: Stream
    on: object = None

    def touches(self, stream: Stream) -> bool:
        """Whether the op waits on, makes wait, or names `stream`."""
        on = self.on.stream if isinstance(self.on, Event) else self.on
        return self.stream is stream or on is stream


class Event:
    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    def __repr__(self) -> str:
        return f"<event on {self.stream.name}>"


class Stream:
    def __init__(self, model: StreamModel, name: str) -> None:
        self._model = model
        self.name = name

    def wait_stream(self, other: Stream) -> None:
        self._model.log.append(Op("wait_stream", self, other))

    def wait_event(self, event: Event) -> None:
        self._model.log.append(Op("wait_event", self, event))

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event(self)
        event.stream = self
        self._model.log.append(Op("record_event", self, event))
        return event

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class StreamModel:
    def __init__(self) -> None:
        self.log: list[Op] = []
        self._made = 0
        self._local = threading.local()
        self.default = Stream(self, "default")

    def new_stream(self, device=None, priority: int = 0) -> Stream:
        """torch.cuda.Stream(device=None, priority=0)."""
        self._made += 1
        return Stream(self, f"s{self._made}")

    def current_stream(self, device=None) -> Stream:
        return getattr(self._local, "stream", self.default)

    def set_stream(self, stream: Stream) -> None:
        self._local.stream = stream

    @contextlib.contextmanager
    def stream(self, stream: Stream):
        """torch.cuda.stream(stream): StreamContext's enter and exit, both
        through torch.cuda.set_stream as torch's own are."""
        import torch

        previous = torch.cuda.current_stream()
        torch.cuda.set_stream(stream)
        try:
            yield
        finally:
            torch.cuda.set_stream(previous)

    def record_stream(self, tensor, stream: Stream) -> None:
        self.log.append(Op("record_stream", stream, tensor))


def install(monkeypatch: pytest.MonkeyPatch) -> StreamModel:
    """Replay torch.cuda's streams for the test (see the module docstring)."""
    import torch
    import vllm.utils.torch_utils as torch_utils

    assert torch.cuda.set_stream is torch_utils._patched_set_stream, (
        "vLLM no longer wraps torch.cuda.set_stream: its current_stream() would not see the replay"
    )
    model = StreamModel()
    monkeypatch.setattr(torch.cuda, "Stream", model.new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", model.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", model.stream)
    monkeypatch.setattr(torch_utils, "prev_set_stream", model.set_stream)
    monkeypatch.setattr(torch_utils._current_stream_tls, "value", None, raising=False)
    monkeypatch.setattr(
        torch.Tensor, "record_stream", lambda tensor, stream: model.record_stream(tensor, stream)
    )
    return model


def cuda_worker_stream(monkeypatch: pytest.MonkeyPatch) -> Stream:
    """vLLM's current_stream() on first use, as on a CUDA worker: it makes a
    stream of its own, orders it after torch's current one and sets it current.
    The platform (CPU here) answers is_cuda() True for that one call."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import current_stream

    with monkeypatch.context() as patch:
        patch.setattr(type(current_platform), "is_cuda", lambda self: True)
        return current_stream()
