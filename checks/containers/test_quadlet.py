"""podman's own Quadlet generator turns containers/flashnext.container into the README's run line.

Debian 12's podman (4.3) has no Quadlet, so the generator comes from a cached
Debian 13 minbase root with podman 5 (debootstrap, like the test image's base),
run in a chroot with `-dryrun`: it prints the systemd service it would write.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import runline
from podman_cli import CACHE
from test_run_settings import CONTAINERS, run_line_parts
from testimage import debian_rootfs

QUADLET_SUITE = "trixie"
QUADLET = "/usr/libexec/podman/quadlet"
# What Quadlet adds to every container it runs under systemd.
QUADLET_OWN = {"--cidfile", "--replace", "--rm", "--cgroups", "--sdnotify"}


@pytest.fixture(scope="module")
def service() -> str:
    if os.geteuid() != 0:
        pytest.skip("the Quadlet chroot needs root")
    root = debian_rootfs(QUADLET_SUITE, ("podman",), CACHE)
    units = Path(tempfile.mkdtemp(dir=root / "tmp", prefix="quadlet-"))
    try:
        shutil.copy(CONTAINERS / "flashnext.container", units)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "QUADLET_UNIT_DIRS": f"/tmp/{units.name}"}
        proc = subprocess.run(
            ["chroot", str(root), QUADLET, "-dryrun"], env=env, capture_output=True, text=True
        )
    finally:
        shutil.rmtree(units)
    assert proc.returncode == 0, proc.stderr
    assert "---flashnext.service---" in proc.stdout, proc.stdout + proc.stderr
    return proc.stdout


def exec_start(service: str) -> list[str]:
    (line,) = [ln for ln in service.splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[:2] == ["/usr/bin/podman", "run"], argv
    return argv[2:]


def test_generated_podman_run_is_the_documented_run_line(service):
    flags, image, args = runline.parse(exec_start(service))
    flags = +type(flags)({k: v for k, v in flags.items() if k[0] not in QUADLET_OWN})
    want_flags, want_image, want_args = run_line_parts()
    assert (image, args) == (want_image, want_args)
    assert flags == want_flags, {
        "only in the unit": flags - want_flags,
        "only in the README": want_flags - flags,
    }


def test_unit_keeps_its_service_settings(service):
    assert "Restart=on-failure" in service
    assert "WantedBy=multi-user.target default.target" in service
