"""The images' configs, as real podman reports them, against the documented contract.

nix/check-image-config.py reads `podman image inspect` output, fed here from
images podman really built or loaded, not from hand-written config texts:

- the config instructions (ENV, HEALTHCHECK, EXPOSE, ENTRYPOINT, CMD) of
  containers/Containerfile and of vllm-openai.Containerfile applied with
  `podman build` on the launcher test image built here, in the format
  containers/build uses, and once as an OCI image (which shows why that
  format is not used: podman drops the healthcheck from it);
- the Nix image's config object, as `nix eval` gives it with the nixpkgs
  stand-in (checks/nix), written into a Docker archive like the one
  dockerTools streams and loaded with `podman load`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from podman_cli import podman
from test_run_settings import CONTAINERS, README, REPO, containerfile_instructions

CHECKER = REPO / "nix" / "check-image-config.py"
CONFIG_INSTRUCTIONS = ("ENV", "HEALTHCHECK", "EXPOSE", "ENTRYPOINT", "CMD")


def check(inspect: bytes, kind: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / f"inspect-{kind}.json"
    path.write_bytes(inspect)
    return subprocess.run(
        [sys.executable, str(CHECKER), "--readme", str(README), "--inspect", str(path),
         "--kind", kind],
        capture_output=True, text=True,
    )  # fmt: skip


def build_script_format(tmp: Path) -> list[str]:
    """The --format flag containers/build passes to podman build, read from its --dry-run
    in a copy whose digest is filled in (the real file holds a placeholder)."""
    (tmp / "launcher").mkdir(parents=True)
    shutil.copy(REPO / "launcher" / "pyproject.toml", tmp / "launcher")
    shutil.copytree(CONTAINERS, tmp / "containers")
    (tmp / "containers" / "vllm-openai.digest").write_text("sha256:" + "ab" * 32 + "\n")
    out = subprocess.run(
        [tmp / "containers" / "build", "--dry-run", "--from", "vllm-openai"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    argv = shlex.split(out)
    return [a for i, a in enumerate(argv) if a == "--format" or argv[i - 1] == "--format"]


def build_with_containerfile_config(
    base: str, fmt: list[str], tag: str, tmp_path: Path, name: str = "vllm-openai.Containerfile"
) -> bytes:
    """`podman build` of base + a Containerfile's config; returns `podman image inspect`."""
    lines = [f"FROM {base}"]
    for word, rest in containerfile_instructions(name):
        if word in CONFIG_INSTRUCTIONS:
            lines.append(f"{word} {rest}")
    ctx = tmp_path / f"ctx-{tag}"
    ctx.mkdir()
    (ctx / "Containerfile").write_text("\n".join(lines) + "\n")
    ref = f"localhost/flashnext-contract:{tag}"
    try:
        podman("build", "--isolation", "chroot", *fmt, "--tag", ref, str(ctx))
        return podman("image", "inspect", ref).stdout
    finally:
        podman("rmi", "--force", ref, check=False)


@pytest.fixture(scope="module")
def containerfile_format(tmp_path_factory) -> list[str]:
    return build_script_format(tmp_path_factory.mktemp("build-copy"))


