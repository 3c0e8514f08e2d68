"""pins/check and pins/lock as users run them: exit codes and messages."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "pins" / script), *args],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def pins_copy(tmp_path, pins_dir):
    copy = tmp_path / "pins"
    shutil.copytree(pins_dir, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_offline_check_of_the_committed_pins_passes(tmp_path):
    result = run("check", "--offline", "--json", "--cache", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["schema_version"] == 1
    statuses = {f["id"]: f["status"] for f in report["findings"]}
    assert statuses == {
        "lock-files": "ok",
        "resolves-3.11": "skip",
        "resolves-3.12": "skip",
        "wheelhouse-3.11": "skip",
        "wheelhouse-3.12": "skip",
    }


def test_a_hand_edited_lock_fails_the_check(pins_copy, tmp_path):
    lock = pins_copy / "requirements-cp312.txt"
    lock.write_text(lock.read_text().replace("torch==2.14.0", "torch==2.14.1"))
    result = run("check", "--offline", "--pins-dir", str(pins_copy), "--cache", str(tmp_path))
    assert result.returncode == 1
    assert (
        "fail  lock-files        requirements-cp312.txt: sha256 differs from vllm.toml "
        "(edited by hand?); restore it or run pins/lock; requirements-cp312.txt: torch is "
        "not pinned to 2.14.0" in result.stdout
    )
    assert result.stdout.rstrip().endswith("pins/check: 1 failed")


def test_a_url_in_a_lock_fails_the_check_with_the_line(pins_copy, tmp_path):
    lock = pins_copy / "requirements-cp311.txt"
    lines = lock.read_text().splitlines(keepends=True)
    lines.insert(11, "--extra-index-url https://example.invalid/simple\n")
    lock.write_text("".join(lines))
    result = run("check", "--offline", "--pins-dir", str(pins_copy), "--cache", str(tmp_path))
    assert result.returncode == 1
    assert "requirements-cp311.txt:12: a URL or pip option" in result.stdout


def test_a_tampered_cached_wheelhouse_fails_the_check(pins_copy, tmp_path):
    from fakewheels import make_closure, write_pins
    from pinkit import lockfile, wheelhouse

    wheels = make_closure(tmp_path / "seed")
    write_pins(pins_copy, wheels, "3.11")
    lock = pins_copy / "requirements-cp311.txt"
    pins = lockfile.parse(lock.read_text())
    house = wheelhouse.path_for(tmp_path / "cache", lockfile.pins_digest(pins))
    assert wheelhouse.seed(house, pins, [tmp_path / "seed"]) == 2
    wheelhouse.mark_complete(house, lockfile.pins_digest(pins))
    # write_pins locked only 3.11, so lock-files fails on the missing 3.12 lock;
    # this test looks at the wheelhouse finding alone.
    ok = run(
        "check",
        "--offline",
        "--json",
        "--pins-dir",
        str(pins_copy),
        "--cache",
        str(tmp_path / "cache"),
    )
    findings = {f["id"]: f for f in json.loads(ok.stdout)["findings"]}
    assert findings["wheelhouse-3.11"]["status"] == "ok"
    tinydep = next(house.glob("tinydep-*.whl"))
    tinydep.write_bytes(tinydep.read_bytes() + b"\0")
    bad = run(
        "check",
        "--offline",
        "--json",
        "--pins-dir",
        str(pins_copy),
        "--cache",
        str(tmp_path / "cache"),
    )
    findings = {f["id"]: f for f in json.loads(bad.stdout)["findings"]}
    assert bad.returncode == 1
    assert findings["wheelhouse-3.11"]["status"] == "fail"
    assert "tinydep-1.0-py3-none-any.whl: sha256" in findings["wheelhouse-3.11"]["message"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--python", "3.12"], "pins/lock: error: --python expects X.Y=PATH, got '3.12'"),
        (["--python", "3.12=/bin/true"], "pins/lock: error: /bin/true is not a working CPython"),
        (["--glibc", "two"], "pins/lock: error: glibc must look like 2.31, got 'two'"),
    ],
)
def test_lock_refuses_bad_arguments_before_resolving(args, message):
    result = run("lock", "--dry-run", *args)
    assert result.returncode == 1
    assert message in result.stderr
