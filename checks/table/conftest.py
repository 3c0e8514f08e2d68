"""Fixtures for the table suite; the checkpoint writer lives in ple_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from ple_checkpoint import Checkpoint, make_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Checkpoint:
    return make_checkpoint(tmp_path / "model")
