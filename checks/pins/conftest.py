"""Shared setup for the pins suite: import pins/pinkit, locate the repo."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PINS_DIR = REPO / "pins"
sys.path.insert(0, str(PINS_DIR))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def pins_dir() -> Path:
    return PINS_DIR
