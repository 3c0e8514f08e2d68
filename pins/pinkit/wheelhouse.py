"""A directory of exactly the locked wheels, so installs need no index.

One wheelhouse per lock (named by lockfile.pins_digest of it) under
$FLASHNEXT_CACHE/wheelhouse/. It is filled first from seed directories (older
wheelhouses, or any dir of wheels: only files whose sha256 the lock names are
taken, hard-linked when possible), then by `pip download --require-hashes`
for whatever is still missing. pip checks every file, old or new, against the
lock's hashes; the `.complete` marker is written only after that succeeded.
"""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .lockfile import Pin, canonical_name
from .meta import file_sha256
from .target import Target

COMPLETE_MARKER = ".complete"


class WheelhouseError(RuntimeError):
    """The wheelhouse cannot be filled or does not match the lock."""


def path_for(cache: Path, lock_sha256: str) -> Path:
    return Path(cache) / "wheelhouse" / lock_sha256[:32]


def wheel_project(filename: str) -> tuple[str, str] | None:
    """(normalized name, version) from a wheel file name, None if not a wheel."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    return canonical_name(parts[0]), parts[1]


def _wanted(pins: list[Pin], present: Path) -> dict[tuple[str, str], Pin]:
    """Pins that have no file of their name and version in `present` yet."""
    have = set()
    if present.is_dir():
        have = {wheel_project(p.name) for p in present.iterdir()}
    return {(p.name, p.version): p for p in pins if (p.name, p.version) not in have}


def missing(wheelhouse: Path, pins: list[Pin]) -> list[Pin]:
    """Pins with no wheel of their name and version in the wheelhouse yet."""
    return list(_wanted(pins, wheelhouse).values())


def seed(wheelhouse: Path, pins: list[Pin], seed_dirs: list[Path]) -> int:
    """Link in seed files whose sha256 the lock names; return how many were taken."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    wanted = _wanted(pins, wheelhouse)
    taken = 0
    for seed_dir in seed_dirs:
        if not wanted:
            break
        if not Path(seed_dir).is_dir() or Path(seed_dir).resolve() == wheelhouse.resolve():
            continue
        for candidate in sorted(Path(seed_dir).iterdir()):
            project = wheel_project(candidate.name)
            pin = wanted.get(project) if project else None
            if pin is None or not candidate.is_file():
                continue
            if file_sha256(candidate) not in pin.sha256:
                continue
            _link_or_copy(candidate, wheelhouse / candidate.name)
            del wanted[project]
            taken += 1
    return taken


def _link_or_copy(source: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.seeding")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem, or links not allowed: copy
        shutil.copyfile(source, tmp)
    os.replace(tmp, dest)


PROGRESS_EVERY = 15.0  # seconds between progress lines while pip downloads


def report_progress(proc: subprocess.Popen, wheelhouse: Path, want: int, every=None) -> None:
    """Until proc ends, print how many wheels (and bytes) the wheelhouse holds now."""
    every = PROGRESS_EVERY if every is None else every
    started = time.monotonic()
    while True:
        try:
            proc.wait(timeout=every)
            return
        except subprocess.TimeoutExpired:
            pass
        files = [f for f in wheelhouse.glob("*.whl") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        print(
            f"wheelhouse: {len(files)} of {want} wheels here ({size / 1e9:.2f} GB), "
            f"{time.monotonic() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def download(python: str, target: Target, lock: Path, wheelhouse: Path) -> None:
    """Fetch the missing locked wheels with pip (which checks every hash)."""
    argv = [
        python,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--require-hashes",
        "--quiet",
        "--progress-bar",
        "off",
        "--dest",
        str(wheelhouse),
        *target.pip_target_args(),
        "-r",
        str(lock),
    ]
    want = sum(1 for ln in lock.read_text().splitlines() if re.match(r"^[A-Za-z0-9]", ln))
    with subprocess.Popen(argv, stdout=sys.stderr, stderr=subprocess.PIPE, text=True) as proc:
        # pip is quiet (its bar would flood a log); say every PROGRESS_EVERY s how far it is
        watch = threading.Thread(target=report_progress, args=(proc, wheelhouse, want), daemon=True)
        watch.start()
        stderr = proc.stderr.read()
        proc.wait()
        watch.join()
    if proc.returncode != 0:
        tail = [line for line in stderr.splitlines() if "is ignored" not in line][-20:]
        raise WheelhouseError(
            "pip download of the locked wheels failed:\n"
            + "\n".join(tail)
            + "\nIf a hash mismatches, the index serves a different file than the lock "
            "names: run pins/check, and pins/lock if upstream really changed it."
        )


def verify(wheelhouse: Path, pins: list[Pin]) -> list[str]:
    """Problems found by hashing every file; empty means it matches the lock."""
    problems = []
    by_project = {(p.name, p.version): p for p in pins}
    seen = set()
    for path in sorted(wheelhouse.iterdir()):
        if path.name.startswith("."):
            continue
        project = wheel_project(path.name)
        pin = by_project.get(project) if project else None
        if pin is None:
            problems.append(f"{path.name}: not in the lock")
            continue
        digest = file_sha256(path)
        if digest not in pin.sha256:
            problems.append(f"{path.name}: sha256 {digest} is not the locked {pin.sha256[0]}")
            continue
        seen.add(project)
    problems += [f"{name}=={version}: no wheel" for name, version in by_project.keys() - seen]
    return sorted(problems)


def is_complete(wheelhouse: Path, lock_sha256: str) -> bool:
    marker = wheelhouse / COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == lock_sha256


def mark_complete(wheelhouse: Path, lock_sha256: str) -> None:
    from .atomic import write_text_atomic

    write_text_atomic(wheelhouse / COMPLETE_MARKER, lock_sha256 + "\n")
