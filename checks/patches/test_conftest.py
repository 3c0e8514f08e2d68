"""The proves marker and --vllm-tree, run in a real pytest subprocess on fake trees.

Each case builds a throwaway repo (this conftest, a series with one patch) and
a fake `vllm` package (its _version.py, with or without the apply stamp).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")
PATCH = "0001-demo.patch"
PATCH_BODY = "Description: demo\n"


def make_repo(tmp_path: Path, test_body: str) -> Path:
    repo = tmp_path / "repo"
    tests = repo / "checks" / "patches"
    tests.mkdir(parents=True)
    shutil.copy(CONFTEST, tests / "conftest.py")
    (tests / "test_demo.py").write_text("import pytest\n\n" + test_body)
    series_dir = repo / "patches" / "vllm-0.33.0"
    series_dir.mkdir(parents=True)
    (series_dir / "series").write_text(f"# demo\n{PATCH}\n")
    (series_dir / PATCH).write_text(PATCH_BODY)
    return repo


def make_vllm(tmp_path: Path, stamp_sha: str | None, version: str = "0.33.0") -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "_version.py").write_text(f"__version__ = version = '{version}'\n")
    if stamp_sha is not None:
        stamp = {"patches": [{"name": PATCH, "sha256": stamp_sha, "files": []}]}
        (site / "vllm" / "_flashnext_patches.json").write_text(json.dumps(stamp))
    return site


def run(repo: Path, site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rxXf", *args]
    return subprocess.run(
        cmd + ["checks/patches"], cwd=repo, env=env, capture_output=True, text=True, check=False
    )


GOOD_SHA = hashlib.sha256(PATCH_BODY.encode()).hexdigest()
FAILS = f'@pytest.mark.proves("{PATCH}")\ndef test_proof():\n    assert False\n'
PASSES = f'@pytest.mark.proves("{PATCH}")\ndef test_proof():\n    pass\n'


def test_stock_tree_proof_failing_is_xfail(tmp_path: Path) -> None:
    proc = run(make_repo(tmp_path, FAILS), make_vllm(tmp_path, None), "--vllm-tree=stock")
    assert proc.returncode == 0, proc.stdout
    assert "1 xfailed" in proc.stdout


def test_stock_tree_proof_passing_fails_the_suite(tmp_path: Path) -> None:
    proc = run(make_repo(tmp_path, PASSES), make_vllm(tmp_path, None), "--vllm-tree=stock")
    assert proc.returncode == 1, proc.stdout
    assert "XPASS(strict)" in proc.stdout


def test_stock_tree_other_exception_than_raises_fails(tmp_path: Path) -> None:
    body = (
        f'@pytest.mark.proves("{PATCH}", raises=StopIteration)\n'
        "def test_proof():\n    raise KeyError('x')\n"
    )
    proc = run(make_repo(tmp_path, body), make_vllm(tmp_path, None), "--vllm-tree=stock")
    assert proc.returncode == 1, proc.stdout
    assert "1 failed" in proc.stdout


def test_patched_tree_proof_must_pass(tmp_path: Path) -> None:
    site = make_vllm(tmp_path, GOOD_SHA)
    assert run(make_repo(tmp_path, PASSES), site, "--vllm-tree=patched").returncode == 0
    proc = run(make_repo(tmp_path / "b", FAILS), site, "--vllm-tree=patched")
    assert proc.returncode == 1 and "1 failed" in proc.stdout


def test_patched_tree_with_stale_patch_fails(tmp_path: Path) -> None:
    proc = run(make_repo(tmp_path, PASSES), make_vllm(tmp_path, "0" * 64), "--vllm-tree=patched")
    assert proc.returncode == 1, proc.stdout
    assert f"{PATCH} changed since" in proc.stdout


def test_unknown_patch_name_fails_on_both_trees(tmp_path: Path) -> None:
    body = '@pytest.mark.proves("0009-typo.patch")\ndef test_proof():\n    assert False\n'
    repo = make_repo(tmp_path, body)
    for stamp in (None, GOOD_SHA):
        proc = run(repo, make_vllm(tmp_path / str(stamp), stamp))
        assert proc.returncode == 1, proc.stdout
        assert "no such entry in patches/vllm-0.33.0/series" in proc.stdout


@pytest.mark.parametrize(
    ("stamp", "option", "needle"),
    [
        (None, "--vllm-tree=patched", "--vllm-tree=patched but vllm at"),
        (GOOD_SHA, "--vllm-tree=stock", "--vllm-tree=stock but vllm at"),
    ],
)
def test_tree_mismatch_is_a_usage_error(
    tmp_path: Path, stamp: str | None, option: str, needle: str
) -> None:
    proc = run(make_repo(tmp_path, PASSES), make_vllm(tmp_path, stamp), option)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert needle in proc.stderr


def test_wrong_vllm_version_is_a_usage_error(tmp_path: Path) -> None:
    site = make_vllm(tmp_path, None, version="0.32.0")
    proc = run(make_repo(tmp_path, FAILS), site, "--vllm-tree=stock")
    assert proc.returncode == 4
    assert "is 0.32.0, the proofs are for 0.33.0" in proc.stderr
