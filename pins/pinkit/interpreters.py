"""Find a real CPython X.Y to run pip under.

pip evaluates environment markers (`python_version > "3.11"`) with the
interpreter it runs in, not with `--python-version`; vllm 0.33.0 itself has
such markers (six and setuptools only on 3.12+), so resolving for 3.12 from a
3.11 pip would silently drop them. Each lock is therefore resolved by pip
running under that exact CPython minor version.
"""

import glob
import os
import shutil
import subprocess
from pathlib import Path

_PROBE = "import sys; print(sys.implementation.name, '%d.%d' % sys.version_info[:2])"


class InterpreterError(RuntimeError):
    """No usable interpreter; the message says how to provide one."""


def probe(executable: str) -> str | None:
    """Return `X.Y` if `executable` is a working CPython, else None."""
    try:
        out = subprocess.run(
            [executable, "-c", _PROBE], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2 or parts[0] != "cpython":
        return None
    return parts[1]


def find(version: str, explicit: str | None = None) -> str:
    """Path of a CPython `version` interpreter: `explicit`, then PATH, then pyenv."""
    if explicit:
        found = probe(explicit)
        if found != version:
            raise InterpreterError(
                f"{explicit} is {'CPython ' + found if found else 'not a working CPython'}, "
                f"not CPython {version}; pass --python {version}=PATH to a CPython {version}"
            )
        return explicit
    candidates = []
    on_path = shutil.which(f"python{version}")
    if on_path:
        candidates.append(on_path)
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(
        glob.glob(f"{pyenv_root}/versions/{version}.*/bin/python{version}"), reverse=True
    )
    for candidate in candidates:
        if probe(candidate) == version:
            return candidate
    raise InterpreterError(
        f"no CPython {version} found (looked for python{version} on PATH and under "
        f"{pyenv_root}/versions); install it or pass --python {version}=/path/to/python{version}"
    )


def parse_overrides(values: list[str]) -> dict[str, str]:
    """`["3.12=/usr/bin/python3.12"]` -> {"3.12": "/usr/bin/python3.12"}."""
    overrides = {}
    for value in values:
        version, sep, path = value.partition("=")
        if not sep or not path:
            raise InterpreterError(f"--python expects X.Y=PATH, got {value!r}")
        overrides[version] = path
    return overrides
