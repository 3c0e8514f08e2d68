"""The documented run line, the Quadlet unit and the Containerfile agree, and say what they must.

The run line is read from containers/README.md (between the run-line markers),
so the text users copy is the text tested.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import runline
from podman_cli import podman

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "containers"
README = CONTAINERS / "README.md"


def readme_block(marker: str, lang: str) -> str:
    text = README.read_text()
    match = re.search(
        rf"<!-- {marker}:begin -->\s*```{lang}\n(.*?)```\s*<!-- {marker}:end -->", text, re.S
    )
    assert match, f"containers/README.md lost its {marker} block"
    return match.group(1)


def run_line() -> list[str]:
    return shlex.split(readme_block("run-line", "sh").replace("\\\n", " "))


def quadlet() -> dict[str, list[str]]:
    """Section.Key -> values (Quadlet keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in (CONTAINERS / "flashnext.container").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def contract() -> dict:
    return json.loads(readme_block("image-contract", "json"))


def run_line_parts() -> tuple[Counter, str, list[str]]:
    argv = run_line()
    assert argv[:2] == ["podman", "run"], argv[:2]
    return runline.parse(argv[2:])


def test_run_line_has_the_required_flags():
    flags, image, _ = run_line_parts()
    assert ("--device", "nvidia.com/gpu=all") in flags
    assert ("--ulimit", "memlock=-1:-1") in flags
    assert ("--ipc", "host") in flags or any(name == "--shm-size" for name, _ in flags)
    assert ("--health-cmd", "flashnext-health") in flags
    assert ("--publish", "127.0.0.1:8000:8000") in flags, "publish on the host's loopback only"
    forbidden = {"--privileged", "--cap-add", "--security-opt", "--pid", "--network"}
    assert not {name for name, _ in flags} & forbidden
    volumes = [value for name, value in flags if name == "--volume"]
    ro = [v.split(":")[1] for v in volumes if v.endswith(":ro")]
    assert {"/models/qwen3.8-flash-next", "/table"} <= set(ro), volumes
    assert image.startswith("localhost/flashnext:")


def test_quadlet_unit_matches_the_run_line():
    """A fast textual comparison; test_quadlet.py runs podman's real generator."""
    flags, image, args = run_line_parts()
    unit = quadlet()
    assert unit["Container.Image"] == [image]
    assert unit["Container.AddDevice"] == ["nvidia.com/gpu=all"]
    assert unit["Container.Ulimit"] == ["memlock=-1:-1"]
    assert unit["Container.PodmanArgs"] == ["--ipc=host"]
    assert unit["Container.PublishPort"] == ["127.0.0.1:8000:8000"]
    assert unit["Container.HealthCmd"] == ["flashnext-health"]
    volumes = sorted(value for name, value in flags if name == "--volume")
    assert sorted(unit["Container.Volume"]) == volumes
    assert shlex.split(unit["Container.Exec"][0]) == args
    assert not any("privileged" in k.lower() or "AddCapability" in k for k in unit)


def containerfile_instructions(name: str = "Containerfile") -> list[tuple[str, str]]:
    text = (CONTAINERS / name).read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


CONTAINERFILES = {
    # name: (its FROM, the ENV lines it must have in order)
    "Containerfile": ("${BASE}", "debian_image_env"),
    "vllm-openai.Containerfile": (
        "docker.io/vllm/vllm-openai:v0.33.0@${VLLM_OPENAI_DIGEST}",
        "env",
    ),
}


@pytest.mark.parametrize("name", sorted(CONTAINERFILES))
def test_containerfile_follows_the_contract(name):
    want_from, env_key = CONTAINERFILES[name]
    instr = containerfile_instructions(name)
    entrypoints = [json.loads(rest) for word, rest in instr if word == "ENTRYPOINT"]
    assert entrypoints == [contract()["entrypoint"]]
    exposed = sorted(f"{rest}/tcp" for word, rest in instr if word == "EXPOSE")
    assert exposed == sorted(contract()["exposed_ports"])
    froms = [rest for word, rest in instr if word == "FROM"]
    assert froms == [want_from]
    runs = " ".join(rest for word, rest in instr if word == "RUN")
    assert "/opt/flashnext/patches/apply" in runs, "the image must apply the same series"
    envs = [rest for word, rest in instr if word == "ENV"]
    assert envs == [f"{name}={value}" for name, value in contract()[env_key].items()]
    health = [rest for word, rest in instr if word == "HEALTHCHECK"]
    assert len(health) == 1 and '["flashnext-health"]' in health[0]
    # What podman makes of these instructions: test_image_config.py.


def test_run_line_and_unit_health_settings_are_the_contracts():
    want = contract()["healthcheck"]
    assert want["test"] == ["CMD", "flashnext-health"]
    flags, _, _ = run_line_parts()
    health = {name: value for name, value in flags if name.startswith("--health-")}
    assert health == {
        "--health-cmd": "flashnext-health",
        "--health-interval": want["interval"],
        "--health-timeout": want["timeout"],
        "--health-retries": str(want["retries"]),
        "--health-start-period": want["start_period"],
    }
    unit = quadlet()
    assert unit["Container.HealthInterval"] == [want["interval"]]
    assert unit["Container.HealthTimeout"] == [want["timeout"]]
    assert unit["Container.HealthRetries"] == [str(want["retries"])]
    assert unit["Container.HealthStartPeriod"] == [want["start_period"]]


def test_direct_build_with_the_placeholder_fails_at_from(tmp_path):
    """No network needed: the placeholder is not a valid reference, so nothing is pulled."""
    proc = podman(
        "build", "--isolation", "chroot", "-f", str(CONTAINERS / "vllm-openai.Containerfile"),
        str(REPO), check=False, timeout=120,
    )  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode != 0
    assert "invalid reference format" in err and "PLACEHOLDER" in proc.stdout.decode() + err


def test_direct_build_of_the_debian_image_without_its_base_pulls_nothing(tmp_path):
    """BASE has no default: a bare `podman build` stops at FROM instead of asking a registry."""
    proc = podman(
        "build", "--isolation", "chroot", "-f", str(CONTAINERS / "Containerfile"), str(REPO),
        check=False, timeout=120,
    )  # fmt: skip
    out = proc.stdout.decode() + proc.stderr.decode()
    assert proc.returncode != 0
    assert "STEP 2/" not in out and "Trying to pull" not in out, out


def test_build_script_refuses_the_placeholder_digest():
    proc = subprocess.run(
        [CONTAINERS / "build", "--dry-run", "--from", "vllm-openai"], capture_output=True, text=True
    )
    digest = (CONTAINERS / "vllm-openai.digest").read_text()
    if re.search(r"^sha256:[0-9a-f]{64}$", digest, re.M):
        pytest.skip("a real digest is filled in; the refusal path is covered by the copy test")
    assert proc.returncode == 1
    assert "holds no digest" in proc.stderr and "skopeo inspect" in proc.stderr
    assert "Or build without any registry: containers/build" in proc.stderr


def test_build_script_passes_a_filled_in_digest(tmp_path):
    copy = tmp_path / "repo"
    (copy / "launcher").mkdir(parents=True)
    shutil.copy(REPO / "launcher" / "pyproject.toml", copy / "launcher")
    shutil.copytree(CONTAINERS, copy / "containers")
    digest = "sha256:" + "ab" * 32
    (copy / "containers" / "vllm-openai.digest").write_text(f"# test\n{digest}\n")
    proc = subprocess.run(
        [copy / "containers" / "build", "--dry-run", "--from", "vllm-openai"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    argv = shlex.split(proc.stdout)
    assert argv[:2] == ["podman", "build"]
    # An OCI-format image has no healthcheck (test_image_config.py shows podman drop it).
    assert argv[2:4] == ["--format", "docker"]
    assert f"VLLM_OPENAI_DIGEST={digest}" in argv
    assert argv[argv.index("-f") + 1] == str(copy / "containers" / "vllm-openai.Containerfile")
    assert argv[-1] == str(copy)
