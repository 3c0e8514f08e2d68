"""Build the small image the container tests run: Debian minbase + Python + the launcher.

Not the product image (that is containers/Containerfile on top of vllm-openai,
or the Nix image): it holds only what `flashnext preflight` needs, so the tests
can check what the launcher sees inside a container.

- The base root filesystem comes from debootstrap once and is cached as a tar
  under $FLASHNEXT_CACHE/containers (keyed by suite and package list), built
  in a temp dir and renamed into place, then `podman import`ed.
- The launcher layer: wheels built on the host with the suite's Python (pip
  finds the index through its own configuration), installed into a venv in
  the image by `podman build --isolation chroot` from testimage.Containerfile.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from podman_cli import CACHE, image_exists, podman

REPO = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
CONTAINERFILE = Path(__file__).with_name("testimage.Containerfile")


def base_key() -> str:
    text = f"debootstrap minbase {SUITE} {','.join(PACKAGES)}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def host_debian_mirror() -> str | None:
    """The mirror this host's apt uses for Debian (so no mirror is named in our files)."""
    sources = Path("/etc/apt/sources.list.d/debian.sources")
    if sources.is_file():
        for block in sources.read_text().split("\n\n"):
            uris = re.search(r"^URIs:\s*(\S+)", block, re.M)
            suites = re.search(r"^Suites:\s*(.+)$", block, re.M)
            if uris and suites and SUITE in suites.group(1).split():
                return uris.group(1)
    legacy = Path("/etc/apt/sources.list")
    if legacy.is_file():
        for line in legacy.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == SUITE:
                return parts[1]
    return None  # debootstrap's own default


def base_rootfs_tar() -> Path:
    """debootstrap once; later runs reuse the cached tar (a half-built one never lands)."""
    out = CACHE / "containers" / f"debian-{SUITE}-minbase-{base_key()}.tar"
    if out.is_file():
        return out
    if shutil.which("debootstrap") is None:
        sys.exit(
            "debootstrap is missing: apt-get install -y debootstrap (checks/containers/run does)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".rootfs-") as tmp:
        root = Path(tmp) / "root"
        cmd = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(root),
        ]
        if mirror := host_debian_mirror():
            cmd.append(mirror)
        print(f"testimage: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        # apt lists and caches are not needed to run Python.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / junk, ignore_errors=True)
        part = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", str(part), "."], check=True
        )
        os.replace(part, out)
    return out


def base_image() -> str:
    ref = f"localhost/flashnext-test-base:{base_key()}"
    if not image_exists(ref):
        tar = base_rootfs_tar()
        with tar.open("rb") as f:
            podman("import", "-", ref, input_bytes=f.read())
    return ref


def launcher_wheels(dest: Path) -> None:
    """The launcher and its dependencies as wheels, built by the suite's Python.

    Built from a copy: an in-tree build would leave build/ and *.egg-info in launcher/.
    """
    src = dest.parent / "launcher-src"
    shutil.copytree(
        REPO / "launcher",
        src,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.pyc"),
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(dest), str(src)]
    subprocess.run(cmd, check=True)


def image_key(base: str) -> str:
    """Hash of what goes into the image: base, Containerfile, the launcher's files.

    (Built wheels carry timestamps, so they cannot be the key.)
    """
    digest = hashlib.sha256(base.encode() + CONTAINERFILE.read_bytes())
    launcher = REPO / "launcher"
    sources = [launcher / "pyproject.toml", *(launcher / "src").rglob("*")]
    for path in sorted(sources):
        if path.is_file() and path.suffix != ".pyc" and ".egg-info" not in str(path):
            digest.update(str(path.relative_to(launcher)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def build_test_image() -> str:
    """Build localhost/flashnext-test:<key> unless it exists; returns the reference."""
    base = base_image()
    ref = f"localhost/flashnext-test:{image_key(base)}"
    if image_exists(ref):
        return ref
    with tempfile.TemporaryDirectory(prefix="flashnext-testimage-") as tmp:
        ctx = Path(tmp)
        launcher_wheels(ctx / "wheels")
        shutil.copy(CONTAINERFILE, ctx / "Containerfile")
        podman(
            "build", "--isolation", "chroot", "--build-arg", f"BASE={base}", "--tag", ref, str(ctx)
        )
    return ref


if __name__ == "__main__":
    print(build_test_image())
