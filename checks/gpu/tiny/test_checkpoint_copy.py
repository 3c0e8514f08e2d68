"""checks/gpu/tiny/checkpoint_copy.py: rewriting tensors in a copy of a real sharded checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from bf16_checkpoint import bf16_exact, read_bf16, write_checkpoint
from checkpoint_copy import CheckpointEditError, edited_copy, from_float32, to_float32


@pytest.fixture
def src(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "x.weight": bf16_exact(rng.standard_normal((3, 4))),
        "y.weight": bf16_exact(rng.standard_normal(5)),
    }
    return write_checkpoint(tmp_path / "src", {"s.safetensors": tensors})


def test_bf16_rounds_to_nearest_even_like_torch():
    one_and_a_half_ulp = np.array([1.0 + 3 * 2**-9], np.float32)  # between 1+2**-8 and 1+2**-7
    assert to_float32(from_float32(one_and_a_half_ulp, "BF16"), "BF16")[0] == np.float32(
        1.0 + 2**-7
    )


def test_only_the_edited_tensor_changes_and_the_record_is_written(src, tmp_path):
    before = read_bf16(src / "s.safetensors", "y.weight")
    dst = edited_copy(
        src,
        tmp_path / "dst",
        lambda r: {"x.weight": r.read("x.weight") * 2},
        "rec.json",
        {"why": "test"},
    )
    assert np.array_equal(
        read_bf16(dst / "s.safetensors", "x.weight"),
        2 * read_bf16(src / "s.safetensors", "x.weight"),
    )
    assert np.array_equal(read_bf16(dst / "s.safetensors", "y.weight"), before)
    assert json.loads((dst / "rec.json").read_text()) == {"why": "test"}


def test_a_wrong_shape_or_an_unknown_name_writes_nothing(src, tmp_path):
    with pytest.raises(CheckpointEditError, match="new shape"):
        edited_copy(src, tmp_path / "dst", lambda r: {"x.weight": np.zeros((4, 3))}, "r.json", {})
    with pytest.raises(CheckpointEditError, match="no tensor z.weight"):
        edited_copy(src, tmp_path / "dst", lambda r: {"z.weight": np.zeros(1)}, "r.json", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_failure_while_writing_leaves_no_staging_directory(src, tmp_path, monkeypatch):
    import checkpoint_copy

    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_copy, "from_float32", fail)
    with pytest.raises(OSError, match="disk full"):
        edited_copy(src, tmp_path / "dst", lambda r: {"x.weight": r.read("x.weight")}, "r.json", {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
