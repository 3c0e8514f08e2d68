"""The offload decode kernels compile every variant before CUDA graph capture.

A FULL decode graph captures ``qsa_offload_decode`` once per batch size; a
kernel variant first needed inside a capture would be compiled and loaded
mid-capture. Triton compiles one variant per distinct *specialization key*:
the constexpr values plus, for every argument it specializes, a class of the
runtime value (an int equal to 1, an int divisible by 16, any other int, and
int32 vs int64 range; a pointer 16-byte aligned or not). These tests record
the key of every decode launch for every batch size the workspace admits and
check that ``warmup_offload_decode`` launched each of them. The kernels
themselves are stood in by recorders (no GPU here); the interpreter run of
the real warmup is in interpret_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

HEADS, KV_HEADS, DIM, WIDTH, BLOCK = 4, 2, 32, 40, 16
# Batch-varying scalars of the decode path: never specialized.
BATCH_VARYING = {
    "_attend_kernel": {
        "chunk_start", "chunk_end", "row_start", "selection_row_start", "only_request",
        "num_rows", "num_requests",
    },
    "_finalize_kernel": {"num_rows", "row_start"},
}  # fmt: skip
DECODE_KERNELS = ("_attend_kernel", "_finalize_kernel")


def value_class(param, value):
    """What Triton's specialization sees of one argument (see the module doc)."""
    if param.is_constexpr:
        return ("constexpr", value)
    if isinstance(value, torch.Tensor):
        return ("ptr", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("i1",)
    if isinstance(value, int):
        width = "i32" if -(2**31) <= value < 2**31 else "i64"
        if param.do_not_specialize:
            return (width,)
        return (width, value == 1, value % 16 == 0)
    return (type(value).__name__,)


class Recorder:
    """Stands in for a Triton kernel: records each launch's specialization key."""

    def __init__(self, name, kernel, keys):
        self.name, self.params, self.keys = name, kernel.params, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = dict(zip((p.name for p in self.params), args, strict=False)) | kwargs
            key = tuple(
                (p.name, value_class(p, named[p.name])) for p in self.params if p.name in named
            )
            opts = tuple(sorted((k, v) for k, v in kwargs.items() if k.startswith("num_")))
            self.keys.add((self.name, key, opts))

        return launch


def decode_inputs(rows: int, workspace_rows: int):
    """Persistent buffers sliced to ``rows``, as the layer hands them over."""
    q = torch.zeros(workspace_rows, HEADS, DIM, dtype=torch.bfloat16)
    indices = torch.zeros(workspace_rows, WIDTH + 1, dtype=torch.int32)
    table = torch.zeros(workspace_rows, 3, dtype=torch.int32)
    token_to_req = torch.zeros(workspace_rows, dtype=torch.int32)
    out = torch.empty_like(q)
    return q[:rows], indices[:rows], table[:rows], token_to_req[:rows], out[:rows]


@pytest.fixture
def recorder(offload, monkeypatch):
    """Swaps the decode kernels for recorders; returns keys[phase] -> launch keys."""
    keys: dict[str, set] = {}
    phase = ["warmup"]

    class PhaseKeys:
        def add(self, item):
            keys.setdefault(phase[0], set()).add(item)

    for name in DECODE_KERNELS:
        monkeypatch.setattr(offload, name, Recorder(name, getattr(offload, name), PhaseKeys()))
    return keys, phase


def variants_missed_by_the_warmup(offload, recorder, workspace_rows: int) -> set:
    """Launch keys that some batch size 1..capacity needs and the warmup did not make."""
    keys, phase = recorder
    arena = torch.zeros(4, BLOCK, KV_HEADS, 2 * DIM, dtype=torch.bfloat16)
    k_cache, v_cache = arena[..., :DIM], arena[..., DIM:]
    ws = offload.OffloadWorkspace.allocate(
        max_rows=workspace_rows, num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM,
        chunk_tokens=8, dtype=torch.bfloat16, device="cpu", selection_width=WIDTH,
    )  # fmt: skip
    table = decode_inputs(1, workspace_rows)[2]
    phase[0] = "warmup"
    warmed = offload.warmup_offload_decode(
        k_cache, v_cache, table, ws, num_q_heads=HEADS, selection_width=WIDTH, max_splits=16
    )
    capacity = ws.row_sum.numel() // HEADS
    assert warmed == offload.decode_split_variants(capacity, 16, selection_width=WIDTH)
    phase[0] = "decode"
    for rows in range(1, capacity + 1):
        q, indices, table, token_to_req, out = decode_inputs(rows, workspace_rows)
        splits = offload.decode_splits(rows, capacity, 16)
        offload.qsa_offload_decode(
            q, k_cache, v_cache, indices, table, token_to_req, q, out, ws, splits=splits
        )
    assert keys["decode"]
    return keys["decode"] - keys["warmup"]


@pytest.mark.parametrize("workspace_rows", [1, 5, 64, 300])
def test_warmup_covers_every_decode_variant_of_every_batch_size(offload, recorder, workspace_rows):
    missing = variants_missed_by_the_warmup(offload, recorder, workspace_rows)
    assert not missing, sorted(missing)[:3]


def test_a_specialized_batch_scalar_would_be_caught(offload, recorder, monkeypatch):
    """The check above can fail: with num_rows specialized, batch sizes 16, 32, ...
    need variants the one-row warmup never compiled."""
    rows_param = next(p for p in offload._attend_kernel.params if p.name == "num_rows")
    monkeypatch.setattr(rows_param, "do_not_specialize", False)
    assert variants_missed_by_the_warmup(offload, recorder, 64)


def test_batch_varying_scalars_are_not_specialized(offload):
    for name, names in BATCH_VARYING.items():
        params = {p.name: p for p in getattr(offload, name).params}
        assert names <= params.keys(), names - params.keys()
        assert {n for n, p in params.items() if p.do_not_specialize} == names


@pytest.mark.parametrize("capacity", [1, 2, 15, 16, 17, 512, 8192])
def test_decode_splits_are_powers_of_two_that_fit(offload, capacity):
    seen = set()
    for rows in range(1, capacity + 1):
        s = offload.decode_splits(rows, capacity, 16)
        assert s & (s - 1) == 0 and 1 <= s <= 16 and s * rows <= capacity
        seen.add(s)
    assert tuple(sorted(seen)) == offload.decode_split_variants(capacity, 16)
    assert len(seen) <= 5
    with pytest.raises(ValueError, match="do not fit"):
        offload.decode_splits(capacity + 1, capacity, 16)
