"""A small venv per CPython with the pinned pip of pins/resolver-pip.txt.

pins/lock and pins/check run the resolver there instead of the interpreter's
own pip (resolver-pip.txt says why). The venv is cached under
$FLASHNEXT_CACHE/pins-resolver/, keyed by resolver-pip.txt and the
interpreter, built in place (venvs cannot move) and marked `.complete` last;
an unmarked one is rebuilt from scratch.
"""

import fcntl
import hashlib
import shutil
import subprocess
from pathlib import Path

RESOLVER_LOCK = "resolver-pip.txt"


class ToolPipError(RuntimeError):
    """The resolver venv could not be built; the message has pip's error."""


def resolver_python(base_python: str, pins_dir: Path, cache: Path) -> str:
    """Path of a python whose pip is the pinned one, for CPython `base_python`."""
    lock = Path(pins_dir) / RESOLVER_LOCK
    identity = subprocess.run(
        [base_python, "-c", "import sys; print(sys.version)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    key = hashlib.sha256(lock.read_bytes() + identity.encode()).hexdigest()[:16]
    root = Path(cache) / "pins-resolver"
    root.mkdir(parents=True, exist_ok=True)
    venv = root / key
    with open(root / f"{key}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            _run([base_python, "-m", "venv", str(venv)])
            _run(
                [
                    str(venv / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--require-hashes",
                    "--no-deps",
                    "-r",
                    str(lock),
                ]
            )
            (venv / ".complete").touch()
    return str(venv / "bin" / "python")


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ToolPipError(
            f"building the resolver venv failed: {' '.join(argv)}\n{proc.stderr[-2000:]}"
        )
