"""checks/gpu/narrow_head.py on a real two-shard safetensors checkpoint."""

from __future__ import annotations

import json

import narrow_head
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

VOCAB, HIDDEN = 16, 4


@pytest.fixture
def checkpoint(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    head = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    embed = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16)
    save_file({"mtp.fc.weight": np.ones((2, 2), np.float32), "lm_head.weight": head},
              str(src / "b.safetensors"), metadata={"format": "pt"})  # fmt: skip
    save_file({"model.embed_tokens.weight": embed}, str(src / "a.safetensors"))
    weight_map = {"lm_head.weight": "b.safetensors", "mtp.fc.weight": "b.safetensors",
                  "model.embed_tokens.weight": "a.safetensors"}  # fmt: skip
    (src / narrow_head.INDEX).write_text(json.dumps({"weight_map": weight_map}))
    (src / "config.json").write_text("{}")
    return src, head


def test_only_the_kept_rows_survive_and_everything_else_is_copied(checkpoint, tmp_path):
    src, head = checkpoint
    dst = narrow_head.narrow(src, tmp_path / "dst", (3, 11))

    tensors = load_file(str(dst / "b.safetensors"))
    narrowed = tensors["lm_head.weight"]
    assert narrowed.dtype == np.float32 and narrowed.shape == head.shape
    assert np.array_equal(narrowed[[3, 11]], head[[3, 11]])
    others = [r for r in range(VOCAB) if r not in (3, 11)]
    assert not narrowed[others].any()
    assert np.array_equal(tensors["mtp.fc.weight"], np.ones((2, 2), np.float32))
    # Greedy over the narrowed head: a kept token, or token 0 when both kept
    # logits are negative (exact ties at 0; argmax takes the first).
    hidden = np.random.default_rng(1).standard_normal((64, HIDDEN)).astype(np.float32)
    picks = set((hidden @ narrowed.T).argmax(axis=-1).tolist())
    assert picks <= {0, 3, 11} and len(picks) > 1
    # Same header (metadata included), same size: only the head's bytes changed.
    a, b = (src / "b.safetensors").read_bytes(), (dst / "b.safetensors").read_bytes()
    assert len(a) == len(b) and a[:64] == b[:64]
    assert (dst / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()
    assert (dst / "config.json").read_text() == "{}"
    assert json.loads((dst / narrow_head.RECORD).read_text())["kept_tokens"] == [3, 11]


@pytest.mark.parametrize("tokens", [(0,), (VOCAB,), ()])
def test_bad_token_ids_are_refused_and_nothing_is_written(checkpoint, tmp_path, tokens):
    src, _ = checkpoint
    with pytest.raises(narrow_head.NarrowHeadError, match="--tokens"):
        narrow_head.narrow(src, tmp_path / "dst", tokens)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_the_cli_says_what_is_wrong_without_a_traceback(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    assert narrow_head.main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "model.safetensors.index.json is missing" in err and "Traceback" not in err
    assert not (tmp_path / "dst").exists()


def test_an_existing_destination_is_refused(checkpoint, tmp_path):
    src, _ = checkpoint
    (tmp_path / "dst").mkdir()
    with pytest.raises(narrow_head.NarrowHeadError, match="exists"):
        narrow_head.narrow(src, tmp_path / "dst", (3,))
