"""Stand-in vLLM envs for preflight's `vllm.env` check and for serve.

An env here has pins/build-env's layout (ENV/venv/bin/python, ENV/venv/bin/vllm)
without 9 GB: `python` is this interpreter with ENV/site first on PYTHONPATH,
where a `vllm` package of two files says its version and carries (or not) the
patch stamp patches/apply writes; `vllm` runs the stand-in server
(checks/fixtures/standin_vllm/vllm) with that Python.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from flashnext.checkout import find_checkout, series_patches

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm" / "vllm"
STAMP_NAME = "_flashnext_patches.json"

REAL_VLLM_ENV = os.environ.get("FLASHNEXT_VLLM_ENV") or None
"""The pinned env checks/run exports, read before the tests replace the variable."""


def checkout_stamp() -> dict:
    """The stamp patches/apply writes for this checkout's series (fields it reads)."""
    checkout = find_checkout()
    return {
        "schema_version": 1,
        "vllm_version": "0.33.0",
        "patches": [
            {"name": n, "sha256": h, "files": []} for n, h in series_patches(checkout.series_dir)
        ],
    }


def write_vllm_tree(site: Path, version: str = "0.33.0", stamp: dict | None = None) -> Path:
    """SITE/vllm: `__version__` and, unless `stamp` is None, the patch stamp."""
    pkg = site / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if stamp is not None:
        (pkg / STAMP_NAME).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
    return pkg


def make_vllm_env(root: Path, version: str = "0.33.0", stamp: dict | None = None) -> Path:
    """ENV at `root` (see the module doc); `stamp` None makes it a stock tree."""
    site = root / "site"
    write_vllm_tree(site, version, stamp)
    bindir = root / "venv" / "bin"
    bindir.mkdir(parents=True)
    python = bindir / "python"
    python.write_text(
        "#!/bin/sh\n"
        f'PYTHONPATH={shlex.quote(str(site))}"${{PYTHONPATH:+:$PYTHONPATH}}" '
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    vllm = bindir / "vllm"
    vllm.write_text(
        f'#!/bin/sh\nexec {shlex.quote(str(python))} {shlex.quote(str(STANDIN))} "$@"\n'
    )
    for path in (python, vllm):
        path.chmod(0o755)
    return root
