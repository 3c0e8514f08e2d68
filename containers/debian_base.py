#!/usr/bin/env python3
"""The product image's base: a debootstrapped Debian minbase, imported into podman.

    containers/debian_base.py            build (or reuse) it; print the image reference
    containers/debian_base.py --python   print the Python minor the suite ships (picks the lock)
    containers/debian_base.py --ref      print the reference it would have, build nothing

The suite and the package set are pinned here; the root is built once per
(suite, packages) under $FLASHNEXT_CACHE/containers, in a temp dir renamed
into place (a half-built root is never used), then `podman import`ed as
localhost/flashnext-debian:<suite>-<key>. Debian's mirror is the one this
host's apt uses, so no mirror is named in this repository.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = "bookworm"
# bookworm's python3 is 3.11: the image installs pins/requirements-cp311.txt.
PYTHON = "3.11"
PACKAGES = (
    "python3",
    "python3-venv",
    "ca-certificates",
    "patch",  # patches/apply runs GNU patch
    # Triton compiles its kernel launchers (C, against Python.h) at run time.
    "gcc",
    "libc6-dev",
    "python3-dev",
)
# Not needed to run anything, and they differ between two debootstraps.
JUNK = (
    "var/cache/apt/archives",
    "var/lib/apt/lists",
    "var/cache/ldconfig/aux-cache",
    "var/log",
    "etc/machine-id",
)
CACHE = Path(os.environ.get("FLASHNEXT_CACHE") or Path.home() / ".cache" / "flashnext")


class BaseError(RuntimeError):
    """A step failed; the message says what to do."""


def host_debian_mirror() -> str | None:
    """The Debian mirror this host's apt uses (so no mirror is named in our files)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for block in sources.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", block, re.M)
            if uris and "security" not in uris.group(1):
                return uris.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    return None  # debootstrap's own default


def root_key(suite: str, packages: tuple[str, ...]) -> str:
    return hashlib.sha256(f"minbase {suite} {','.join(packages)}".encode()).hexdigest()[:12]


PROGRESS_EVERY = 15.0  # seconds between package counts while debootstrap works
# debootstrap's per-package lines ("I: Retrieving libc6 2.36-9", "I: Unpacking
# libc6:amd64..."): hundreds of them, shown as a count; its stage lines as they are.
PER_PACKAGE = re.compile(
    r"^I: (Retrieving|Validating) \S+ \S+$|^I: (Extracting|Unpacking|Configuring) \S+\.\.\.$"
)


def follow(lines, out, every: float | None = None, clock=time.monotonic) -> list[str]:
    """Show debootstrap's progress on `out`: stage lines and warnings as they come,
    every `every` s how many packages the current step has done, and the totals when
    a run of package lines ends. Returns the last 10 lines (for an error message)."""
    every = PROGRESS_EVERY if every is None else every
    started = shown = clock()
    done: dict[str, int] = {}  # packages per step (retrieving, validating, ...) this run
    last: list[str] = []
    for raw in lines:
        line = raw.rstrip("\n")
        last = [*last[-9:], line]
        match = PER_PACKAGE.match(line)
        if match is None:
            if done:  # a run of package lines ended: its totals, then the stage line
                totals = ", ".join(f"{step} {n}" for step, n in done.items())
                print(f"debian_base: debootstrap: {totals} packages", file=out, flush=True)
                done = {}
            print(f"debian_base: debootstrap: {line}", file=out, flush=True)
            continue
        step = (match.group(1) or match.group(2)).lower()
        done[step] = done.get(step, 0) + 1
        now = clock()
        if now - shown >= every:
            shown = now
            print(f"debian_base: debootstrap: {step} package {done[step]}, "
                  f"{shown - started:.0f} s", file=out, flush=True)  # fmt: skip
    return last


def debian_rootfs(suite: str, packages: tuple[str, ...], cache: Path = CACHE) -> Path:
    """A debootstrap'd minbase root, cached by suite and packages."""
    out = cache / "containers" / f"debian-{suite}-{root_key(suite, packages)}"
    if out.is_dir():
        return out
    if shutil.which("debootstrap") is None:
        raise BaseError("debootstrap is missing: apt-get update && apt-get install -y debootstrap")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".debian-{suite}-"))
    try:
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite]
        cmd.append(str(tmp / "root"))
        if mirror := host_debian_mirror():
            cmd.append(mirror)
        print(f"debian_base: {' '.join(cmd)}", file=sys.stderr)
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            last = follow(proc.stdout, sys.stderr)
        if proc.returncode != 0:
            tail = "\n".join(last)
            raise BaseError(
                f"debootstrap {suite} failed (exit {proc.returncode}):\n{tail}\n"
                "Check that this host's apt can reach its Debian mirror (apt-get update) "
                "and that the disk has ~1 GiB free."
            )
        for junk in JUNK:
            path = tmp / "root" / junk
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        os.rename(tmp / "root", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def image_ref(tag: str) -> str:
    return f"localhost/flashnext-debian:{tag}"


def podman_image(root: Path, podman: tuple[str, ...] = ("podman",)) -> str:
    """`podman import` of the root (once per root); returns the reference."""
    ref = image_ref(root.name.removeprefix("debian-"))
    if subprocess.run([*podman, "image", "exists", ref]).returncode == 0:
        return ref
    # Sorted, numeric owners: the layer depends on the files, not on readdir order.
    tar = subprocess.Popen(
        ["tar", "-C", str(root), "--sort=name", "--numeric-owner", "-cf", "-", "."],
        stdout=subprocess.PIPE,
    )
    imported = subprocess.run([*podman, "import", "-", ref], stdin=tar.stdout, capture_output=True)
    tar.stdout.close()
    if tar.wait() != 0 or imported.returncode != 0:
        raise BaseError(f"podman import of {root} failed: {imported.stderr.decode()[-500:]}")
    return ref


def main() -> int:
    parser = argparse.ArgumentParser(prog="containers/debian_base.py", description=__doc__)
    parser.add_argument("--python", action="store_true", help="print the suite's Python X.Y")
    parser.add_argument("--ref", action="store_true", help="print the reference, build nothing")
    args = parser.parse_args()
    if args.python:
        print(PYTHON)
        return 0
    if args.ref:
        print(image_ref(f"{SUITE}-{root_key(SUITE, PACKAGES)}"))
        return 0
    try:
        print(podman_image(debian_rootfs(SUITE, PACKAGES)))
    except BaseError as exc:
        print(f"containers/debian_base.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
