"""Issue 39, class 6: a model or table path that is not valid UTF-8 works or is
refused cleanly in every command (once: a UnicodeEncodeError in the header cache,
and a facts file that `--facts` then refused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashnext.skeleton import write_skeleton

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"


@pytest.fixture(scope="module")
def latin1_model(tmp_path_factory) -> bytes:
    base = tmp_path_factory.mktemp("nonutf8")
    write_skeleton(base / "m", "tiny", fixed_metadata=True)
    odd = os.fsencode(base) + b"/mod\xe8le"  # Latin-1 for "modèle": not UTF-8
    shutil.copytree(base / "m", os.fsdecode(odd))
    return odd


def flashnext(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable.encode(), b"-m", b"flashnext", *args],
                          capture_output=True, timeout=120, env=env)  # fmt: skip


@pytest.mark.parametrize(
    "command",
    [
        [b"plan", b"--facts", os.fsencode(FACTS)],
        [
            b"preflight",
            b"--facts",
            os.fsencode(FACTS),
            b"--table",
            b"/nvme/flashnext/ple-table.bin",
        ],
        [b"checkpoint", b"check"],
        [b"report", b"--facts", os.fsencode(FACTS)],
    ],
)
def test_every_command_reads_a_non_utf8_model_path(latin1_model, command, tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}  # the header cache too
    for _ in range(2):  # the second read comes from the header cache
        proc = flashnext(*command, b"--model", latin1_model, env=env)
        assert b"Traceback" not in proc.stderr, proc.stderr.decode(errors="replace")
        assert proc.returncode in (0, 1)
    if command[0] == b"plan":
        assert proc.returncode == 0


def test_facts_out_refuses_what_its_json_cannot_carry(latin1_model, tmp_path):
    out = tmp_path / "facts.json"
    proc = flashnext(b"facts", b"--model", latin1_model, b"--out", os.fsencode(out))
    assert proc.returncode == 1 and b"Traceback" not in proc.stderr
    assert b"mod\\xe8le is not valid UTF-8, which a facts file (JSON) cannot carry" in proc.stderr
    assert not out.exists()
