"""Issue 25, class 6: every file the launcher reads as text (facts, configs, generation
configs, manifests, plans) gets a clean error naming the file when it is not UTF-8
JSON of the expected shape: exit 1 or 2, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton

TABLE = "/nvme/flashnext/ple-table.bin"
BINARY = bytes(range(256)) * 4  # not UTF-8 (0x80 alone)
RECORD = "record facts with `flashnext facts --out FILE` and pass that FILE"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("txt") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


def bad_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "bad.json"
    if kind == "binary":
        path.write_bytes(BINARY)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "array":
        path.write_text("[1, 2]")
    return path


WORDS = {
    "binary": "not UTF-8 text, so not a facts file",
    "fifo": "not a regular file, so not a facts file",
    "array": "a JSON list, not a facts file (an object)",
}


@pytest.mark.parametrize("kind", WORDS)
@pytest.mark.parametrize("command", ["plan", "preflight"])
def test_a_facts_file_that_is_not_json_text(command, kind, tiny, tmp_path):
    facts = bad_file(tmp_path, kind)
    # A child with a timeout: reading a FIFO that no one writes would block forever.
    result = subprocess.run(
        [sys.executable, "-m", "flashnext", command, "--facts", str(facts), "--model", str(tiny),
         "--table", TABLE], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr == f"Error: {facts}: {WORDS[kind]}; {RECORD}\n"


@pytest.mark.parametrize("kind", ["binary", "array"])
def test_bench_facts_that_are_not_json_text_are_a_usage_error(kind, tmp_path):
    facts = bad_file(tmp_path, kind)
    result = invoke("bench", "--url", "http://127.0.0.1:9", "--facts", facts)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        f"Error: Invalid value for '--facts': {facts}: {WORDS[kind]}"
    )


def test_a_binary_generation_config_to_restore_from(tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    source = tmp_path / "published"
    source.mkdir()
    (source / "generation_config.json").write_bytes(BINARY)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    result = invoke("checkpoint", "fix", "--model", model, "--generation-config-from", source)
    assert result.exit_code == 1
    assert result.output == (
        f"Error: --generation-config-from: {source / 'generation_config.json'}: not UTF-8 "
        "text, so not a generation config; name the published model's directory (or its "
        "generation_config.json)\n"
    )
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "model.safetensors.index.json"])  # fmt: skip
def test_a_binary_checkpoint_json_is_named(name, tiny, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (model / name).write_bytes(BINARY)
    result = invoke("plan", "--facts", Path(__file__).parents[1] / "fixtures" / "facts" /
                    "3x3090-nvme.json", "--model", model, "--table", TABLE)  # fmt: skip
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: no plan: no model facts ({model / name}: ")
    assert "not UTF-8 text, so not a" in result.output
    check = invoke("checkpoint", "check", "--model", model)
    assert check.exit_code == 1 and "Traceback" not in check.output


def test_a_binary_table_manifest_is_a_finding(tiny, tmp_path):
    table = tmp_path / "ple.bin"
    table.write_bytes(b"\0" * 4096)
    (tmp_path / "ple.bin.json").write_bytes(BINARY)
    result = invoke("table", "verify", "--model", tiny, "--table", table)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert str(tmp_path / "ple.bin.json") in result.output
    _ = json  # the facts cases above parse nothing themselves
