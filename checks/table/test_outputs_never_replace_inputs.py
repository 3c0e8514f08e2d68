"""Issue 39, class 2: a file the launcher writes never replaces an input.

`table prepare --out MODEL/config` wrote its manifest as MODEL/config.json, the
checkpoint's own config; `--out MODEL/model.safetensors.index` its index. Every
output (the table, OUT.json, OUT.partial and its journal, facts and report --out)
is refused when it would land on a file of the checkpoint or the table, by
path, through a symlink, or as a hard link, and nothing is written.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from ple_checkpoint import Checkpoint, make_checkpoint
from prepare_helpers import force_if_needed


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def ckpt(tmp_path: Path) -> Checkpoint:
    return make_checkpoint(tmp_path / "model")


@pytest.mark.parametrize(
    ("out_name", "clash"),
    [
        ("config", "config.json"),  # OUT.json is the checkpoint's config
        ("model.safetensors.index", "model.safetensors.index.json"),
        ("config.json", "config.json"),  # OUT itself
        ("model-00001-of-00003.safetensors", "model-00001-of-00003.safetensors"),
    ],
)
def test_table_prepare_never_writes_over_the_checkpoint(ckpt, tmp_path, out_name, clash):
    before = digests(ckpt.path)
    result = invoke("table", "prepare", "--model", str(ckpt.path),
                    "--out", str(ckpt.path / out_name), *force_if_needed(tmp_path))  # fmt: skip
    assert result.exit_code == 1, result.output
    assert f"which is {ckpt.path / clash}, an input it must not replace" in result.output
    assert "fix: pass --out a path outside the checkpoint" in result.output
    assert digests(ckpt.path) == before  # nothing replaced, nothing added


def test_a_link_to_a_checkpoint_file_is_no_way_around(ckpt, tmp_path):
    link = tmp_path / "ple.bin"
    link.symlink_to(ckpt.path / "config.json")
    before = digests(ckpt.path)
    result = invoke("table", "prepare", "--model", str(ckpt.path), "--out", str(link),
                    *force_if_needed(tmp_path))  # fmt: skip
    assert result.exit_code == 1 and "an input it must not replace" in result.output
    assert digests(ckpt.path) == before


def test_facts_and_report_out_never_replace_the_checkpoint_or_the_table(ckpt, tmp_path):
    table = tmp_path / "ple.bin"
    table.write_bytes(b"\0" * 64)
    manifest = tmp_path / "ple.bin.json"
    manifest.write_text("{}")
    hard = tmp_path / "hard-link-to-config.json"
    os.link(ckpt.path / "config.json", hard)  # the same file under another name
    before = digests(ckpt.path), table.read_bytes(), manifest.read_text()
    for out in (ckpt.path / "config.json", manifest, table, hard):
        for command in ("facts", "report"):
            result = invoke(command, "--model", str(ckpt.path), "--table", str(table),
                            "--out", str(out))  # fmt: skip
            assert result.exit_code == 1, (command, out, result.output)
            assert f"{command} --out would write {out}" in result.output
            assert "an input it must not replace" in result.output
    assert (digests(ckpt.path), table.read_bytes(), manifest.read_text()) == before
    fresh = tmp_path / "facts.json"  # a new file beside them is fine
    assert invoke("facts", "--model", str(ckpt.path), "--out", str(fresh)).exit_code == 0
    assert fresh.exists()


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors"])
@pytest.mark.parametrize("command", ["prepare", "verify"])
def test_table_tools_never_follow_an_index_entry_outside_the_model(ckpt, tmp_path, target,
                                                                   command):  # fmt: skip
    """Issue 39 class 7: the table tools obey `checkpoint check`'s index rule."""
    import json

    index = ckpt.path / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    shard = next(n for n in doc["weight_map"] if "ngram_embedding.shard_" in n)
    doc["weight_map"][shard] = target
    index.write_text(json.dumps(doc))
    (tmp_path / "outside.safetensors").write_bytes(b"never read")
    table = tmp_path / "ple.bin"
    args = (["--out", str(table), *force_if_needed(tmp_path)] if command == "prepare"
            else ["--table", str(table)])  # fmt: skip
    result = invoke("table", command, "--model", str(ckpt.path), *args)
    assert result.exit_code == 1, result.output
    assert f"weight_map entry {shard!r} names {target!r}, not a file in the model directory" in (
        result.output
    )
    assert not table.exists()


def test_a_table_path_that_is_a_symlink_loop_is_named_so(ckpt, tmp_path):
    """Issue 39 class 10: a loop is named as a loop, not as a missing table."""
    loop = tmp_path / "ple.bin"
    loop.symlink_to(loop.name)
    result = invoke("table", "verify", "--model", str(ckpt.path), "--table", str(loop))
    assert result.exit_code == 1
    assert f"{loop}: a symlink loop (it never reaches a file)" in result.output
    assert "no such file" not in result.output
