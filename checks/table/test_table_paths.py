"""Issue 25, class 10: what a --table path is gets named (a directory, a FIFO, a device,
an interrupted prepare's partial or journal); preflight and verify agree on what a
manifest must say; a damaged manifest beside good rows is rewritten without a recopy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from ple_checkpoint import Checkpoint
from prepare_helpers import force_if_needed


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def verify(ckpt: Checkpoint, table, *extra):
    return invoke("table", "verify", "--model", ckpt.path, "--table", table, *extra)


def preflight_finding(ckpt: Checkpoint, table, check: str) -> dict:
    result = invoke("preflight", "--model", ckpt.path, "--table", table, "--json")
    return {f["id"]: f for f in json.loads(result.stdout)["findings"]}[check]


@pytest.fixture
def packed(checkpoint: Checkpoint, tmp_path: Path) -> Path:
    out = tmp_path / "ple.bin"
    result = invoke("table", "prepare", "--model", checkpoint.path, "--out", out,
                    *force_if_needed(tmp_path))  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("kind", ["FIFO", "character device"])
def test_verify_names_what_the_path_is(kind, checkpoint, tmp_path):
    # (a directory is --table's usage error: click's Path(dir_okay=False) names it)
    path = tmp_path / "f" if kind == "FIFO" else Path("/dev/null")
    if kind == "FIFO":
        os.mkfifo(path)
    result = verify(checkpoint, path)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {path}: a {kind}, not a table file\n"
        "  fix: pass --table the file `flashnext table prepare --out` wrote\n"
    )


@pytest.mark.parametrize("suffix", [".partial", ".partial.json"])
def test_an_interrupted_prepares_work_is_named_and_resumed(suffix, checkpoint, tmp_path):
    final = tmp_path / "ple.bin"
    given = Path(f"{final}{suffix}")
    given.write_bytes(b"\0" * 4096 if suffix == ".partial" else b'{"done_bytes": 0}')
    resume = f"flashnext table prepare --model {checkpoint.path} --out {final}"
    result = verify(checkpoint, given)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: {given} is the unfinished work of an interrupted `flashnext table prepare` of "
        f"{final}, not a table: rerun `{resume}` (it resumes from it), then pass --table "
        f"{final}\n  fix: {resume}\n"
    )
    f = preflight_finding(checkpoint, given, "table.path")
    assert (f["level"], f["fix"]) == ("fail", resume), f
    assert "remove" not in f["fix"]


@pytest.mark.parametrize(("key", "lie"), [("row_bytes", 321), ("total_bytes", 12)])
def test_preflight_and_verify_agree_on_a_lying_manifest(key, lie, checkpoint, packed):
    manifest = Path(f"{packed}.json")
    doc = json.loads(manifest.read_text())
    truth = doc[key]
    manifest.write_text(json.dumps({**doc, key: lie}))
    assert verify(checkpoint, packed).exit_code == 1
    f = preflight_finding(checkpoint, packed, "table.size")
    assert f["level"] == "fail", f
    assert f["message"] == (
        f"{manifest}: {key} is {lie}, the checkpoint implies {truth}: the manifest does not "
        "describe this table"
    )
    assert "--rewrite-manifest" in f["fix"]


@pytest.mark.parametrize("damage", ["truncated", "lying", "missing"])
def test_a_damaged_manifest_is_rewritten_without_a_recopy(damage, checkpoint, packed):
    manifest = Path(f"{packed}.json")
    good = manifest.read_text()
    table_mtime = packed.stat().st_mtime_ns
    if damage == "truncated":
        manifest.write_text(good[:20])
    elif damage == "lying":
        manifest.write_text(json.dumps({**json.loads(good), "total_bytes": 1}))
    else:
        manifest.unlink()
    result = verify(checkpoint, packed, "--rewrite-manifest", "--samples", checkpoint.rows)
    assert result.exit_code == 0, result.output
    assert json.loads(manifest.read_text()) == json.loads(good)
    assert packed.stat().st_mtime_ns == table_mtime  # the rows were not touched
    assert verify(checkpoint, packed).exit_code == 0
    assert preflight_finding(checkpoint, packed, "table.size")["level"] == "ok"


def test_no_manifest_is_written_when_the_rows_differ(checkpoint, packed):
    manifest = Path(f"{packed}.json")
    manifest.write_text("{")
    with packed.open("r+b") as fh:  # the last row, always sampled
        fh.seek(-1, os.SEEK_END)
        last = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([last[0] ^ 0xFF]))
    result = verify(checkpoint, packed, "--rewrite-manifest", "--samples", "2")
    assert result.exit_code == 1
    assert manifest.read_text() == "{"
