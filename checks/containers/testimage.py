"""Build the small image the container tests run: Debian minbase + Python + the launcher.

Not the product image (that is containers/Containerfile on top of vllm-openai,
or the Nix image): it holds only what `flashnext preflight` needs, so the tests
can check what the launcher sees inside a container.

- The base root filesystem comes from debootstrap once and is cached under
  $FLASHNEXT_CACHE/containers (keyed by suite and package list), built in a
  temp dir and renamed into place, then `podman import`ed.
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
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
CONTAINERFILE = Path(__file__).with_name("testimage.Containerfile")


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


def debian_rootfs(suite: str, packages: tuple[str, ...]) -> Path:
    """A debootstrap'd minbase root, cached by suite and packages; built in a temp dir
    and renamed into place, so a half-built one is never used."""
    key = hashlib.sha256(f"minbase {suite} {','.join(packages)}".encode()).hexdigest()[:12]
    out = CACHE / "containers" / f"debian-{suite}-{key}"
    if out.is_dir():
        return out
    if shutil.which("debootstrap") is None:
        sys.exit("debootstrap is missing: apt-get install -y debootstrap (checks/containers/run)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".debian-{suite}-"))
    try:
        cmd = ["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite]
        cmd.append(str(tmp / "root"))
        if mirror := host_debian_mirror():
            cmd.append(mirror)
        print(f"testimage: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        # apt lists and caches are not needed to run anything.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(tmp / "root" / junk, ignore_errors=True)
        os.rename(tmp / "root", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def base_image() -> str:
    root = debian_rootfs(BASE_SUITE, BASE_PACKAGES)
    ref = f"localhost/flashnext-test-base:{root.name}"
    if not image_exists(ref):
        tar = subprocess.run(
            ["tar", "-C", str(root), "--numeric-owner", "-cf", "-", "."],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        podman("import", "-", ref, input_bytes=tar)
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
