"""pins/build-env end to end on a two-wheel closure (the real one is ~4 GB).

Runs the real script as a subprocess: real venv, real pip with
--require-hashes and --no-index, real GNU patch, real import smoke.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakewheels import make_closure, write_patches, write_pins
from pinkit import buildenv

REPO = Path(__file__).resolve().parents[2]
BUILD_ENV = REPO / "pins" / "build-env"
PY_MINOR = "{}.{}".format(*sys.version_info[:2])


@pytest.fixture
def setup(tmp_path):
    seed = tmp_path / "seed"
    wheels = make_closure(seed)
    pins = tmp_path / "pins"
    write_pins(pins, wheels, PY_MINOR)
    patches = write_patches(tmp_path / "patches")
    return {
        "tmp": tmp_path,
        "seed": seed,
        "pins": pins,
        "patches": patches,
        "cache": tmp_path / "cache",
    }


def run_build(setup, *extra, patches=None):
    argv = [
        sys.executable,
        str(BUILD_ENV),
        "--python",
        sys.executable,
        "--cache",
        str(setup["cache"]),
        "--seed",
        str(setup["seed"]),
        "--pins-dir",
        str(setup["pins"]),
        "--patches-dir",
        str(patches or setup["patches"]),
        "--min-free-bytes",
        "0",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "FLASHNEXT_WHEEL_SEED"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)


def env_python_says(env_dir: Path, code: str, pythonpath: Path | None = None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run(
        [str(env_dir / "venv" / "bin" / "python"), "-c", code],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        cwd="/",
    )
    return out.stdout.strip()


PATCHED_Q = "import vllm.models.qwen4_exp as m; print(m.Qwen4ExpForCausalLM.patched)"


def test_builds_patched_env_with_pristine_stock_and_reuses_it(setup):
    first = run_build(setup)
    assert first.returncode == 0, first.stderr
    env_dir = Path(first.stdout.strip().splitlines()[-1])
    assert env_dir == setup["cache"] / "env" / env_dir.name
    assert env_python_says(env_dir, PATCHED_Q) == "True"
    assert env_python_says(env_dir, PATCHED_Q, env_dir / "stock") == "False"
    manifest = json.loads((env_dir / buildenv.MANIFEST).read_text())
    assert manifest["key"] == env_dir.name and manifest["vllm_version"] == "0.33.0"
    assert "build-env: cache hit" not in first.stderr

    started = time.monotonic()
    second = run_build(setup)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip().splitlines()[-1] == str(env_dir)
    assert "build-env: cache hit" in second.stderr
    assert time.monotonic() - started < 10


def test_changing_a_patch_builds_a_new_env(setup):
    first = Path(run_build(setup).stdout.strip().splitlines()[-1])
    patch = setup["patches"] / "vllm-0.33.0" / "0001-mark-patched.patch"
    patch.write_text(patch.read_text().replace("patched = True", "patched = 2"))
    second = run_build(setup)
    assert second.returncode == 0, second.stderr
    env_dir = Path(second.stdout.strip().splitlines()[-1])
    assert env_dir != first
    assert env_python_says(env_dir, PATCHED_Q) == "2"
    # The 2-wheel install was not repeated: the new env is a hard-link clone.
    assert "base cache hit" in second.stderr
    site_of = {
        d: next((d / "venv" / "lib").glob("python3.*/site-packages")) for d in (first, env_dir)
    }
    unpatched = [site_of[d] / "tinydep" / "__init__.py" for d in (first, env_dir)]
    assert unpatched[0].stat().st_ino == unpatched[1].stat().st_ino
    patched = [
        site_of[d] / "vllm" / "models" / "qwen4_exp" / "__init__.py" for d in (first, env_dir)
    ]
    assert patched[0].stat().st_ino != patched[1].stat().st_ino
    assert env_python_says(first, PATCHED_Q) == "True"  # the first env is untouched


def test_console_scripts_run_the_envs_own_python(setup):
    result = run_build(setup)
    assert result.returncode == 0, result.stderr
    env_dir = Path(result.stdout.strip().splitlines()[-1])
    script = env_dir / "venv" / "bin" / "vllm"
    out = subprocess.run([str(script)], capture_output=True, text=True, check=True, cwd="/")
    prefix, patched = out.stdout.split()
    assert Path(prefix).resolve() == (env_dir / "venv").resolve()
    assert patched == "True"


def test_a_failed_build_is_not_published_and_not_reused(setup):
    failing = setup["tmp"] / "failing-patches"
    write_patches(failing, apply_script="#!/bin/sh\necho 'apply: refused' >&2\nexit 1\n")
    result = run_build(setup, patches=failing)
    assert result.returncode == 1
    assert "pins/build-env: error:" in result.stderr and "apply: refused" in result.stderr
    env_root = setup["cache"] / "env"
    assert [p.name for p in env_root.iterdir() if not p.name.endswith(".lock")] == []


def test_a_build_killed_half_way_is_rebuilt_not_reused(setup):
    # What a SIGKILLed build leaves: an unlinked dir with a venv in it.
    ok = Path(run_build(setup).stdout.strip().splitlines()[-1])
    key = ok.name
    env_root = setup["cache"] / "env"
    target = env_root / os.readlink(ok)
    (target / buildenv.MANIFEST).unlink()  # as if it died before the manifest
    half = env_root / f".{key}.dead1234"
    half.mkdir()
    (half / "venv").mkdir()
    result = run_build(setup)
    assert result.returncode == 0, result.stderr
    assert "build-env: cache hit" not in result.stderr
    assert not half.exists()
    rebuilt = Path(result.stdout.strip().splitlines()[-1])
    assert (rebuilt / buildenv.MANIFEST).is_file()
    assert not target.exists()  # the replaced incomplete build is gone


def test_a_tampered_wheel_in_the_wheelhouse_is_refused(setup):
    ok = run_build(setup)
    assert ok.returncode == 0, ok.stderr
    wheelhouse = next((setup["cache"] / "wheelhouse").iterdir())
    tinydep = next(wheelhouse.glob("tinydep-*.whl"))
    data = bytearray(tinydep.read_bytes())
    data[-30] ^= 0xFF  # flip a byte: same name, same size, different content
    tinydep.write_bytes(bytes(data))
    result = run_build(setup, "--rebuild")
    assert result.returncode == 1
    assert "THESE PACKAGES DO NOT MATCH THE HASHES" in result.stderr
    assert "tinydep" in result.stderr


def test_a_seed_file_with_the_wrong_hash_is_not_taken(setup, tmp_path):
    bad_seed = tmp_path / "bad-seed"
    make_closure(bad_seed)
    # Same names, different content: the vllm wheel gets an extra file.
    from fakewheels import make_wheel

    make_wheel(bad_seed, "tinydep", "1.0", {"tinydep/__init__.py": "VALUE = 2\n"})
    from pinkit import lockfile, wheelhouse

    pins = lockfile.parse(
        (setup["pins"] / f"requirements-cp{PY_MINOR.replace('.', '')}.txt").read_text()
    )
    house = tmp_path / "house"
    assert wheelhouse.seed(house, pins, [bad_seed]) == 1  # only the identical vllm wheel
    assert [p.name for p in wheelhouse.missing(house, pins)] == ["tinydep"]
    assert wheelhouse.seed(house, pins, [setup["seed"]]) == 1
    assert wheelhouse.verify(house, pins) == []


def test_apply_that_writes_through_hardlinks_is_caught(setup):
    in_place = setup["tmp"] / "in-place-patches"
    write_patches(
        in_place,
        apply_script='#!/bin/sh\nprintf "# edited\\n" >> "$1/vllm/models/qwen4_exp/__init__.py"\n',
    )
    result = run_build(setup, patches=in_place)
    assert result.returncode == 1
    assert "stock/vllm no longer matches the wheel" in result.stderr
    assert "vllm/models/qwen4_exp/__init__.py" in result.stderr


def test_missing_apply_script_fails_before_any_work(setup):
    (setup["patches"] / "apply").unlink()
    result = run_build(setup)
    assert result.returncode == 1
    assert "patches/apply does not exist" in result.stderr
    assert not (setup["cache"] / "wheelhouse").exists()


def test_a_hand_edited_lock_is_refused(setup):
    lock = setup["pins"] / f"requirements-cp{PY_MINOR.replace('.', '')}.txt"
    lock.write_text(lock.read_text().replace("tinydep==1.0", "tinydep==1.1"))
    result = run_build(setup)
    assert result.returncode == 1
    assert "does not match the sha256 in vllm.toml" in result.stderr


def test_a_python_without_a_lock_is_refused(setup):
    (setup["pins"] / "vllm.toml").write_text(
        (setup["pins"] / "vllm.toml").read_text().replace(f'[lock."{PY_MINOR}"]', '[lock."3.99"]')
    )
    result = run_build(setup)
    assert result.returncode == 1
    assert f"no lock for CPython {PY_MINOR} (locked: 3.99)" in result.stderr


def test_not_enough_disk_is_refused(setup):
    argv_extra = ["--min-free-bytes", str(1 << 60)]
    result = run_build(setup, *argv_extra)
    assert result.returncode == 1
    assert "GiB free, a build needs" in result.stderr


def _variant(setup, n: int) -> None:
    """Make the patch inputs distinct (a new env key) without changing what they do."""
    series = setup["patches"] / "vllm-0.33.0" / "series"
    series.write_text(f"# test series, variant {n}\n0001-mark-patched.patch\n")


def _built(setup, *extra) -> Path:
    result = run_build(setup, *extra)
    assert result.returncode == 0, result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def test_only_the_most_recently_used_envs_are_kept(setup):
    envs = []
    for n in range(3):
        _variant(setup, n)
        envs.append(_built(setup, "--keep-envs", "2"))
    root = setup["cache"] / "env"
    # Three builds, keep 2: the first (least recently used) env is gone, whole.
    assert not envs[0].exists() and not envs[0].is_symlink()
    assert envs[1].is_symlink() and envs[2].is_symlink()
    build_dirs = [p.name for p in root.iterdir() if p.name.startswith(".") and p.is_dir()]
    assert sorted(build_dirs) == sorted(os.readlink(e) for e in envs[1:])
    assert env_python_says(envs[1], PATCHED_Q) == "True"
    # Asking for env 1 again makes it the most recently used: the next build
    # removes env 2 instead.
    _variant(setup, 1)
    assert _built(setup, "--keep-envs", "2") == envs[1]
    _variant(setup, 3)
    newest = _built(setup, "--keep-envs", "2")
    assert envs[1].is_symlink() and newest.is_symlink() and not envs[2].exists()
    assert env_python_says(envs[1], PATCHED_Q) == "True"


def test_keep_envs_below_one_is_refused(setup):
    result = run_build(setup, "--keep-envs", "0")
    assert result.returncode == 2
    assert "--keep-envs must be at least 1" in result.stderr


def _published_key(root: Path, key: str, mtime: float) -> None:
    build = root / f".{key}.build"
    (build / "venv").mkdir(parents=True)
    (root / key).symlink_to(build.name)
    lock = root / f"{key}.lock"
    lock.touch()
    os.utime(lock, (mtime, mtime))


def test_pruning_skips_the_current_key_and_keys_locked_elsewhere(tmp_path):
    import fcntl

    for i, key in enumerate(["old", "locked", "current", "new"]):
        _published_key(tmp_path, key, 1000.0 + i)
    os.utime(tmp_path / "current.lock", (1.0, 1.0))  # oldest, but the one just built
    with open(tmp_path / "locked.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process is building it
        removed = buildenv.prune_least_recently_used(tmp_path, 1, "current")
    assert removed == ["old"]
    assert not (tmp_path / "old").is_symlink() and not (tmp_path / ".old.build").exists()
    for key in ("locked", "current", "new"):
        assert (tmp_path / key / "venv").is_dir()
    assert (tmp_path / "old.lock").exists()  # lock files stay (a waiter may hold one)
