"""Issue 25, classes 4 and 11 (temp names): `table prepare` locks the output path for
the whole run, not the partial's inode, and moves into place only the partial it
wrote; temp files of an interrupted run, as atomic.py names them, are swept."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from flashnext.cli import main
from ple_checkpoint import Checkpoint, make_checkpoint
from prepare_helpers import PACED_CLI, force_if_needed, journal_bytes


def paced_prepare(ckpt: Checkpoint, out: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", PACED_CLI, "table", "prepare", "--model", str(ckpt.path),
            "--out", str(out), "--chunk-bytes", str(1 << 20), "--sync-bytes", str(1 << 20),
            *force_if_needed(out.parent)]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_removing_the_partial_mid_run_lets_no_second_run_in(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)
    tmp_path = tmp_path / "out"
    tmp_path.mkdir()
    out = tmp_path / "ple.bin"
    partial, journal = tmp_path / "ple.bin.partial", tmp_path / "ple.bin.partial.json"
    a = paced_prepare(checkpoint, out)
    deadline = time.monotonic() + 60
    while journal_bytes(journal) < (2 << 20) and a.poll() is None:
        assert time.monotonic() < deadline, "prepare made no progress"
        time.sleep(0.002)
    assert a.poll() is None, "prepare finished before the partial was removed"
    partial.unlink()
    b = CliRunner().invoke(main, ["table", "prepare", "--model", str(checkpoint.path),
                                  "--out", str(out), *force_if_needed(tmp_path)])  # fmt: skip
    _, a_err = a.communicate(timeout=120)
    # A notices at its next commit that its partial is gone: it moves nothing and
    # says so. B is refused while A still holds the path, or, once A has given up,
    # writes the whole table itself; never a table A did not finish.
    assert a.returncode == 1, a_err
    assert f"Error: {partial} was removed or replaced while this run wrote it" in a_err
    if b.exit_code:
        assert f"Error: another `flashnext table prepare` is writing {out}" in b.output
        assert not out.exists() and not journal.exists()
    else:
        assert out.read_bytes() == checkpoint.flat, "a table B did not write whole"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ple.bin", "ple.bin.json"]
        return
    # and the path is free again: a rerun writes the whole table
    again = CliRunner().invoke(main, ["table", "prepare", "--model", str(checkpoint.path),
                                      "--out", str(out), *force_if_needed(tmp_path)])  # fmt: skip
    assert again.exit_code == 0, again.output
    assert out.read_bytes() == checkpoint.flat
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ple.bin", "ple.bin.json"]


def test_temp_files_as_atomic_names_them_are_swept(checkpoint: Checkpoint,
                                                   tmp_path: Path) -> None:  # fmt: skip
    stale = [
        tmp_path / ".ple.bin.partial.json.0123456789ab",
        tmp_path / ".ple.bin.json.a1b2c3d4e5f6",
    ]
    for path in stale:
        path.write_text("{")
    keep = tmp_path / ".ple.bin.json.notes"  # not a temp name: the user's
    keep.write_text("mine")
    result = CliRunner().invoke(main, ["table", "prepare", "--model", str(checkpoint.path),
                                       "--out", str(tmp_path / "ple.bin"),
                                       *force_if_needed(tmp_path)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert not any(p.exists() for p in stale)
    assert keep.read_text() == "mine"


def test_the_space_check_credits_only_committed_bytes_of_a_stale_partial(tmp_path: Path) -> None:
    """A partial as large as the table but with no journal (or a sparse one) keeps
    nothing a rerun can trust: the up-front check must not count it as written."""
    ckpt = make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)
    small = tmp_path / "small"
    small.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode:
        import pytest

        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        out = small / "ple.bin"
        with open(f"{out}.partial", "wb") as fh:
            fh.truncate(len(ckpt.flat))  # stale, sparse, no journal
        result = CliRunner().invoke(main, ["table", "prepare", "--model", str(ckpt.path),
                                           "--out", str(out), "--force"])  # fmt: skip
        assert result.exit_code == 1
        assert result.output.startswith(f"Error: {small} has "), result.output
        assert "the table needs" in result.output
        assert not Path(f"{out}.partial.json").exists()  # refused before any write
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
