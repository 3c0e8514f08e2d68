"""Build the small image the container tests run: Debian minbase + Python + the launcher.

Not the product image (containers/Containerfile, or the Nix image): it holds
only what `flashnext preflight` needs, so the tests can check what the
launcher sees inside a container.

- The base root filesystem comes from debootstrap once (containers/debian_base.py,
  the product image's suite) and is cached under $FLASHNEXT_CACHE/containers
  (keyed by suite and package list), then `podman import`ed.
- The launcher layer: wheels built on the host with the suite's Python (pip
  finds the index through its own configuration), installed into a venv in
  the image by `podman build --isolation chroot` from testimage.Containerfile.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from podman_cli import CACHE, image_exists, podman

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "containers"))
from debian_base import SUITE, debian_rootfs  # noqa: E402  (one debootstrap for all images)

BASE_SUITE = SUITE
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
CONTAINERFILE = Path(__file__).with_name("testimage.Containerfile")


def base_image() -> str:
    root = debian_rootfs(BASE_SUITE, BASE_PACKAGES, CACHE)
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
