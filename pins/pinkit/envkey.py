"""The cache key of a built env: everything that changes what ends up in it.

An env is the lock installed into a venv of one interpreter, then patched by
patches/apply with the series. So the key covers the lock's pins (requirements
and hashes; comments do not count), every file
under patches/ that can affect patching (the series, each patch, apply and its
helpers; prose *.md files excluded), the interpreter, and BUILDER_VERSION for
changes to the build steps themselves.
"""

import hashlib
import json
from pathlib import Path

BUILDER_VERSION = 2
"""Bump when build-env's steps change what a built env contains."""

_IGNORED_SUFFIXES = (".md", ".pyc")
_IGNORED_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}


def patch_inputs(patches_dir: Path) -> dict[str, str]:
    """sha256 of every file under patches/ that can change the patched tree."""
    patches_dir = Path(patches_dir)
    inputs = {}
    for path in sorted(patches_dir.rglob("*")):
        rel = path.relative_to(patches_dir)
        if not path.is_file() or _IGNORED_DIRS.intersection(rel.parts):
            continue
        if path.name.endswith(_IGNORED_SUFFIXES):
            continue
        inputs[rel.as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return inputs


def base_key(pins_digest: str, interpreter: str) -> tuple[str, dict]:
    """(key, inputs) of the unpatched install of a lock: the expensive part.

    `pins_digest` is lockfile.pins_digest() of the lock: what pip installs.
    """
    inputs = {
        "builder_version": BUILDER_VERSION,
        "pins_sha256": pins_digest,
        "interpreter": interpreter,
    }
    return _digest(inputs), inputs


def env_key(pins_digest: str, patches: dict[str, str], interpreter: str) -> tuple[str, dict]:
    """(key, inputs) of a patched env: its base plus the patch inputs."""
    base, base_inputs = base_key(pins_digest, interpreter)
    inputs = {**base_inputs, "base": base, "patches": patches}
    return _digest(inputs), inputs


def _digest(inputs: dict) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()[:32]
