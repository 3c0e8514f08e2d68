"""`flashnext table prepare`: real bytes, the real storage probe, a real killed subprocess."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.storage import probe_storage
from ple_checkpoint import Checkpoint, make_checkpoint
from prepare_helpers import force_if_needed, kill_mid_copy


def _prepare(ckpt: Checkpoint, out: Path, *extra: str):
    args = ["table", "prepare", "--model", str(ckpt.path), "--out", str(out), *extra]
    return CliRunner().invoke(main, args)


def test_prepare_writes_the_shards_in_order(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    result = _prepare(checkpoint, out, "--json", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "written" and doc["resumed_from_bytes"] == 0
    assert out.read_bytes() == checkpoint.flat
    manifest = json.loads((tmp_path / "ple.bin.json").read_text())
    assert manifest["rows"] == checkpoint.rows and manifest["dim"] == 160
    assert manifest["total_bytes"] == len(checkpoint.flat) and manifest["dtype"] == "BF16"
    # Nothing half-written is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "ple.bin", "ple.bin.json"]


def test_second_run_sees_the_table_present(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    force = force_if_needed(tmp_path)
    assert _prepare(checkpoint, out, *force).exit_code == 0
    result = _prepare(checkpoint, out, "--json", *force)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "present"


def test_foreign_file_at_out_is_not_overwritten(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    out.write_bytes(b"precious")
    result = _prepare(checkpoint, out, *force_if_needed(tmp_path))
    assert result.exit_code == 1
    assert f"Error: {out} exists but is not this checkpoint's table" in result.output
    assert out.read_bytes() == b"precious"


def test_tmpfs_output_is_refused_without_force(checkpoint: Checkpoint) -> None:
    shm = Path("/dev/shm")
    if probe_storage(str(shm)).fs_type != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs here")
    out = shm / f"flashnext-test-{os.getpid()}.bin"
    result = _prepare(checkpoint, out)
    assert result.exit_code == 1
    assert "lives in RAM" in result.output
    assert "pass --force to accept it" in result.output
    assert not list(shm.glob(f"flashnext-test-{os.getpid()}*"))


def test_missing_out_dir_says_mkdir(checkpoint: Checkpoint, tmp_path: Path) -> None:
    result = _prepare(checkpoint, tmp_path / "nope" / "ple.bin")
    assert result.exit_code == 1
    assert f"fix: mkdir -p {tmp_path / 'nope'}" in result.output


def test_killed_prepare_resumes(tmp_path: Path) -> None:
    # 64 MiB of rows, synced every 1 MiB: the kill lands mid-copy.
    ckpt = make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)
    out = tmp_path / "ple.bin"
    journal = tmp_path / "ple.bin.partial.json"
    committed = kill_mid_copy(ckpt, out)
    assert 0 < committed < len(ckpt.flat)

    result = _prepare(ckpt, out, "--json", "--chunk-bytes", str(1 << 20),
                      *force_if_needed(tmp_path))  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "resumed"
    assert doc["resumed_from_bytes"] >= committed
    assert doc["copied_bytes"] == len(ckpt.flat) - doc["resumed_from_bytes"]
    assert out.read_bytes() == ckpt.flat
    assert not journal.exists() and not (tmp_path / "ple.bin.partial").exists()


def test_corrupt_partial_is_rewritten_not_extended(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model", shards=4, vocab_base=1_000, seed=3)
    out = tmp_path / "ple.bin"
    half = len(ckpt.flat) // 2
    bad = bytearray(ckpt.flat[:half])
    bad[half - 10] ^= 0x55  # inside the last committed chunk
    (tmp_path / "ple.bin.partial").write_bytes(bytes(bad))
    from flashnext.table.layout import read_layout

    identity = read_layout(ckpt.path).identity()
    (tmp_path / "ple.bin.partial.json").write_text(
        json.dumps({"identity": identity, "committed_bytes": half})
    )
    result = _prepare(ckpt, out, "--json", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "written" and doc["resumed_from_bytes"] == 0
    assert out.read_bytes() == ckpt.flat


def test_partial_from_another_checkpoint_is_not_extended(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model", shards=4, vocab_base=128, seed=5)
    out = tmp_path / "ple.bin"
    (tmp_path / "ple.bin.partial").write_bytes(ckpt.flat[:4096])
    (tmp_path / "ple.bin.partial.json").write_text(
        json.dumps({"identity": "0" * 64, "committed_bytes": 4096})
    )
    result = _prepare(ckpt, out, "--json", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resumed_from_bytes"] == 0
    assert out.read_bytes() == ckpt.flat


def test_prepare_and_verify_the_tiny_skeleton(tmp_path: Path) -> None:
    """The skeleton writer's tiny checkpoint (real headers, patterned PLE rows), end to end."""
    from flashnext.skeleton import write_skeleton
    from flashnext.table.layout import read_layout
    from flashnext.table.source import ShardReader

    model = tmp_path / "tiny"
    write_skeleton(model, "tiny")
    out = tmp_path / "ple.bin"
    result = _prepare(Checkpoint(model, 0, 0, b""), out, "--json", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    layout = read_layout(model)
    with ShardReader(layout) as reader:
        assert out.read_bytes() == reader.read(0, layout.total_bytes)
    # The skeleton fills flat row r with the BF16 value r % 256 (its own
    # bookkeeping, not flashnext.table's): every row must sit at its place.
    for r, row in enumerate(_rows(out, layout.row_bytes)):
        bits = struct.unpack("<I", struct.pack("<f", float(r % 256)))[0] >> 16
        assert row == struct.pack("<H", bits) * layout.dim, f"row {r} misplaced"
    args = ["table", "verify", "--model", str(model), "--table", str(out), "--samples", "100000"]
    verify = CliRunner().invoke(main, [*args, "--json"])
    assert verify.exit_code == 0, verify.output
    assert json.loads(verify.stdout)["ok"] is True


def _rows(path: Path, row_bytes: int) -> list[bytes]:
    data = path.read_bytes()
    return [data[i : i + row_bytes] for i in range(0, len(data), row_bytes)]


def test_second_writer_is_refused_while_the_first_holds_the_lock(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    import fcntl

    out = tmp_path / "ple.bin"
    lock = tmp_path / ".ple.bin.lock"  # the path's lock (issue 25: not the partial's)
    with lock.open("wb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # what a running prepare holds
        result = _prepare(checkpoint, out, *force_if_needed(tmp_path))
    assert result.exit_code == 1
    assert f"Error: another `flashnext table prepare` is writing {out}" in result.output
    assert not out.exists()


def test_temp_files_of_a_killed_run_are_cleaned(checkpoint: Checkpoint, tmp_path: Path) -> None:
    stale = [tmp_path / ".ple.bin.partial.json.4242.tmp", tmp_path / ".ple.bin.json.4242.tmp"]
    for path in stale:
        path.write_text("{")
    result = _prepare(checkpoint, tmp_path / "ple.bin", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in stale)
