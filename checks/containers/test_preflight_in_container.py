"""`flashnext preflight --json` inside a real podman container sees the container's limits.

Each test starts the test image (Debian minbase + the launcher) with different
`podman run` flags and checks the facts the launcher probed inside against
the flags, and the findings against what the run line is missing. The tiny
checkpoint skeleton is bind-mounted read-only, as the documented run line
mounts the real one, so preflight has a plan to judge the limits against.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from podman_cli import run

MODEL_IN_CONTAINER = "/models/tiny"
GIB = 1 << 30


def preflight(image: str, model, *flags: str) -> dict:
    proc = run(
        image,
        "preflight", "--json", "--model", MODEL_IN_CONTAINER,
        flags=("-v", f"{model}:{MODEL_IN_CONTAINER}:ro", *flags),
    )  # fmt: skip
    # 1 = some check failed (no GPU here, no table): expected. Anything else is a crash.
    assert proc.returncode in (0, 1), proc.stderr.decode()
    return json.loads(proc.stdout)


def finding(doc: dict, finding_id: str) -> dict:
    matches = [f for f in doc["findings"] if f["id"] == finding_id]
    assert len(matches) == 1, (
        f"{finding_id} not reported once: {[f['id'] for f in doc['findings']]}"
    )
    return matches[0]


def limits_in_container(image: str, *flags: str) -> str:
    """/proc/self/limits as a process in the same kind of container sees it."""
    proc = run(image, "/proc/self/limits", flags=("--entrypoint", "cat", *flags), check=True)
    return proc.stdout.decode()


def memlock_from_limits(text: str) -> tuple[int | None, int | None]:
    match = re.search(r"^Max locked memory\s+(\S+)\s+(\S+)\s+bytes", text, re.M)
    assert match, text

    def value(s: str) -> int | None:
        return None if s == "unlimited" else int(s)

    return value(match.group(1)), value(match.group(2))


@pytest.fixture(scope="module")
def constrained(test_image, tiny_model) -> dict:
    """A run line missing what the plan needs: small memlock, a 4 GiB cgroup, 64 MiB shm."""
    return preflight(
        test_image, tiny_model,
        "--ulimit", "memlock=65536:65536", "--memory", "4g", "--shm-size", "64m",
    )  # fmt: skip


@pytest.fixture(scope="module")
def defaults(test_image, tiny_model) -> dict:
    """No memlock, memory or IPC flags: podman's defaults."""
    return preflight(test_image, tiny_model)


def test_preflight_knows_it_is_in_a_container(constrained):
    assert constrained["facts"]["in_container"] is True


def test_memlock_flag_is_what_preflight_measures(constrained):
    memory = constrained["facts"]["memory"]
    assert (memory["memlock_soft_bytes"], memory["memlock_hard_bytes"]) == (65536, 65536)


def test_small_memlock_fails_with_the_run_flag_as_fix(constrained):
    pinned = constrained["plan"]["pinned_bytes_needed"]
    assert pinned > 65536, "the plan pins nothing: this test would prove nothing"
    f = finding(constrained, "host.memlock")
    assert f["level"] == "fail"
    assert "--ulimit memlock=-1:-1" in f["fix"]


def test_default_memlock_is_the_runtime_default(test_image, defaults):
    """Without the flag, preflight reports exactly what the kernel enforces in the container."""
    soft, hard = memlock_from_limits(limits_in_container(test_image))
    memory = defaults["facts"]["memory"]
    assert (memory["memlock_soft_bytes"], memory["memlock_hard_bytes"]) == (soft, hard)
    pinned = defaults["plan"]["pinned_bytes_needed"]
    expected = "fail" if soft is not None and soft < pinned else "ok"
    assert finding(defaults, "host.memlock")["level"] == expected


def test_memory_flag_is_the_cgroup_limit(constrained):
    assert constrained["facts"]["memory"]["cgroup_memory_limit_bytes"] == 4 * GIB
    f = finding(constrained, "host.cgroup")
    assert f["level"] == "fail"
    assert "--memory" in f["fix"]


def test_no_memory_flag_means_no_cgroup_limit(defaults):
    assert defaults["facts"]["memory"]["cgroup_memory_limit_bytes"] is None
    assert finding(defaults, "host.cgroup")["level"] == "ok"


def test_small_shm_fails_with_ipc_host_as_fix(constrained):
    assert constrained["facts"]["memory"]["shm_total_bytes"] == 64 << 20
    f = finding(constrained, "host.shm")
    assert f["level"] == "fail"
    assert "--ipc=host" in f["fix"]


def test_ipc_host_gives_the_hosts_shm(test_image, tiny_model):
    doc = preflight(test_image, tiny_model, "--ipc=host")
    host = os.statvfs("/dev/shm")
    assert doc["facts"]["memory"]["shm_total_bytes"] == host.f_frsize * host.f_blocks
    assert finding(doc, "host.shm")["level"] == (
        "ok" if host.f_frsize * host.f_blocks >= GIB else "fail"
    )


def test_missing_gpus_name_the_cdi_flag(constrained):
    """No --device here (and no GPU on CI): preflight must say which flag gives GPUs."""
    f = finding(constrained, "gpu.nvml")
    assert f["level"] == "fail"
    assert "--device nvidia.com/gpu=all" in f["fix"]
