"""Which vLLM `serve` would start, and what it is: version and patch stamp.

The env is chosen in this order (the first that applies):

1. `--vllm-env DIR` / `FLASHNEXT_VLLM_ENV`: `DIR/venv/bin/vllm`, run by
   `DIR/venv/bin/python` (pins/build-env's layout; DIR may also be a venv itself);
2. `vllm` on PATH (the Nix app, the image, the GPU host's kit): run by the
   interpreter its script names, asked with this process's environment, so a
   tree installed on PYTHONPATH is seen as vLLM will see it;
3. the checkout's pinned env when pins/build-env has built it already (looked
   up with pins/build-env's own key, never built here);
4. none.

The chosen Python is asked once, in a child process: `import vllm`, its
`__version__`, where the package lives and its `_flashnext_patches.json`. The
launcher itself never imports vLLM. `probe_vllm_env` never raises: what cannot
be found or asked is recorded in the facts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from flashnext.checkout import Checkout
from flashnext.facts.schema import VllmEnvFacts

STAMP_NAME = "_flashnext_patches.json"
"""Written into the vllm package by patches/apply: which patches that tree carries."""

IMPORT_TIMEOUT_S = 300.0
"""`import vllm` imports torch: seconds on an idle host, minutes on a loaded one."""

_MARK = "FLASHNEXT-VLLM-PROBE "
_PROBE = r"""
import json, os, sys
mark = sys.argv[1]
def say(doc):
    sys.stdout.write("\n" + mark + json.dumps(doc) + "\n")
try:
    import vllm
except BaseException as exc:
    say({"error": "`import vllm` failed: %s: %s" % (type(exc).__name__, exc)})
    sys.exit(0)
pkg = os.path.dirname(os.path.realpath(vllm.__file__))
doc = {"package_dir": pkg, "version": getattr(vllm, "__version__", None), "stamp": None}
try:
    with open(os.path.join(pkg, sys.argv[2])) as fh:
        doc["stamp"] = json.load(fh)
except FileNotFoundError:
    pass
except (OSError, ValueError) as exc:
    doc["stamp_error"] = str(exc)
if doc["stamp"] is not None and not isinstance(doc["stamp"], dict):
    doc["stamp_error"], doc["stamp"] = "not a JSON object", None
say(doc)
"""

# pins/build-env's key, computed with its own code (pins/pinkit), read-only: the
# env it would print if it is published, else nothing. Run by the `python3` that
# pins/build-env's `#!/usr/bin/env python3` runs, which is part of the key.
_FIND_BUILT = r"""
import os, sys
from pathlib import Path
pins = Path(sys.argv[1])
sys.path.insert(0, str(pins))
from pinkit import buildenv, envkey, lockfile
cache = Path(os.environ.get("FLASHNEXT_CACHE") or Path.home() / ".cache" / "flashnext")
layout = buildenv.Layout(pins, pins.parent / "patches", cache)
minor, identity = buildenv.interpreter_identity(sys.executable)
pins_list = buildenv.load_lock(layout, minor)[3]
key, _ = envkey.env_key(
    lockfile.pins_digest(pins_list), envkey.patch_inputs(layout.patches_dir), identity
)
hit = buildenv.published(layout.env_root, key)
print(hit if hit is not None else "")
"""


def env_layout(env_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(python, vllm executable) of an env dir: pins/build-env's ENV/venv/, or a venv."""
    root = Path(env_dir)
    venv = root / "venv" if (root / "venv" / "bin").is_dir() else root
    return venv / "bin" / "python", venv / "bin" / "vllm"


