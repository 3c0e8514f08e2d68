"""Clone an installed venv into a new venv with hard links (seconds, ~no disk).

The pinned closure is ~9.4 GB installed; every change to the patch series
would otherwise reinstall it. A clone is a fresh `python -m venv` (its own
pyvenv.cfg, activate scripts and interpreter links) whose site-packages and
other trees are hard links of the base's files, and whose console scripts are
rewritten to point at the clone's python. Hard links are safe because nothing
here writes through them: patches/apply and GNU patch replace files by
rename, Python writes .pyc files by rename, pip unlinks before it writes.
The builder still checks the pristine tree against the wheel's RECORD after
patching, and drops a base whose files were changed in place.
"""

import os
import shutil
import subprocess
from pathlib import Path


def clone(python: str, base: Path, dest: Path) -> None:
    """Make `dest` a venv of `python` with the same installed files as `base`."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(dest)], check=True)
    base_python = str(base / "bin" / "python")
    for entry in sorted(base.iterdir()):
        if entry.name == "bin":
            _clone_bin(entry, dest / "bin", base_python, str(dest / "bin" / "python"))
        elif entry.name in ("lib", "include", "share") and entry.is_dir():
            shutil.copytree(
                entry, dest / entry.name, copy_function=os.link, symlinks=True, dirs_exist_ok=True
            )


def _clone_bin(src: Path, dest: Path, old_python: str, new_python: str) -> None:
    """Copy console scripts with their interpreter path re-pointed; keep the venv's own files."""
    old, new = old_python.encode(), new_python.encode()
    for entry in sorted(src.iterdir()):
        target = dest / entry.name
        if target.exists() or target.is_symlink():
            continue  # python, activate*: the new venv made its own
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
            continue
        if entry.is_dir():  # e.g. bin/__pycache__ from scripts shipped as .py
            shutil.copytree(entry, target, copy_function=os.link, symlinks=True)
            continue
        data = entry.read_bytes()
        # pip writes `#!<venv>/bin/python`, or for long paths a /bin/sh
        # preamble that execs it: either way the path is in the first lines.
        head = data[:1024]
        if old in head:
            target.write_bytes(head.replace(old, new) + data[1024:])
            shutil.copymode(entry, target)
        else:
            os.link(entry, target)
