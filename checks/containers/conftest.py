"""Fixtures for the container tests: the test image (built once) and a tiny checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def test_image() -> str:
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: run checks/containers/run (it installs podman)")
    from testimage import build_test_image

    return build_test_image()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny checkpoint skeleton (real headers, sparse data), so preflight can plan."""
    from flashnext.skeleton import write_skeleton

    out = tmp_path_factory.mktemp("model") / "tiny"
    write_skeleton(out, "tiny")
    out.parent.chmod(0o755)  # readable by the container's root under any userns
    return out
