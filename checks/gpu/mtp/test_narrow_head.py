"""checks/gpu/mtp/narrow_head.py on a real two-shard safetensors checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny"))

import narrow_head  # noqa: E402
from bf16_checkpoint import bf16_exact, read_bf16, write_checkpoint  # noqa: E402
from checkpoint_copy import CheckpointEditError  # noqa: E402

VOCAB, HIDDEN = 16, 4


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    head = bf16_exact(rng.standard_normal((VOCAB, HIDDEN)))
    src = write_checkpoint(tmp_path / "src", {"b.safetensors": {"lm_head.weight": head}})
    # A second shard in another dtype, written by safetensors itself, is copied as is.
    save_file(
        {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16)},
        str(src / "a.safetensors"),
    )
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.embed_tokens.weight"] = "a.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text("{}")
    return src, head


def test_greedy_picks_among_the_kept_and_balance_tokens_with_distinct_logits(checkpoint, tmp_path):
    src, head = checkpoint
    dst = narrow_head.narrow(src, tmp_path / "dst", (3, 11), balance=7)

    narrowed = read_bf16(dst / "b.safetensors", "lm_head.weight")
    assert np.array_equal(narrowed[[3, 11]], head[[3, 11]])
    # Minus the kept rows' sum, rounded back to BF16 (8 bits of mantissa).
    assert np.allclose(narrowed[7], -(head[3] + head[11]), rtol=2**-8, atol=2**-8)
    others = [r for r in range(VOCAB) if r not in (3, 7, 11)]
    assert not narrowed[others].any()
    # Whatever the hidden state: one of the three wins, above the zero rows, and
    # the three are the top of the list with distinct logits (no tie flood).
    hidden = np.random.default_rng(1).standard_normal((512, HIDDEN)).astype(np.float32)
    logits = hidden @ narrowed.T
    picks = logits.argmax(axis=-1)
    assert set(picks.tolist()) == {3, 7, 11}
    three = logits[:, [3, 7, 11]]
    assert (three.max(axis=1) > 0).all()
    assert (np.sort(three, axis=1)[:, 1:] - np.sort(three, axis=1)[:, :-1] > 0).all()
    # Same header, same size: only the head's bytes changed.
    a, b = (src / "b.safetensors").read_bytes(), (dst / "b.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(a[:8], "little")
    assert len(a) == len(b) and a[:header_end] == b[:header_end]
    assert (dst / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()
    assert (dst / "config.json").read_text() == "{}"
    record = json.loads((dst / narrow_head.RECORD).read_text())
    assert record["kept_tokens"] == [3, 11] and record["balance_token"] == 7


@pytest.mark.parametrize(
    ("tokens", "balance"),
    [((-1,), 7), ((VOCAB,), 7), ((), 7), ((3, 11), 3), ((3, 3), 7), ((3,), VOCAB)],
)
def test_bad_token_ids_are_refused_and_nothing_is_written(checkpoint, tmp_path, tokens, balance):
    src, _ = checkpoint
    with pytest.raises(CheckpointEditError, match="--tokens"):
        narrow_head.narrow(src, tmp_path / "dst", tokens, balance)
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
    with pytest.raises(CheckpointEditError, match="exists"):
        narrow_head.narrow(src, tmp_path / "dst", (3,))