def script_python(executable: str, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the Python that runs the script `executable`, or None; what its first line says).

    Handles `#!/path/python`, `#!/usr/bin/env python3` (looked up on PATH, as the
    kernel's exec would) and pip's `#!/bin/sh` launcher for long paths. Anything
    else (a binary, a shell wrapper) falls back to a `python3`/`python` beside it.
    """
    try:
        with open(executable, "rb") as fh:
            head = fh.read(2048).decode("utf-8", "replace")
    except OSError as exc:
        return None, f"cannot read {executable}: {exc.strerror or exc}"
    first = head.splitlines()[0] if head else ""
    found = None
    if first.startswith("#!"):
        words = first[2:].split()
        if words and os.path.basename(words[0]) == "env":
            names = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            if names:
                found = shutil.which(names[0], path=environ.get("PATH", os.defpath))
        elif words and os.path.basename(words[0]) in ("sh", "bash", "dash"):
            m = re.search(r"""^'''exec' "?([^"\n]+?)"? "\$0" "\$@"$""", head, re.M)
            found = m.group(1) if m else None
        elif words:
            found = words[0]
    if found and os.path.basename(found).startswith("python"):
        return found, first
    for name in ("python3", "python"):
        sibling = Path(executable).parent / name
        if sibling.exists():
            return str(sibling), first
    return None, first


def _ask(python: str, environ: Mapping[str, str]) -> dict:
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE, _MARK, STAMP_NAME],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"`import vllm` did not finish within {IMPORT_TIMEOUT_S:g} s"}
    except OSError as exc:
        return {"error": f"cannot run {python}: {exc.strerror or exc}"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)]
    if not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"{python} exited {proc.returncode}: {tail[0][:300]}"}
    return json.loads(lines[-1][len(_MARK) :])


def find_built_env(checkout: Checkout, environ: Mapping[str, str]) -> str | None:
    """The env `pins/build-env` would print if it is built already; None otherwise."""
    python3 = shutil.which("python3", path=environ.get("PATH", os.defpath))
    if python3 is None:
        return None
    try:
        proc = subprocess.run(
            [python3, "-c", _FIND_BUILT, str(checkout.root / "pins")],
            env=dict(environ),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
    return found[0] if found and found[0] else None


def probe_vllm_env(
    env_dir: str | None,
    selected_by: str,
    environ: Mapping[str, str],
    checkout: Checkout | None,
) -> VllmEnvFacts:
    """Locate the vLLM serve would run (see the module doc) and ask its Python.

    `env_dir`/`selected_by`: the --vllm-env value and where it came from
    ("--vllm-env" or "FLASHNEXT_VLLM_ENV"); None when not given.
    """
    if env_dir:
        python, executable = env_layout(env_dir)
        return _probe(selected_by, str(env_dir), str(executable), str(python), environ)
    on_path = shutil.which("vllm", path=environ.get("PATH", os.defpath))
    if on_path:
        python, first = script_python(on_path, environ)
        if python is None:
            return VllmEnvFacts(
                selected_by="PATH",
                executable=on_path,
                error=f"cannot tell which Python runs {on_path} (its first line: {first!r})",
            )
        return _probe("PATH", None, on_path, python, environ)
    built = find_built_env(checkout, environ) if checkout and checkout.build_env else None
    if built:
        python, executable = env_layout(built)
        return _probe("pins/build-env", built, str(executable), str(python), environ)
    return VllmEnvFacts(selected_by="none")


def stamp_problem(stamp: object) -> str | None:
    """Why a patch stamp (_flashnext_patches.json) is not what patches/apply writes: an
    object whose `patches` is a list of {name, sha256} strings; None when it is."""
    if not isinstance(stamp, dict):
        return "not a JSON object"
    patches = stamp.get("patches")
    if not isinstance(patches, list):
        return f"`patches` is {type(patches).__name__}, not a list"
    for i, p in enumerate(patches):
        if not isinstance(p, dict) or not all(
            isinstance(p.get(k), str) for k in ("name", "sha256")
        ):
            return f"`patches[{i}]` is {p!r:.60}, not an object with name and sha256 strings"
    return None


def _probe(
    selected_by: str, env_dir: str | None, executable: str, python: str, environ
) -> VllmEnvFacts:
    if env_dir is not None and not Path(env_dir).is_dir():
        return VllmEnvFacts(selected_by=selected_by, env_dir=env_dir, error="no such directory")
    for what, path in (("python", python), ("vllm", executable)):
        if not os.access(path, os.X_OK):
            return VllmEnvFacts(
                selected_by=selected_by,
                env_dir=env_dir,
                executable=executable,
                python=python,
                error=f"no executable {what} at {path}",
            )
    doc = _ask(python, environ)
    stamp, stamp_error = doc.get("stamp"), doc.get("stamp_error")
    if stamp is not None and not stamp_error:
        stamp_error = stamp_problem(stamp)
        stamp = None if stamp_error else stamp
    return VllmEnvFacts(
        selected_by=selected_by,
        env_dir=env_dir,
        executable=executable,
        python=python,
        package_dir=doc.get("package_dir"),
        version=doc.get("version"),
        stamp=stamp,
        stamp_error=stamp_error,
        error=doc.get("error"),
    )
