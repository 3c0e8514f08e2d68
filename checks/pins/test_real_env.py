"""The real pinned env, built by pins/build-env from the committed lock.

Opt-in (FLASHNEXT_PINS_REAL_ENV=1, set by checks/pins/run): a fresh build
installs ~9 GB. Runs pins/build-env with the interpreter running the tests,
then checks what later suites rely on: the env layout, the patched tree
stamped by patches/apply, the stock tree byte-identical to the wheel, and a
second run being a cache hit in seconds. The Nix env's `smoke` step
(nix/build-vllm-env.py: the stamp for this series, both import smokes) runs
on this env too: the layout is the same.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pinkit import buildenv, lockfile, meta

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.environ.get("FLASHNEXT_PINS_REAL_ENV") != "1",
    reason="set FLASHNEXT_PINS_REAL_ENV=1 (checks/pins/run does) to build the real env",
)


def _build_env() -> tuple[Path, str, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "pins" / "build-env"), "--python", sys.executable],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return Path(proc.stdout.strip().splitlines()[-1]), proc.stderr, time.monotonic() - started


@pytest.fixture(scope="module")
def env_dir() -> Path:
    return _build_env()[0]


def test_layout(env_dir):
    assert (env_dir / "venv" / "bin" / "python").exists()
    assert (env_dir / "stock" / "vllm" / "__init__.py").is_file()
    assert sorted(p.name for p in (env_dir / "stock").iterdir()) == ["vllm"]


def test_patched_tree_is_stamped_and_stock_is_the_wheel(env_dir):
    site = buildenv.site_packages(env_dir / "venv")
    assert (site / "vllm" / "_flashnext_patches.json").is_file()
    assert not (env_dir / "stock" / "vllm" / "_flashnext_patches.json").exists()
    version = meta.load(REPO / "pins").vllm_version
    assert buildenv.record_mismatches(site, env_dir / "stock", version) == []
    assert buildenv.record_mismatches(site, site, version) != []  # the patches changed it


def test_nix_smoke_step_passes_on_the_real_env(env_dir):
    proc = subprocess.run(
        [sys.executable, "nix/build-vllm-env.py", "smoke", str(env_dir)],
        cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_manifest_records_the_inputs(env_dir):
    manifest = json.loads((env_dir / buildenv.MANIFEST).read_text())
    assert manifest["key"] == env_dir.name
    assert manifest["vllm_version"] == "0.33.0"
    lock = REPO / "pins" / manifest["lock"]
    pins = lockfile.parse(lock.read_text())
    assert manifest["inputs"]["pins_sha256"] == lockfile.pins_digest(pins)


def test_second_run_is_a_cache_hit(env_dir):
    again, stderr, seconds = _build_env()
    assert again == env_dir
    assert "cache hit" in stderr
    assert seconds < 30
