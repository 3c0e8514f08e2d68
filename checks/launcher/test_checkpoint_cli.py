"""`flashnext checkpoint check|fix` through the real Click CLI on the tiny skeleton."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "shipped"
    write_skeleton(path, "tiny")
    return path


@pytest.fixture
def model(shipped, tmp_path):
    shutil.copytree(shipped, tmp_path / "m")
    return tmp_path / "m"


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_check_json_fails_on_the_shipped_defects(model):
    res = run("checkpoint", "check", "--model", str(model), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.output)
    assert doc["ok"] is False and doc["schema_version"] == 1
    failed = {f["id"] for f in doc["findings"] if f["status"] == "fail"}
    assert {"duplicate-targets", "wrong-scheme", "generation-config"} <= failed


def test_fix_dry_run_then_fix_then_check(model, tmp_path):
    res = run("checkpoint", "fix", "--model", str(model), "--dry-run")
    assert res.exit_code == 1  # the sampling keys still need a source
    assert res.output.startswith("--- a/config.json\n+++ b/config.json\n")
    assert "would fix: group_0 (INT4 g128): targets ['Linear'] -> 1 explicit pattern(s)" in (
        res.output
    )
    assert not (model / "config.json.orig").exists()

    res = run("checkpoint", "fix", "--model", str(model), "--sampling", "temperature=0.7",
              "--sampling", "top_p=0.8")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert f"original kept as {model / 'config.json.orig'}\n" in res.output
    assert "fixed: generation_config.json: set temperature, top_p\n" in res.output

    res = run("checkpoint", "check", "--model", str(model))
    assert res.exit_code == 0, res.output
    res = run("checkpoint", "fix", "--model", str(model), "--json")
    assert res.exit_code == 0
    assert json.loads(res.output)["changed"] == []


def test_fix_usage_errors(model, tmp_path):
    res = CliRunner().invoke(main, ["checkpoint", "fix", "--model", str(model),
                                    "--sampling", "top_k=20",
                                    "--generation-config-from", str(tmp_path)])  # fmt: skip
    assert res.exit_code == 2
    assert "Error: pass --generation-config-from or --sampling, not both" in res.output
    res = CliRunner().invoke(main, ["checkpoint", "fix", "--model", str(model),
                                    "--sampling", "temp=1"])  # fmt: skip
    assert res.exit_code == 1
    assert res.output.startswith("Error: --sampling 'temp=1': expected KEY=VALUE, KEY one of ")
    assert not (model / "config.json.orig").exists()  # nothing half-written


def test_check_on_a_non_checkpoint_says_what_to_do(tmp_path):
    res = CliRunner().invoke(main, ["checkpoint", "check", "--model", str(tmp_path)])
    assert res.exit_code == 1
    assert res.output.startswith("Error: ")
    assert "config.json" in res.output


# ---------------------------------------------------------------- skeleton --fixed-metadata

REPO = Path(__file__).resolve().parents[2]


def flashnext(*args) -> subprocess.CompletedProcess:
    """The launcher in a process of its own. `python -m flashnext`, not ./flashnext: the
    root script builds its venv from the package index, which the Nix sandbox has not."""
    return subprocess.run([sys.executable, "-m", "flashnext", *map(str, args)],
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip


def test_fixed_metadata_skeleton_is_what_fix_leaves(tmp_path):
    """`skeleton --fixed-metadata` claims the checkpoint as `checkpoint fix` leaves it: then
    check finds nothing fix repairs (no ple-not-ignored either), fix has nothing to change,
    and fix run on the shipped skeleton writes the same config.json, byte for byte."""
    fixed, shipped = tmp_path / "fixed", tmp_path / "shipped"
    for args in ((fixed, "--fixed-metadata"), (shipped,)):
        proc = flashnext("skeleton", *args, "--tiny", "--json")
        assert proc.returncode == 0, proc.stderr

    proc = flashnext("checkpoint", "check", "--model", fixed, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    findings = json.loads(proc.stdout)["findings"]
    assert [(f["id"], f["status"]) for f in findings if f["status"] != "ok"] == []
    assert [f["id"] for f in findings] == ["quantization", "generation-config"]

    proc = flashnext("checkpoint", "fix", "--model", fixed, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["changed"], doc["diff"], doc["notes"], doc["remaining"]) == ([], "", [], [])
    proc = flashnext("checkpoint", "fix", "--model", fixed, "--dry-run")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "nothing to change\n", "")

    # fix on the shipped export, with the skeleton's sampling keys as the named source
    gen = json.loads((fixed / "generation_config.json").read_text())
    proc = flashnext("checkpoint", "fix", "--model", shipped, "--generation-config-from", fixed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (shipped / "config.json").read_bytes() == (fixed / "config.json").read_bytes()
    assert json.loads((shipped / "generation_config.json").read_text()) == gen


# ---------------------------------------------------------------- a shard this user may not read

# Root reads a mode-000 file anyway (CAP_DAC_OVERRIDE). As root, the child runs without
# CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH in its bounding set (util-linux setpriv), so the
# kernel refuses it the read with EACCES for real, as it refuses any other user; where that
# cannot be done the test is skipped, saying why.
NO_DAC = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")


def _as_a_user_the_mode_binds() -> tuple[str, ...]:
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root (mode 000 does not stop root) and no setpriv to drop it")
    probe = subprocess.run([*NO_DAC, "true"], capture_output=True, text=True, check=False)
    if probe.returncode:
        pytest.skip(f"running as root and setpriv cannot drop CAP_DAC_*: {probe.stderr.strip()}")
    return NO_DAC


def test_unreadable_shard_asks_for_access_not_a_download(tmp_path):
    model = tmp_path / "m"
    write_skeleton(model, "tiny", fixed_metadata=True)
    shard = model / "model-00001-of-00007.safetensors"
    prefix = _as_a_user_the_mode_binds()
    # A cache of its own, filled while the shard is readable: chmod changes
    # neither size nor mtime, and the cached header must not hide the refusal.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def flashnext_here(*args):
        argv = [*prefix, sys.executable, "-m", "flashnext", *map(str, args)]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300,
                              check=False)  # fmt: skip

    hour_ago = time.time_ns() - 3600 * 10**9  # the cache skips files written just now
    for path in model.iterdir():
        os.utime(path, ns=(hour_ago, hour_ago))
    facts = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
    preflight = ("preflight", "--json", "--facts", facts, "--model", model,
                 "--table", tmp_path / "ple-table.bin")  # fmt: skip
    proc = flashnext_here(*preflight)
    assert "not readable" not in proc.stdout + proc.stderr
    assert any((tmp_path / "cache").rglob("*.json")), "the first read cached no header"
    shard.chmod(0)
    proc = flashnext_here("checkpoint", "check", "--model", model)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    out = proc.stdout + proc.stderr
    assert f"Error: {shard}: not readable by this user (" in out
    assert "permission denied (" in out and "mode 0000)" in out
    assert f"chmod u+r {shard}" in out or f"chmod a+r {shard}" in out
    assert "download" not in out

    proc = flashnext_here(*preflight)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    (found,) = [f for f in json.loads(proc.stdout)["findings"] if f["id"] == "model.dir"]
    assert found["level"] == "fail"
    assert found["message"].startswith(f"{shard}: not readable by this user (")
    assert "chmod" in found["fix"] and "download" not in found["fix"]
    assert found["fix"] not in found["message"]  # said once, as the fix

    # config.json, read before any shard: the same access fix, not "make sure the download
    # is complete"
    shard.chmod(0o644)
    (model / "config.json").chmod(0)
    proc = flashnext_here("checkpoint", "check", "--model", model)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Error: {model / 'config.json'}: not readable by this user (" in proc.stderr
    assert "chmod" in proc.stderr and "download" not in proc.stderr
