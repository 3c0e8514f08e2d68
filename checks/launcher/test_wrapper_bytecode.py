"""Issue 25, class 13: ./flashnext keeps its bytecode cache in its venv even where
PYTHONDONTWRITEBYTECODE=1 is set (many container images set it), so a call does not
compile the checkout's modules afresh; what the launcher runs gets the variable back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "checks" / "lib.sh"


def fake_venv(cache: Path) -> Path:
    """The venv ./flashnext would use, as a complete one whose python is this test's
    (which imports this checkout's launcher): nothing is built."""
    env = {**os.environ, "FLASHNEXT_CACHE": str(cache)}
    key = subprocess.run(["bash", "-c", f'source "{LIB}" && launcher_venv_key "$1"', "_",
                          str(REPO)], capture_output=True, text=True, check=True,
                         env=env).stdout.strip()  # fmt: skip
    venv = cache / "launcher" / key
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".complete").touch()
    return venv


def test_bytecode_is_cached_in_the_venv_despite_dontwritebytecode(tmp_path):
    cache = tmp_path / "cache"
    venv = fake_venv(cache)
    env = {**os.environ, "FLASHNEXT_CACHE": str(cache), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    probe = "import os; print(os.environ.get('PYTHONDONTWRITEBYTECODE'))"
    result = subprocess.run([str(REPO / "flashnext"), "--version"], env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    cached = {p.name.split(".")[0] for p in (venv / "pycache").rglob("flashnext/cli/*.pyc")}
    assert {"__init__", "root", "serving"} <= cached, sorted(cached)
    # what the launcher runs sees the caller's value again (the launcher's own env)
    import_env = {**env, "FLASHNEXT_KEPT_PYTHONDONTWRITEBYTECODE": "1"}
    import_env.pop("PYTHONDONTWRITEBYTECODE")
    handed = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.argv = ["
                             "'flashnext', '--version']\ntry:\n    runpy.run_module("
                             "'flashnext', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                             + probe], env=import_env, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert handed.stdout.splitlines()[-1] == "1", handed.stdout + handed.stderr
