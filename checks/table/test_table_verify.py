"""`flashnext table verify` on tables written here byte by byte (not by prepare)."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from flashnext.cli import main
from ple_checkpoint import ROW_BYTES, Checkpoint


def _verify(ckpt: Checkpoint, table: Path, *extra: str):
    args = ["table", "verify", "--model", str(ckpt.path), "--table", str(table), *extra]
    return CliRunner().invoke(main, args)


def test_good_table_passes_every_row(checkpoint: Checkpoint, tmp_path: Path) -> None:
    table = tmp_path / "ple.bin"
    table.write_bytes(checkpoint.flat)
    result = _verify(checkpoint, table, "--samples", str(checkpoint.rows), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["ok"] is True and doc["mismatch"] is None
    assert (doc["rows"], doc["dim"], doc["dtype"]) == (checkpoint.rows, 160, "BF16")
    assert doc["size_bytes"] == len(checkpoint.flat)


def test_flipped_byte_names_the_row(checkpoint: Checkpoint, tmp_path: Path) -> None:
    bad_row = 5 * checkpoint.rows_per_shard + 17
    data = bytearray(checkpoint.flat)
    data[bad_row * ROW_BYTES + 100] ^= 0x01
    table = tmp_path / "ple.bin"
    table.write_bytes(bytes(data))
    result = _verify(checkpoint, table, "--samples", str(checkpoint.rows))
    assert result.exit_code == 1
    assert (
        f"Error: row {bad_row} differs from the checkpoint "
        f"(model.language_model.layers.1.ple.ple_embedding.ngram_embedding.shard_5.weight "
        f"row 17, table offset {bad_row * ROW_BYTES})"
    ) in result.output


def test_last_row_is_always_sampled(checkpoint: Checkpoint, tmp_path: Path) -> None:
    data = bytearray(checkpoint.flat)
    data[-1] ^= 0xFF
    table = tmp_path / "ple.bin"
    table.write_bytes(bytes(data))
    result = _verify(checkpoint, table, "--samples", "2")
    assert result.exit_code == 1
    assert f"row {checkpoint.rows - 1} differs" in result.output


def test_wrong_size_is_refused(checkpoint: Checkpoint, tmp_path: Path) -> None:
    table = tmp_path / "ple.bin"
    table.write_bytes(checkpoint.flat[:-ROW_BYTES])
    result = _verify(checkpoint, table)
    assert result.exit_code == 1
    aligned = -(-checkpoint.rows // 12) * 4096
    assert (
        f"Error: {table}: {len(checkpoint.flat) - ROW_BYTES} bytes, expected "
        f"{len(checkpoint.flat)} ({checkpoint.rows} rows x 160 x BF16, packed layout, "
        f"assumed: no manifest beside it); the table is {len(checkpoint.flat)} bytes packed, "
        f"{aligned} bytes page-aligned\n"
    ) in result.output
    assert "fix: remove it and rerun `flashnext table prepare" in result.output
    assert "(add --layout page-aligned for the page-aligned layout)" in result.output


def test_missing_table_mentions_interrupted_prepare(checkpoint: Checkpoint, tmp_path: Path) -> None:
    (tmp_path / "ple.bin.partial").write_bytes(b"x")
    result = _verify(checkpoint, tmp_path / "ple.bin")
    assert result.exit_code == 1
    assert "no such file (ple.bin.partial exists: prepare was interrupted)" in result.output


def test_manifest_disagreeing_with_checkpoint(checkpoint: Checkpoint, tmp_path: Path) -> None:
    table = tmp_path / "ple.bin"
    table.write_bytes(checkpoint.flat)
    (tmp_path / "ple.bin.json").write_text(json.dumps({"dtype": "F16"}))
    result = _verify(checkpoint, table)
    assert result.exit_code == 1
    assert "ple.bin.json: dtype is 'F16', the checkpoint implies 'BF16'" in result.output


def test_negative_samples_is_a_usage_error(checkpoint: Checkpoint, tmp_path: Path) -> None:
    result = _verify(checkpoint, tmp_path / "x", "--samples", "-1")
    assert result.exit_code == 2
