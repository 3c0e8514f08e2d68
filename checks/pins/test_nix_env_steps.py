"""nix/build-vllm-env.py's `install` and `smoke`, run for real outside Nix.

The Nix env (nix/vllm-env.nix) is built by these two steps; nixpkgs cannot be
had on the CI machines, so here they run on the two-wheel closure of
fakewheels.py (real venv, real pip --require-hashes --no-index, real GNU
patch) with a patches/apply stand-in that stamps the tree as the real one does.
The real env gets the same `smoke` in test_real_env.py.

Importing the model class cannot tell a patched tree from a stock one (stock
vLLM 0.33.0 has qwen4_exp too); `smoke` checks patches/apply's stamp, so an
`install` that skips the series fails the build.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fakewheels import make_closure, write_patches, write_pins

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "nix" / "build-vllm-env.py"
PY_MINOR = "{}.{}".format(*sys.version_info[:2])

# The stand-in for patches/apply: GNU patch per series entry, then the stamp
# (vllm/_flashnext_patches.json) in the real script's format. Run by the test's
# own interpreter (a Nix build sandbox has no /usr/bin/env).
STAMPING_APPLY = f"""#!{sys.executable}
import hashlib, json, subprocess, sys
from pathlib import Path

site = Path(sys.argv[1])
series_dir = Path(__file__).resolve().parent / "vllm-0.33.0"
series = series_dir / "series"
names = [ln.split("#", 1)[0].strip() for ln in series.read_text().splitlines()]
names = [n for n in names if n]
def sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()
for name in names:
    subprocess.run(["patch", "-p1", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                    "-d", str(site), "-i", str(series_dir / name)], check=True,
                   stdout=sys.stderr)
stamp = {{"schema_version": 1, "vllm_version": "0.33.0", "series_sha256": sha(series),
         "patches": [{{"name": n, "sha256": sha(series_dir / n), "files": []}} for n in names]}}
(site / "vllm" / "_flashnext_patches.json").write_text(json.dumps(stamp))
"""

PATCHED_Q = "import vllm.models.qwen4_exp as m; print(m.Qwen4ExpForCausalLM.patched)"


@pytest.fixture
def root(tmp_path) -> Path:
    """A source root as the derivation sees it: pins/ (the real pinkit, a test lock),
    patches/, nix/build-vllm-env.py."""
    src = tmp_path / "src"
    wheels = make_closure(tmp_path / "wheelhouse")
    write_pins(src / "pins", wheels, PY_MINOR)
    shutil.copytree(
        REPO / "pins" / "pinkit", src / "pins" / "pinkit",
        ignore=shutil.ignore_patterns("__pycache__"),
    )  # fmt: skip
    write_patches(src / "patches", STAMPING_APPLY)
    (src / "nix").mkdir()
    shutil.copy(SCRIPT, src / "nix" / "build-vllm-env.py")
    return src


def step(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "nix/build-vllm-env.py", *args],
        cwd=root, capture_output=True, text=True, check=False,
    )  # fmt: skip


def install(root: Path) -> Path:
    out = root.parent / "out"
    proc = step(root, "install", str(out), str(root.parent / "wheelhouse"))
    assert proc.returncode == 0, proc.stderr
    return out


def env_says(out: Path, pythonpath: Path | None = None) -> str:
    env = {"PATH": "/usr/bin:/bin", **({"PYTHONPATH": str(pythonpath)} if pythonpath else {})}
    proc = subprocess.run(
        [str(out / "venv" / "bin" / "python"), "-c", PATCHED_Q],
        env=env, cwd="/", capture_output=True, text=True, check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def test_install_then_smoke_builds_the_patched_layout(root):
    out = install(root)
    assert env_says(out) == "True"
    assert env_says(out, out / "stock") == "False"
    proc = step(root, "smoke", str(out))
    assert proc.returncode == 0, proc.stderr


def test_smoke_fails_when_install_skipped_the_series(root):
    """The mutation the issue names: apply_patches deleted from install()."""
    script = root / "nix" / "build-vllm-env.py"
    text = script.read_text()
    call = "    buildenv.apply_patches(lay, site)\n"
    assert text.count(call) == 1
    script.write_text(text.replace(call, ""))
    out = install(root)
    assert env_says(out) == "False"  # the env imports fine: only the stamp tells
    proc = step(root, "smoke", str(out))
    assert proc.returncode == 1
    assert "_flashnext_patches.json is missing: the patch series was not applied" in proc.stderr


def test_smoke_fails_on_a_tree_patched_with_another_series(root):
    out = install(root)
    patch = root / "patches" / "vllm-0.33.0" / "0001-mark-patched.patch"
    patch.write_text(patch.read_text().replace("patched = True", "patched = 2"))
    proc = step(root, "smoke", str(out))
    assert proc.returncode == 1
    assert "the tree was patched with another series" in proc.stderr


def test_smoke_fails_when_the_stock_tree_is_stamped(root):
    out = install(root)
    site = next((out / "venv" / "lib").glob("python3.*/site-packages"))
    shutil.copy(site / "vllm" / "_flashnext_patches.json", out / "stock" / "vllm")
    proc = step(root, "smoke", str(out))
    assert proc.returncode == 1 and "the stock tree was patched" in proc.stderr
