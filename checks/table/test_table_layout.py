"""Finding the PLE shards from safetensors headers, and refusing inconsistent checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flashnext.table import TableError
from flashnext.table.layout import read_layout
from flashnext.table.source import ShardReader
from ple_checkpoint import ROW_BYTES, Checkpoint, make_checkpoint


def test_layout_matches_the_writer(checkpoint: Checkpoint) -> None:
    layout = read_layout(checkpoint.path)
    assert [s.index for s in layout.shards] == list(range(checkpoint.shards))
    assert layout.rows == checkpoint.rows
    assert (layout.dim, layout.dtype, layout.row_bytes) == (160, "BF16", ROW_BYTES)
    assert layout.total_bytes == len(checkpoint.flat)
    assert layout.layer == "model.language_model.layers.1.ple"


def test_reader_returns_the_shard_bytes_across_shard_edges(checkpoint: Checkpoint) -> None:
    layout = read_layout(checkpoint.path)
    edge = checkpoint.rows_per_shard * ROW_BYTES
    with ShardReader(layout) as reader:
        for offset, length in [(0, 100), (edge - 7, 30), (3 * edge - 1, 2 * edge + 2)]:
            assert reader.read(offset, length) == checkpoint.flat[offset : offset + length]
        last = checkpoint.rows - 1
        assert reader.read_row(last) == checkpoint.flat[last * ROW_BYTES :]


def test_locate_maps_flat_rows_to_shards(checkpoint: Checkpoint) -> None:
    layout = read_layout(checkpoint.path)
    shard, inner = layout.locate(3 * checkpoint.rows_per_shard + 5)
    assert (shard.index, inner) == (3, 5)
    with pytest.raises(IndexError):
        layout.locate(checkpoint.rows)


def test_missing_shard_is_refused(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", shards=4)
    index_path = ckpt.path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    config = json.loads((ckpt.path / "config.json").read_text())
    config["text_config"]["split_ngram_parts"] = 5
    (ckpt.path / "config.json").write_text(json.dumps(config))
    index_path.write_text(json.dumps(index))
    with pytest.raises(TableError, match=r"found 4 PLE shards, config split_ngram_parts=5"):
        read_layout(ckpt.path)


def test_row_width_must_match_config(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m")
    config = json.loads((ckpt.path / "config.json").read_text())
    config["text_config"]["ple_embed_dim"] = 256 * 16
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TableError, match=r"PLE rows are 160 wide, config.json implies 256"):
        read_layout(ckpt.path)


def test_corrupt_header_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", files=1)
    victim = ckpt.path / "model-00001-of-00001.safetensors"
    data = bytearray(victim.read_bytes())
    data[8] = ord("X")  # first byte of the JSON header
    victim.write_bytes(bytes(data))
    with pytest.raises(TableError, match=r"model-00001-of-00001.safetensors: header is not JSON"):
        read_layout(ckpt.path)


def test_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TableError, match=r"no model.safetensors.index.json and no \*.safetensors"):
        read_layout(tmp_path)


def test_row_count_must_match_config(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "m", vocab_base=128)
    config = json.loads((ckpt.path / "config.json").read_text())
    config["text_config"]["ngram_vocab_size_base"] = 1000
    (ckpt.path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TableError, match=rf"hold {ckpt.rows} rows, config.json implies \d+"):
        read_layout(ckpt.path)
