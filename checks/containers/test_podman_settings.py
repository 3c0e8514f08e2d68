"""containers/containers.conf is what podman reads, section by section (issue 43).

A newcomer pasted the README's settings without their [containers] / [engine]
headers and podman ignored them without a word; then a `--ulimit memlock=-1:-1`
on the run line dropped the configured open-file limit. Each claim is podman's
own answer here: `podman info` for the [engine] keys, and `podman create` plus
`podman inspect` for the ulimits a container gets (nothing is started, so no
runtime limit of this host decides the outcome).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "containers" / "containers.conf"
README = REPO / "containers" / "README.md"
IMAGE = "localhost/flashnext-empty:settings"


class Podman:
    """podman with a throwaway store and a given CONTAINERS_CONF."""

    def __init__(self, root: Path, runroot: Path):
        self.flags = ["--root", str(root / "store"), "--runroot", str(runroot),
                      "--storage-driver", "vfs"]  # fmt: skip
        self.root = root

    def __call__(self, conf: Path, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        return subprocess.run(["podman", *self.flags, *args], capture_output=True, text=True,
                              env=env, timeout=120)  # fmt: skip

    def ulimits(self, conf: Path, *flags: str) -> dict[str, tuple[int, int]]:
        """The rlimits a container created with `flags` under `conf` would get."""
        name = f"c{len(list(self.root.glob('c*')))}"
        (self.root / name).touch()
        made = self(conf, "create", "--name", name, *flags, IMAGE, "/none")
        assert made.returncode == 0, made.stderr
        got = self(conf, "inspect", "--format", "{{json .HostConfig.Ulimits}}", name)
        return {u["Name"]: (u["Soft"], u["Hard"]) for u in json.loads(got.stdout)}


@pytest.fixture
def podman(tmp_path) -> Iterator[Podman]:
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: run checks/containers/run (it installs podman)")
    runroot = Path(tempfile.mkdtemp(prefix="fxconf-"))  # podman: at most 50 characters
    p = Podman(tmp_path, runroot)
    empty = tmp_path / "empty.tar"
    tarfile.open(empty, "w").close()  # an image of no files: created, never started
    made = p(CONF, "import", str(empty), IMAGE)
    assert made.returncode == 0, made.stderr
    yield p
    p(CONF, "rm", "--all", "--force")
    shutil.rmtree(runroot, ignore_errors=True)


def variant(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def bare(text: str) -> str:
    """The settings as the README once listed them: keys without their sections."""
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("["))


def test_the_file_is_toml_with_its_sections():
    conf = tomllib.loads(CONF.read_text())
    assert conf["engine"] == {"runtime": "runc", "cgroup_manager": "cgroupfs"}
    assert conf["containers"]["default_ulimits"][0].startswith("nofile=")


def test_podman_reads_the_engine_section(podman, tmp_path):
    info = podman(CONF, "info", "--format", "{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}}")
    assert info.returncode == 0, info.stderr
    assert info.stdout.split() == ["runc", "cgroupfs"]
    # the values are read from this file: another runtime name there is podman's error
    text = CONF.read_text().replace('runtime = "runc"', 'runtime = "no-such-runtime"')
    broken = podman(variant(tmp_path, "other.conf", text), "info")
    assert broken.returncode != 0 and "no-such-runtime" in broken.stderr
    # ... and the same keys outside [engine] are ignored without a word
    ignored = podman(variant(tmp_path, "bare.conf", bare(text)), "info")
    assert ignored.returncode == 0, ignored.stderr


def test_podman_applies_the_containers_sections_ulimits(podman, tmp_path):
    limits = podman.ulimits(CONF)
    assert limits["RLIMIT_NOFILE"] == (20000, 20000)
    assert limits["RLIMIT_NPROC"] == (32768, 32768)
    # without the section header: podman's own 1048576 open files, which runc
    # cannot set under a lower host hard limit ("error setting rlimit type 7")
    pasted = podman.ulimits(variant(tmp_path, "bare.conf", bare(CONF.read_text())))
    assert pasted["RLIMIT_NOFILE"] == (1048576, 1048576)


def test_a_ulimit_on_the_run_line_and_the_configured_ones(podman):
    """podman 4.x: any --ulimit replaces default_ulimits, so memlock alone brings back
    the 1048576 open files; the README's run line repeats nofile and nproc."""
    version = podman(CONF, "--version").stdout.split()[-1]
    alone = podman.ulimits(CONF, "--ulimit", "memlock=-1:-1")
    assert alone["RLIMIT_MEMLOCK"] == (-1, -1)
    if version.startswith("4."):
        assert alone["RLIMIT_NOFILE"] == (1048576, 1048576)
    both = podman.ulimits(CONF, "--ulimit", "memlock=-1:-1", "--ulimit", "nofile=20000:20000",
                          "--ulimit", "nproc=32768:32768")  # fmt: skip
    assert both["RLIMIT_NOFILE"] == (20000, 20000) and both["RLIMIT_MEMLOCK"] == (-1, -1)


def test_the_readme_points_at_the_file_and_names_no_missing_document():
    text = README.read_text()
    assert "containers/containers.conf" in text
    assert "TOOLING.md" not in text
    assert "error setting rlimit type 7" in text


def test_check_image_names_the_open_file_limit_not_a_rebuild(podman, tmp_path):
    """Issue 43: runc's bare "error setting rlimit type 7" was answered with "rebuild".
    Here podman asks for more open files than this host's hard limit, for real."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= 1048576:
        pytest.skip(f"this host's hard open-file limit ({hard}) lets runc set any")
    limit = f"nofile={hard + 1}:{hard + 1}"
    above = variant(tmp_path, "above.conf", f'[containers]\ndefault_ulimits = ["{limit}"]\n')
    env = {**os.environ, "CONTAINERS_CONF": str(above), "PODMAN_FLAGS": " ".join(podman.flags)}
    proc = subprocess.run([REPO / "containers" / "check-image", IMAGE], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "error setting rlimit type 7" in proc.stderr
    assert "open-file limit" in proc.stderr and "containers/containers.conf" in proc.stderr
    assert "rebuild" not in proc.stderr
    # the same image under the shipped settings starts; it is no flashnext image, and
    # that is the image's fault (no python3 in it): then check-image says rebuild
    env["CONTAINERS_CONF"] = str(CONF)
    proc = subprocess.run([REPO / "containers" / "check-image", IMAGE], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and "rlimit" not in proc.stderr
    assert "rebuild the image from this checkout: containers/build" in proc.stderr


def test_the_readmes_series_figures_are_this_checkouts():
    """The check-image line and preflight's vllm.env row, as this checkout makes them."""
    import hashlib

    series = REPO / "patches" / "vllm-0.33.0" / "series"
    names = [ln.split("#")[0].strip() for ln in series.read_text().splitlines()]
    count = len([n for n in names if n])
    short = hashlib.sha256(series.read_bytes()).hexdigest()[:12]
    text = README.read_text()
    assert f"vLLM 0.33.0, series {short} ({count} patches), labels: as this checkout" in text
    assert f"│ vLLM 0.33.0, {count} patches " in text
