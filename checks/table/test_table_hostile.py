"""`table prepare|verify` on damaged checkpoints and hostile disks: a clear error, no
traceback, nothing half-written, and whatever was copied is kept for the rerun.

Every CLI call runs with catch_exceptions=False: an exception that escapes the
command (what a user sees as a traceback) fails the test itself. Disk full and
read-only are real (a small tmpfs, see mounts.py), skipped where mounting is not
permitted.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.render import size
from mounts import remount, tmpfs
from ple_checkpoint import Checkpoint, make_checkpoint
from prepare_helpers import PACED_CLI, force_if_needed, journal_bytes, kill_mid_copy

SHARD_FILE = "model-00001-of-00003.safetensors"


def _prepare(ckpt: Checkpoint, out: Path, *extra: str):
    args = ["table", "prepare", "--model", str(ckpt.path), "--out", str(out), *extra]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _verify(ckpt: Checkpoint, table: Path):
    args = ["table", "verify", "--model", str(ckpt.path), "--table", str(table)]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def _rewrite_header(path: Path, change) -> None:
    """Apply change(header) and write the file back with the same data region."""
    header, body = _header(path)
    change(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def _ple_entry(header: dict) -> str:
    return next(name for name in header if ".ngram_embedding.shard_" in name)


def _edit_config(ckpt: Checkpoint, change) -> Path:
    path = ckpt.path / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))
    return path


# ---------------------------------------------------------------- 1. partial downloads


def test_short_shard_is_named_before_anything_is_written(tmp_path: Path) -> None:
    """The usual partial download: header intact, data short by 5000 bytes."""
    ckpt = make_checkpoint(tmp_path / "model")
    force = force_if_needed(tmp_path)
    table = tmp_path / "ple.bin"
    assert _prepare(ckpt, table, *force).exit_code == 0
    shard = ckpt.path / SHARD_FILE
    full = shard.stat().st_size
    os.truncate(shard, full - 5000)
    want = (
        f"Error: {shard}: {full - 5000} bytes, but its safetensors header describes {full}: "
        "5000 bytes are missing (an interrupted download)\n"
        f"  fix: re-download {SHARD_FILE}, then rerun the same command (an interrupted "
        "prepare resumes where it stopped)\n"
    )

    result = _prepare(ckpt, tmp_path / "new.bin", *force)
    assert result.exit_code == 1
    assert result.output == want
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "ple.bin", "ple.bin.json"]

    result = _verify(ckpt, table)
    assert result.exit_code == 1
    assert result.output == want


def test_longer_shard_is_named_too(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model")
    shard = ckpt.path / SHARD_FILE
    full = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(b"\0" * 100)
    result = _prepare(ckpt, tmp_path / "ple.bin", *force_if_needed(tmp_path))
    assert result.exit_code == 1
    assert (
        f"Error: {shard}: {full + 100} bytes, but its safetensors header describes {full}: "
        "100 bytes more than it should hold (not the file its header belongs to)\n"
    ) in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_copy_resumes_after_the_damaged_shard_is_downloaded_again(tmp_path: Path) -> None:
    """Killed mid-copy, then a shard goes short, then it is restored: the rerun with the
    short shard refuses without touching the partial file or its journal, and the
    rerun after the re-download continues from the committed bytes, not from zero."""
    ckpt = make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)
    out = tmp_path / "ple.bin"
    partial, journal = tmp_path / "ple.bin.partial", tmp_path / "ple.bin.partial.json"
    committed = kill_mid_copy(ckpt, out)
    assert 0 < committed < len(ckpt.flat)
    kept_journal, kept_size = journal.read_text(), partial.stat().st_size

    shard = ckpt.path / SHARD_FILE
    original = shard.read_bytes()
    os.truncate(shard, len(original) - 5000)
    force = force_if_needed(tmp_path)
    result = _prepare(ckpt, out, *force)
    assert result.exit_code == 1
    assert "5000 bytes are missing (an interrupted download)" in result.output
    assert journal.read_text() == kept_journal and partial.stat().st_size == kept_size

    shard.write_bytes(original)  # downloaded again
    result = _prepare(ckpt, out, "--json", "--chunk-bytes", str(1 << 20), *force)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "resumed" and doc["resumed_from_bytes"] >= committed
    assert out.read_bytes() == ckpt.flat


# ---------------------------------------------------------------- 2. disk full, read-only


def test_disk_full_mid_copy_says_what_is_needed_and_resumes(tmp_path: Path, monkeypatch) -> None:
    """A real ENOSPC: a 512 KiB tmpfs for an 880 KiB table. The up-front free-space
    check is switched off here to stand for a disk that fills up after it passed
    (another writer); the kernel's ENOSPC is real. Then the disk grows and the
    same command finishes the table from where it stopped."""
    ckpt = make_checkpoint(tmp_path / "model")
    with tmpfs(tmp_path / "fs", "512k") as fs:
        monkeypatch.setattr("flashnext.table.prepare.space_refusal", lambda facts, n: None)
        out = fs / "ple.bin"
        small = ("--force", "--chunk-bytes", "65536", "--sync-bytes", "65536")
        result = _prepare(ckpt, out, *small)
        assert result.exit_code == 1
        committed = journal_bytes(fs / "ple.bin.partial.json")
        assert 0 < committed < len(ckpt.flat)
        need = len(ckpt.flat) - committed
        assert result.output.startswith(
            f"Error: {fs}: no space left on the device after {committed} of the table's "
            f"{len(ckpt.flat)} bytes were committed; it needs {need} bytes ({size(need)}) "
            "more there"
        ), result.output
        assert (
            f"  fix: free at least {size(need)} on {fs} (or pass another --out), then rerun "
            f"the same command: it resumes from byte {committed}\n"
        ) in result.output
        assert not out.exists() and not (fs / "ple.bin.json").exists()

        remount(fs, "size=2m")
        again = _prepare(ckpt, out, "--json", *small)
        assert again.exit_code == 0, again.output
        doc = json.loads(again.stdout)
        assert doc["status"] == "resumed" and doc["resumed_from_bytes"] == committed
        assert out.read_bytes() == ckpt.flat


def test_read_only_output_directory_is_named(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model")
    with tmpfs(tmp_path / "fs", "4m") as fs:
        remount(fs, "ro")
        result = _prepare(ckpt, fs / "ple.bin", "--force")
        assert result.exit_code == 1
        assert result.output == (
            f"Error: {fs} is on a read-only filesystem: cannot write {fs / 'ple.bin.partial'} "
            "(nothing was written)\n"
            "  fix: pass --out a path on a writable filesystem (or remount it read-write)\n"
        )
        assert list(fs.iterdir()) == []


def test_free_space_refusal_shows_small_sizes_in_small_units(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model")  # 880 KiB of rows
    with tmpfs(tmp_path / "fs", "256k") as fs:
        free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
        result = _prepare(ckpt, fs / "ple.bin", "--force")
        assert result.exit_code == 1
        assert (
            f"Error: {fs} has {size(free)} free, the table needs {size(len(ckpt.flat))} more\n"
        ) in result.output
        assert size(free) == "256 KiB" and "0.00 GiB" not in result.output
        assert list(fs.iterdir()) == []


# ---------------------------------------------------------------- 7. malformed checkpoints


CONFIG_CASES = {
    "config is a list": (lambda c: [c], "the model config is a JSON array, not an object"),
    "split_ngram_parts is a word": (
        lambda c: {**c, "text_config": {**c["text_config"], "split_ngram_parts": "eight"}},
        "split_ngram_parts is 'eight', not an integer >= 1",
    ),
    "heads_per_ngram is 0": (
        lambda c: {**c, "text_config": {**c["text_config"], "heads_per_ngram": 0}},
        "heads_per_ngram is 0, not an integer >= 1",
    ),
    "heads_per_ngram is 0, no vocab base": (
        lambda c: {
            **c,
            "text_config": {
                k: v
                for k, v in {**c["text_config"], "heads_per_ngram": 0}.items()
                if k != "ngram_vocab_size_base"
            },
        },
        "heads_per_ngram is 0, not an integer >= 1",
    ),
    "text_config is a string": (
        lambda c: {**c, "text_config": "qwen"},
        "text_config is a JSON string, not an object",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_malformed_config_is_named(case: str, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model")
    change, words = CONFIG_CASES[case]
    config = _edit_config(ckpt, change)
    result = _prepare(ckpt, tmp_path / "ple.bin", *force_if_needed(tmp_path))
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {config}: {words}\n  fix: restore config.json from the published checkpoint\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


HEADER_CASES = {
    "no data_offsets": (
        lambda e: e.pop("data_offsets"),
        "has data_offsets None, not [begin, end] byte offsets",
    ),
    "shape of floats": (
        lambda e: e.update(shape=[e["shape"][0] + 0.5, 160]),
        "has shape [{rows}.5, 160], not [rows, width] in whole numbers",
    ),
    "shape of strings": (
        lambda e: e.update(shape=[str(e["shape"][0]), "160"]),
        "has shape ['{rows}', '160'], not [rows, width] in whole numbers",
    ),
}


@pytest.mark.parametrize("case", sorted(HEADER_CASES))
def test_malformed_shard_header_is_named(case: str, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "model")
    change, words = HEADER_CASES[case]
    shard = ckpt.path / SHARD_FILE
    header, _ = _header(shard)
    name = _ple_entry(header)
    rows = header[name]["shape"][0]
    _rewrite_header(shard, lambda h: change(h[name]))
    for result in (
        _prepare(ckpt, tmp_path / "ple.bin", *force_if_needed(tmp_path)),
        _verify(ckpt, tmp_path / "ple.bin"),
    ):
        assert result.exit_code == 1
        assert result.output == (
            f"Error: {shard}: tensor {name!r} {words.format(rows=rows)}\n"
            f"  fix: re-download {SHARD_FILE}: its header is damaged\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


# ---------------------------------------------------------------- 8. file modes


def test_manifest_is_as_readable_as_the_table(checkpoint: Checkpoint, tmp_path: Path) -> None:
    out = tmp_path / "ple.bin"
    old = os.umask(0o022)
    try:
        result = _prepare(checkpoint, out, *force_if_needed(tmp_path))
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    mode = stat.S_IMODE(out.stat().st_mode)
    assert mode == 0o644
    assert stat.S_IMODE((tmp_path / "ple.bin.json").stat().st_mode) == mode


# ---------------------------------------------------------------- 10. symlinks, SIGINT


def test_out_symlink_is_followed_not_replaced(checkpoint: Checkpoint, tmp_path: Path) -> None:
    real_dir, link_dir = tmp_path / "real", tmp_path / "links"
    real_dir.mkdir()
    link_dir.mkdir()
    target, link = real_dir / "ple.bin", link_dir / "ple.bin"
    link.symlink_to(target)  # dangling until prepare writes the table
    result = _prepare(checkpoint, link, "--json", *force_if_needed(tmp_path))
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_bytes() == checkpoint.flat
    manifest = json.loads((real_dir / "ple.bin.json").read_text())
    assert manifest["total_bytes"] == len(checkpoint.flat)
    # vLLM reads PATH.json beside the path it is given: the link's name has one too.
    assert json.loads((link_dir / "ple.bin.json").read_text()) == manifest
    assert sorted(p.name for p in real_dir.iterdir()) == ["ple.bin", "ple.bin.json"]
    verify = _verify(checkpoint, link)
    assert verify.exit_code == 0, verify.output


def test_storage_checks_look_where_the_symlink_points(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    """The link sits on a 64 KiB tmpfs, the table goes to tmp_path: the free-space
    check must judge tmp_path, where the bytes land."""
    real = tmp_path / "real"
    real.mkdir()
    with tmpfs(tmp_path / "small", "64k") as small:
        link = small / "ple.bin"
        link.symlink_to(real / "ple.bin")
        result = _prepare(checkpoint, link, "--force")
        assert result.exit_code == 0, result.output
        assert (real / "ple.bin").read_bytes() == checkpoint.flat
        assert link.is_symlink()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_prepare_says_it_resumes(tmp_path: Path) -> None:
    """Ctrl-C mid-copy (a real SIGINT to a real process): one line that says what was
    kept and that the same command resumes, exit 130, no traceback; then it does."""
    ckpt = make_checkpoint(tmp_path / "model", shards=16, vocab_base=13_000, seed=7)
    out = tmp_path / "ple.bin"
    journal = tmp_path / "ple.bin.partial.json"
    argv = [sys.executable, "-c", PACED_CLI, "table", "prepare", "--model", str(ckpt.path),
            "--out", str(out), "--chunk-bytes", str(1 << 20), "--sync-bytes", str(1 << 20),
            *force_if_needed(tmp_path)]  # fmt: skip
    # A shell runs background jobs with SIGINT ignored, and an ignored signal is
    # inherited: give the child the default action back, so Python turns Ctrl-C
    # into KeyboardInterrupt as it does in a terminal.
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_default_sigint)  # fmt: skip
    deadline = time.monotonic() + 60
    while journal_bytes(journal) < (4 << 20) and child.poll() is None:
        assert time.monotonic() < deadline, "prepare made no progress"
        time.sleep(0.002)
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, (child.returncode, stderr)
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    committed = journal_bytes(journal)
    assert 0 < committed < len(ckpt.flat)
    assert stderr.strip().splitlines()[-1] == (
        f"interrupted: {committed} of {len(ckpt.flat)} bytes are committed in "
        f"{out}.partial; rerun the same command to resume from there"
    )
    assert not out.exists()
    again = _prepare(ckpt, out, "--json", *force_if_needed(tmp_path))
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["resumed_from_bytes"] >= committed
    assert out.read_bytes() == ckpt.flat


# ---------------------------------------------------------------- 3. preflight reads the manifest


def _table_size_finding(ckpt: Checkpoint, table: Path) -> dict:
    """preflight on this host (real probes) for this checkpoint and table: table.size."""
    args = ["preflight", "--model", str(ckpt.path), "--table", str(table), "--json"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    found = {f["id"]: f for f in json.loads(result.stdout)["findings"]}
    return found["table.size"]


@pytest.fixture
def packed(checkpoint: Checkpoint, tmp_path: Path) -> Path:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out, *force_if_needed(tmp_path)).exit_code == 0
    return out


def test_preflight_passes_a_table_with_its_manifest(checkpoint: Checkpoint, packed: Path) -> None:
    f = _table_size_finding(checkpoint, packed)
    assert f["level"] == "ok", f
    assert f["message"] == f"exact size (packed layout, per {packed}.json)"


def test_preflight_fails_a_corrupt_manifest(checkpoint: Checkpoint, packed: Path) -> None:
    manifest = Path(f"{packed}.json")
    manifest.write_text('{"layout": "packed",')
    f = _table_size_finding(checkpoint, packed)
    assert f["level"] == "fail", f
    assert f["message"].startswith(f"{manifest}: not JSON (")
    assert f["message"].endswith("): vLLM refuses to load the table")
    # issue 25: the rows need not be copied again to mend the manifest
    assert f["fix"] == (
        "if the table's rows are right, rewrite just the manifest: `flashnext table verify "
        f"--model {checkpoint.path} --table {packed} --rewrite-manifest`; else rerun "
        "`flashnext table prepare`"
    )


def test_preflight_fails_a_manifest_whose_layout_contradicts_the_size(
    checkpoint: Checkpoint, packed: Path
) -> None:
    manifest = Path(f"{packed}.json")
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "layout": "page-aligned"}))
    aligned = -(-checkpoint.rows // 12) * 4096
    f = _table_size_finding(checkpoint, packed)
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"{packed} is {len(checkpoint.flat)} bytes, but {manifest.name} says the page-aligned "
        f"layout: {aligned} bytes for [{checkpoint.rows}, 160] BF16; vLLM refuses it "
        "(the size is the packed one: the manifest is stale)"
    )


def test_preflight_fails_a_manifest_for_another_shape(checkpoint: Checkpoint, packed: Path) -> None:
    manifest = Path(f"{packed}.json")
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "rows": doc["rows"] * 2, "dim": 80}))
    f = _table_size_finding(checkpoint, packed)
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"{manifest.name} describes [{checkpoint.rows * 2}, 80] BF16 rows, the model config "
        f"implies [{checkpoint.rows}, 160] BF16: vLLM refuses the table"
    )


def test_preflight_fails_an_aligned_table_without_its_manifest(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    out = tmp_path / "ple.bin"
    assert _prepare(checkpoint, out, "--layout", "page-aligned",
                    *force_if_needed(tmp_path)).exit_code == 0  # fmt: skip
    assert _table_size_finding(checkpoint, out)["level"] == "ok"
    Path(f"{out}.json").unlink()
    f = _table_size_finding(checkpoint, out)
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"{out} has no manifest ({out.name}.json), so vLLM reads it as packed: "
        f"{len(checkpoint.flat)} bytes, but it is {out.stat().st_size} bytes (the page-aligned "
        "size: its manifest is missing)"
    )
