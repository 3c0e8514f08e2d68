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


# ---------------------------------------------------------------- issue 13, finding 8

REPO = Path(__file__).resolve().parents[2]


def wheelhouse_with(*names: str) -> Path | None:
    """A pins wheelhouse already in the cache that holds these distributions (offline)."""
    import os

    cache = Path(os.environ.get("FLASHNEXT_CACHE", Path.home() / ".cache" / "flashnext"))
    for wheels in sorted((cache / "wheelhouse").glob("*/")):
        have = {w.name.split("-")[0].lower() for w in wheels.glob("*.whl")}
        if all(n in have for n in names):
            return wheels
    return None


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}  # fmt: skip


def test_flashnext_builds_its_venv_once_then_runs_no_pip_and_never_writes_the_checkout(
    tmp_path: Path,
) -> None:
    import shutil

    wheels = wheelhouse_with("click", "rich", "nvidia_ml_py", "markdown_it_py", "mdurl",
                             "pygments", "psutil", "httpx", "httpcore", "anyio", "h11",
                             "idna", "certifi", "pydantic", "pydantic_core",
                             "annotated_types", "typing_inspection")  # fmt: skip
    if wheels is None:
        import pytest

        pytest.skip("no pins wheelhouse with the launcher's dependencies (pins/build-env)")
    clone = tmp_path / "clone"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(REPO / "launcher", clone / "launcher", ignore=skip)
    (clone / "checks").mkdir()
    shutil.copy2(REPO / "checks" / "lib.sh", clone / "checks" / "lib.sh")
    shutil.copy2(REPO / "flashnext", clone / "flashnext")
    before = snapshot(clone)
    cache = tmp_path / "cache"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLASHNEXT_CACHE": str(cache),
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}  # fmt: skip

    def version() -> subprocess.CompletedProcess:
        return subprocess.run([str(clone / "flashnext"), "--version"], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)  # fmt: skip

    first = version()
    assert first.returncode == 0, first.stderr
    assert first.stdout == "flashnext, version 0.1.0\n"
    (venv,) = (cache / "launcher").iterdir()
    assert first.stderr == f"flashnext: building the launcher venv in {venv} (one time)\n"
    # From now on pip must not run: it would leave this marker.
    marker = tmp_path / "pip-ran"
    (venv / "bin" / "pip").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    second = version()
    assert (second.returncode, second.stdout, second.stderr) == (
        0, "flashnext, version 0.1.0\n", ""
    )  # fmt: skip
    assert not marker.exists()
    assert snapshot(clone) == before  # no egg-info, no build/, no __pycache__
    # the launcher runs from the clone's sources: an edit is live without a rebuild
    init = clone / "launcher" / "src" / "flashnext" / "__init__.py"
    init.write_text(init.read_text().replace('"0.1.0"', '"0.1.0+edited"'))
    assert version().stdout == "flashnext, version 0.1.0+edited\n"


def test_a_cache_that_is_a_file_says_so_with_the_fix(tmp_path: Path) -> None:
    """Issue 39 class 10: FLASHNEXT_CACHE naming a file was a bare errno from venv."""
    repo = LIB.parents[1]
    cache = tmp_path / "not-a-dir"
    cache.write_text("")
    proc = subprocess.run(
        [str(repo / "flashnext"), "--version"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLASHNEXT_CACHE": str(cache)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr == (
        f"flashnext: FLASHNEXT_CACHE={cache} is not a directory; fix: point FLASHNEXT_CACHE at "
        "a directory (export FLASHNEXT_CACHE=$HOME/.cache/flashnext) or unset it\n"
    )
    assert cache.read_text() == ""
