"""Podman for the container tests: one storage, one set of flags, real subprocesses.

The tests keep their own image store under $FLASHNEXT_CACHE/containers, never
mixed with a user's store: overlay as root (a container start costs seconds),
vfs otherwise (works rootless everywhere, but copies the image per container).
One directory per driver, since podman cannot switch a store's driver. runc
and cgroupfs because crun and systemd cgroups fail on hybrid cgroup hosts;
the nofile/nproc ulimits because podman's defaults exceed what such hosts
allow (containers/README.md, "podman settings").
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

CACHE = Path(os.environ.get("FLASHNEXT_CACHE", Path.home() / ".cache" / "flashnext"))
DRIVER = "overlay" if os.geteuid() == 0 else "vfs"
STORE = CACHE / "containers" / f"storage-{DRIVER}"
RUNROOT = Path(os.environ.get("XDG_RUNTIME_DIR", "/tmp")) / f"flashnext-podman-{DRIVER}"

GLOBAL_FLAGS = [
    "--root", str(STORE),
    "--runroot", str(RUNROOT),
    "--storage-driver", DRIVER,
    "--runtime", "runc",
    "--cgroup-manager", "cgroupfs",
    "--events-backend", "file",
]  # fmt: skip
RUN_FLAGS = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]


class PodmanError(RuntimeError):
    """A podman command failed; the message carries its stderr."""


def podman(*args: str, input_bytes: bytes | None = None, check: bool = True, timeout: float = 600):
    cmd = ["podman", *GLOBAL_FLAGS, *args]
    proc = subprocess.run(cmd, input=input_bytes, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise PodmanError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )
    return proc


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def run(image: str, *args: str, flags: tuple[str, ...] = (), check: bool = False):
    """`podman run --rm` with the host-safe ulimits plus `flags`; returns the CompletedProcess."""
    return podman("run", "--rm", *RUN_FLAGS, *flags, image, *args, check=check)
