"""Fixtures for the Nix checks: a Nix configured for offline evaluation, repo copies.

nixpkgs is replaced by checks/nix/nixpkgs-standin (a stand-in, see its
flake.nix); nothing is fetched and nothing heavier than a .drv is written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STANDIN = "checks/nix/nixpkgs-standin"
NIX_CONFIG = "\n".join(
    [
        "experimental-features = nix-command flakes",
        "substituters =",
        "build-users-group =",
        "connect-timeout = 3",
        "warn-dirty = false",
    ]
)


def repo_files(repo: Path = REPO) -> list[str]:
    """What a clone would have: tracked files plus untracked ones git does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo, check=True, capture_output=True,
    ).stdout  # fmt: skip
    return [f for f in out.decode().split("\0") if f and (repo / f).exists()]


def copy_repo(dest: Path) -> Path:
    for rel in repo_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target, follow_symlinks=False)
    return dest


class Nix:
    """`nix` with the offline settings, run in one directory."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.env = {**os.environ, "NIX_CONFIG": NIX_CONFIG}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            args, cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
        return proc

    def override(self) -> list[str]:
        return ["--override-input", "nixpkgs", f"path:{self.cwd / STANDIN}"]

    def flake(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """A flake command on path:<cwd> (every file, as in a clone) with the stand-in."""
        cmd, *rest = args
        return self.run("nix", "flake", cmd, f"path:{self.cwd}", *self.override(), *rest,
                        check=check)  # fmt: skip

    def summary(self, check: bool = True):
        """checks/nix/summary.nix over this tree; the CompletedProcess when check=False."""
        expr = f"import {REPO / 'checks/nix/summary.nix'} {{ root = {self.cwd}; }}"
        proc = self.run("nix", "eval", "--impure", "--json", "--expr", expr, check=check)
        return json.loads(proc.stdout) if check else proc


@pytest.fixture(scope="session")
def nix_bin() -> None:
    if shutil.which("nix") is None:
        pytest.fail("nix is missing: run checks/nix/run (it installs nix-bin)")


@pytest.fixture(scope="session")
def nix(nix_bin) -> Nix:
    return Nix(REPO)


@pytest.fixture(scope="session")
def summary(nix) -> dict:
    return nix.summary()


@pytest.fixture
def repo_copy(nix_bin, tmp_path) -> Nix:
    return Nix(copy_repo(tmp_path / "repo"))