def test_containerfile_image_as_built_matches_the_contract(test_image, containerfile_format,
                                                           tmp_path):  # fmt: skip
    assert containerfile_format == ["--format", "docker"]
    inspect = build_with_containerfile_config(test_image, containerfile_format, "docker", tmp_path)
    assert json.loads(inspect)[0]["Healthcheck"]["Test"] == ["CMD", "flashnext-health"]
    proc = check(inspect, "containerfile", tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_debian_containerfile_config_as_built_matches_the_contract(test_image, tmp_path):
    """The product image's config instructions; its full build: containers/README.md."""
    inspect = build_with_containerfile_config(
        test_image, ["--format", "docker"], "debian", tmp_path, "Containerfile"
    )
    proc = check(inspect, "debian", tmp_path)
    assert proc.returncode == 0, proc.stderr
    # The test image's own config is not the product's: its PATH lacks the venv.
    proc = check(podman("image", "inspect", test_image).stdout, "debian", tmp_path)
    assert proc.returncode == 1
    assert "Env PATH: image has '/opt/flashnext/bin:" in proc.stderr
    assert "fix containers/Containerfile" in proc.stderr


def test_an_oci_build_loses_the_healthcheck(test_image, tmp_path):
    inspect = build_with_containerfile_config(test_image, ["--format", "oci"], "oci", tmp_path)
    proc = check(inspect, "containerfile", tmp_path)
    assert proc.returncode == 1
    assert "Healthcheck: the image has none" in proc.stderr
    assert "--format docker" in proc.stderr


def test_the_launcher_test_image_itself_is_not_the_product(test_image, tmp_path):
    """The checker reads the test image's real config and names what it lacks."""
    inspect = podman("image", "inspect", test_image).stdout
    proc = check(inspect, "containerfile", tmp_path)
    assert proc.returncode == 1
    assert "Entrypoint is ['flashnext'], the contract says ['flashnext', 'serve']" in proc.stderr
    assert "Env FLASHNEXT_HOST: image has None, the contract says '0.0.0.0'" in proc.stderr
    assert "ExposedPorts is [], the contract says ['8000/tcp']" in proc.stderr


# ---------------------------------------------------------------- the Nix image's config


def nix_image_config() -> dict:
    """nix/image.nix's config, evaluated with the nixpkgs stand-in (checks/nix/summary.nix)."""
    if shutil.which("nix") is None:
        pytest.skip("nix is missing: checks/nix/run installs it (checks/run runs it first)")
    expr = f"(import {REPO / 'checks/nix/summary.nix'} {{ root = {REPO}; }}).image.config"
    settings = ["experimental-features = nix-command flakes", "substituters =",
                "build-users-group =", "connect-timeout = 3"]  # fmt: skip
    proc = subprocess.run(
        ["nix", "eval", "--impure", "--json", "--expr", expr],
        env={**os.environ, "NIX_CONFIG": "\n".join(settings)},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def docker_archive(config: dict, ref: str, dest: Path) -> Path:
    """A Docker archive as dockerTools.streamLayeredImage writes one: manifest.json,
    the image config (with `config` verbatim), one layer."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        data = b"root:x:0:0:root:/root:/noshell\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mtime = len(data), 1
        tar.addfile(info, io.BytesIO(data))
    layer_bytes = layer.getvalue()
    diff_id = hashlib.sha256(layer_bytes).hexdigest()
    image_config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:01Z",
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        "history": [{"created": "1970-01-01T00:00:01Z", "comment": "checks/containers"}],
    }).encode()  # fmt: skip
    config_name = hashlib.sha256(image_config).hexdigest() + ".json"
    manifest = json.dumps(
        [{"Config": config_name, "RepoTags": [ref], "Layers": [f"{diff_id}/layer.tar"]}]
    ).encode()
    with tarfile.open(dest, mode="w") as tar:
        for name, data in (
            (f"{diff_id}/layer.tar", layer_bytes),
            (config_name, image_config),
            ("manifest.json", manifest),
        ):
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1
            tar.addfile(info, io.BytesIO(data))
    return dest


def load_and_inspect(config: dict, tag: str, tmp_path: Path) -> bytes:
    ref = f"localhost/flashnext-nix-config:{tag}"
    archive = docker_archive(config, ref, tmp_path / f"{tag}.tar")
    try:
        podman("load", "--input", str(archive))
        return podman("image", "inspect", ref).stdout
    finally:
        podman("rmi", "--force", ref, check=False)


def test_nix_image_config_as_podman_loads_it_matches_the_contract(tmp_path):
    config = nix_image_config()
    inspect = load_and_inspect(config, "as-built", tmp_path)
    image = json.loads(inspect)[0]
    # podman keeps the Docker healthcheck beside the OCI config, not in it.
    assert image["Healthcheck"]["Test"] == ["CMD", "flashnext-health"]
    assert "Healthcheck" not in image["Config"]
    proc = check(inspect, "nix", tmp_path)
    assert proc.returncode == 0, proc.stderr

    drifted = dict(config, Env=[e for e in config["Env"] if not e.startswith("HOME=")])
    drifted["Healthcheck"] = dict(config["Healthcheck"], Retries=1)
    proc = check(load_and_inspect(drifted, "drifted", tmp_path), "nix", tmp_path)
    assert proc.returncode == 1
    assert "Env HOME: image has None, the contract says '/tmp'" in proc.stderr
    assert "Healthcheck Retries is 1, the contract says 3" in proc.stderr
