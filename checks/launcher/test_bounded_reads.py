"""Issue 39, class 3: every file the launcher reads is bounded and cannot block.

config.json, generation_config.json, the safetensors index and headers, the
table manifest and `--generation-config` were read without a cap: /dev/zero
filled memory, a 150 MB config took 3.7 GB, a FIFO hung the launcher forever.
Hostile JSON (nesting thousands deep, integers of thousands of digits) raised
RecursionError or ValueError. Each is now a clean error naming the file, exit 1.

The commands run as real subprocesses with a deadline: a hang fails the test
instead of the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashnext.skeleton import write_skeleton

DEADLINE_S = 60
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = '{"vocab_size": ' + "9" * 10_000 + "}"


@pytest.fixture(scope="module")
def fixed_tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bounded") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


@pytest.fixture
def model(fixed_tiny: Path, tmp_path: Path) -> Path:
    shutil.copytree(fixed_tiny, tmp_path / "m")
    return tmp_path / "m"


def flashnext(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flashnext", *map(str, args)],
        capture_output=True, text=True, timeout=DEADLINE_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def refused(proc: subprocess.CompletedProcess, *phrases: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out, out
    for phrase in phrases:
        assert phrase in out, (phrase, out)


def replace(path: Path, how: str) -> None:
    """Put something hostile where the file was."""
    path.unlink()
    if how == "fifo":
        os.mkfifo(path)  # nobody ever writes it
    elif how == "device":
        path.symlink_to("/dev/zero")
    elif how == "oversized":
        path.write_text("{" + " " * (5 << 20) + "}")  # valid JSON, 5 MiB of it
    elif how == "deep":
        path.write_text(DEEP)
    elif how == "huge-int":
        path.write_text(HUGE_INT)


CASES = {
    "fifo": "not a regular file",
    "device": "not a regular file",
    "oversized": "over 4 MiB",
    "deep": "nested too deeply",
    "huge-int": "not usable JSON",
}


@pytest.mark.parametrize("how", CASES)
@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_checkpoint_json_files(model, how, name):
    replace(model / name, how)
    refused(flashnext("checkpoint", "check", "--model", model), f"{model / name}", CASES[how])


@pytest.mark.parametrize("how", ["fifo", "device", "deep", "huge-int"])
def test_the_index(model, how):
    replace(model / "model.safetensors.index.json", how)
    refused(flashnext("checkpoint", "check", "--model", model), CASES[how])


@pytest.mark.parametrize("how", CASES)
def test_generation_config_option(model, tmp_path, how):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text("{}")
    replace(gen / "generation_config.json", how)
    facts = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"
    proc = flashnext("preflight", "--json", "--facts", facts, "--model", model, "--table",
                     "/nvme/flashnext/ple-table.bin", "--generation-config", gen)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    sampling = {f["id"]: f for f in json.loads(proc.stdout)["findings"]}["model.sampling"]
    assert sampling["level"] == "fail" and CASES[how] in sampling["message"], sampling


@pytest.mark.parametrize("how", ["fifo", "deep"])
def test_a_safetensors_shard_or_its_header(model, how):
    shard = next(p for p in sorted(model.glob("*.safetensors")))
    if how == "fifo":
        replace(shard, "fifo")
        expected = f"{shard}: a FIFO, not a regular file; it is a shard named by"
    else:  # a well-framed header whose JSON nests 100,000 deep
        header = DEEP.encode()
        shard.write_bytes(len(header).to_bytes(8, "little") + header)
        expected = "header is not JSON (nested too deeply)"
    refused(flashnext("checkpoint", "check", "--model", model), expected)


@pytest.mark.parametrize("value", [DEEP[:2000] + DEEP[-2000:], "9" * 10_000])
def test_sampling_values(model, value):
    proc = flashnext("checkpoint", "fix", "--model", model, "--dry-run",
                     "--sampling", f"temperature={value}")  # fmt: skip
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "is not a number or true/false" in proc.stderr


def test_a_fifo_table_manifest_does_not_hang_preflight(model, tmp_path):
    table = tmp_path / "ple.bin"
    table.write_bytes(b"")
    os.mkfifo(tmp_path / "ple.bin.json")
    facts = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"
    proc = flashnext("preflight", "--json", "--facts", facts, "--model", model, "--table", table)
    assert "Traceback" not in proc.stderr, proc.stderr
    json.loads(proc.stdout)  # it finished and reported


@pytest.mark.parametrize("kind", ["loop", "dangling"])
def test_a_shard_that_is_a_broken_link_is_named_so(model, kind):
    # issue 39 class 10: a symlink loop is named as a loop, not as a missing download
    shard = next(p for p in sorted(model.glob("*.safetensors")))
    shard.unlink()
    if kind == "loop":
        shard.symlink_to(shard.name)
        expected = f"{shard}: a symlink loop (it never reaches a file)"
    else:
        shard.symlink_to("/nonexistent/blob")
        expected = f"{shard}: a symlink to '/nonexistent/blob', which does not exist"
    refused(flashnext("checkpoint", "check", "--model", model), expected)
