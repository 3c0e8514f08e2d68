"""checks/lib.sh keeps one launcher venv per checkout and drops those of deleted checkouts."""

from __future__ import annotations

import subprocess
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib.sh"


def prune(cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", f'source "{LIB}" && prune_launcher_venvs'],
        env={"PATH": "/usr/bin:/bin", "FLASHNEXT_CACHE": str(cache)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip


def venv(cache: Path, key: str, checkout: Path | None) -> Path:
    path = cache / "launcher" / key
    (path / "bin").mkdir(parents=True)
    (path / ".complete").touch()
    if checkout is not None:
        (path / ".checkout").write_text(f"{checkout}\n")
    return path


def test_only_venvs_of_deleted_checkouts_are_removed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    live = tmp_path / "clone with space"
    (live / "launcher").mkdir(parents=True)
    (live / "launcher" / "pyproject.toml").write_text("[project]\n")
    kept = venv(cache, "aaaa", live)
    gone = venv(cache, "bbbb", tmp_path / "deleted-clone")
    unknown = venv(cache, "cccc", None)  # built before checkouts were recorded
    proc = prune(cache)
    assert kept.is_dir() and unknown.is_dir()
    assert not gone.exists()
    assert f"removing the launcher venv of the deleted checkout {tmp_path / 'deleted-clone'}" in (
        proc.stderr
    )
    assert prune(cache).stderr == ""  # nothing left to remove


def test_no_cache_yet_is_fine(tmp_path: Path) -> None:
    assert prune(tmp_path / "empty").returncode == 0
