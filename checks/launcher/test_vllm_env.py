"""Issue 13, finding 1: preflight judges the vLLM serve will start, and serve finds it
(--vllm-env / FLASHNEXT_VLLM_ENV, `vllm` on PATH, the checkout's built env) or builds it.

The stand-in envs (vllm_env_fixtures.py) have the real layout and a `vllm` package
of two files; the tests marked with the real env run against checks/run's pinned
one (FLASHNEXT_VLLM_ENV there) and skip without it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.checkout import find_checkout, series_patches
from flashnext.checks.inputs import PreflightInput
from flashnext.checks.vllm_env import vllm_env
from flashnext.cli import main
from flashnext.facts.schema import VllmEnvFacts, dumps
from flashnext.facts.vllm_env import find_built_env, probe_vllm_env, script_python
from flashnext.profiles import select_profile
from lead_fixtures import VARIANTS, base_facts
from vllm_env_fixtures import REAL_VLLM_ENV, checkout_stamp, make_vllm_env, write_vllm_tree

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
from harness import finish, free_port, read_until  # noqa: E402

TABLE = "/nvme/flashnext/ple-table.bin"
SERIES = series_patches(find_checkout().series_dir)
REQUIRED = f"vLLM 0.33.0 + the {len(SERIES)} patches of patches/vllm-0.33.0"
USE_PINNED = (
    'pass --vllm-env "$(pins/build-env | tail -1)" (builds the pinned, patched env or reuses '
    "the built one)"
)


def judge(env: VllmEnvFacts, series=SERIES, build_env="pins/build-env"):
    facts = base_facts()
    profile, _ = select_profile(facts, None)
    inp = PreflightInput(
        facts=facts, profile=profile, plan=None, plan_error=None, model=None, model_error=None,
        model_dir=None, table_path=None, table_shape=None, port=8000, host="127.0.0.1",
        vllm_env=env, patch_series=series, build_env=build_env,
    )  # fmt: skip
    (finding,) = list(vllm_env(inp))
    return finding


def patched(**changes) -> VllmEnvFacts:
    env = VllmEnvFacts(
        selected_by="--vllm-env", env_dir="/e", executable="/e/venv/bin/vllm",
        python="/e/venv/bin/python", package_dir="/e/site/vllm", version="0.33.0",
        stamp=checkout_stamp(),
    )  # fmt: skip
    return dataclasses.replace(env, **changes)


# ---------------------------------------------------------------- the check (pure)


def test_the_patched_env_passes():
    f = judge(patched())
    assert (f.level, f.measured, f.required) == (
        "ok",
        f"vLLM 0.33.0, {len(SERIES)} patches",
        REQUIRED,
    )
    assert f.message == "/e/venv/bin/vllm (--vllm-env); stamp equal to this checkout's series"


def test_no_env_fails_with_the_build_command():
    f = judge(VllmEnvFacts(selected_by="none"))
    assert (f.level, f.measured) == ("fail", "no vLLM found")
    assert f.message == (
        "no vLLM to start: --vllm-env and FLASHNEXT_VLLM_ENV are unset, no `vllm` is on PATH, "
        "and pins/build-env has not built the pinned env here"
    )
    assert f.fix == (
        "pins/build-env (builds the pinned, patched env: about 4 GB of wheels, 9.4 GB installed; "
        "`flashnext serve` runs it itself)"
    )


def test_no_env_outside_a_checkout_names_what_carries_one():
    f = judge(VllmEnvFacts(selected_by="none"), series=None, build_env=None)
    assert f.level == "fail" and "Nix app or the image" in f.fix


def test_a_stock_tree_fails():
    f = judge(patched(stamp=None))
    assert (f.level, f.measured) == ("fail", "stock vLLM 0.33.0")
    assert f.message.startswith("/e/venv/bin/vllm (--vllm-env) runs a stock vLLM from /e/site/vllm")
    assert f.fix == USE_PINNED


def test_another_version_fails():
    f = judge(patched(version="0.34.1"))
    assert (f.level, f.measured) == ("fail", "vLLM 0.34.1")
    assert "the patch series is written for 0.33.0" in f.message and f.fix == USE_PINNED


def test_an_env_that_cannot_import_vllm_fails():
    f = judge(patched(error="`import vllm` failed: ModuleNotFoundError: No module named 'torch'"))
    assert (f.level, f.measured) == ("fail", "not usable")
    assert "No module named 'torch'" in f.message and f.fix == USE_PINNED


@pytest.mark.parametrize(
    ("edit", "measured"),
    [
        (lambda s: s["patches"].pop(), f"stale: {SERIES[-1][0]} not applied"),
        (
            lambda s: s["patches"][0].update(sha256="0" * 64),
            f"stale: {SERIES[0][0]} changed since",
        ),
        (
            lambda s: s["patches"].append({"name": "0099-extra.patch", "sha256": "1" * 64}),
            "stale: 0099-extra.patch not in the series",
        ),
        (lambda s: s.update(vllm_version="0.32.0"), "stale: stamped for vLLM 0.32.0"),
    ],
)
def test_a_stale_stamp_fails(edit, measured):
    stamp = checkout_stamp()
    edit(stamp)
    f = judge(patched(stamp=stamp))
    assert (f.level, f.measured) == ("fail", measured)
    assert f.fix == USE_PINNED


def test_without_a_checkout_the_stamp_is_not_compared():
    f = judge(patched(), series=None, build_env=None)
    assert f.level == "ok" and "no checkout series to compare" in f.message


# ---------------------------------------------------------------- the probe


def test_probe_of_an_env_dir(tmp_path):
    env = make_vllm_env(tmp_path / "env", stamp=checkout_stamp())
    facts = probe_vllm_env(str(env), "--vllm-env", os.environ, None)
    assert facts.executable == str(env / "venv" / "bin" / "vllm")
    assert facts.python == str(env / "venv" / "bin" / "python")
    assert facts.package_dir == str((env / "site" / "vllm").resolve())
    assert (facts.version, facts.stamp, facts.error) == ("0.33.0", checkout_stamp(), None)


def test_probe_of_a_missing_dir(tmp_path):
    facts = probe_vllm_env(str(tmp_path / "nope"), "FLASHNEXT_VLLM_ENV", os.environ, None)
    assert facts.error == "no such directory"
    assert judge(facts).message == (
        f"the vLLM chosen by FLASHNEXT_VLLM_ENV ({tmp_path / 'nope'}): no such directory"
    )


def test_vllm_on_path_is_asked_through_its_own_python_and_pythonpath(tmp_path):
    # The GPU host's kit: no venv; KIT/bin/vllm's interpreter imports the patched
    # tree from PYTHONPATH.
    bindir, tree = tmp_path / "bin", tmp_path / "patched"
    bindir.mkdir()
    write_vllm_tree(tree, stamp=checkout_stamp())
    (bindir / "python3").symlink_to(sys.executable)
    (bindir / "vllm").write_text("#!/usr/bin/env python3\nraise SystemExit('never run')\n")
    (bindir / "vllm").chmod(0o755)
    environ = {"PATH": f"{bindir}:/usr/bin:/bin", "PYTHONPATH": str(tree)}
    facts = probe_vllm_env(None, "", environ, None)
    assert (facts.selected_by, facts.executable) == ("PATH", str(bindir / "vllm"))
    assert facts.python == str(bindir / "python3")
    assert facts.package_dir == str((tree / "vllm").resolve())
    assert judge(facts).level == "ok"
    # the same tree without PYTHONPATH: that Python has no vllm
    facts = probe_vllm_env(None, "", {"PATH": environ["PATH"]}, None)
    assert facts.error.startswith("`import vllm` failed: ModuleNotFoundError")


def test_pips_launcher_for_long_paths_names_its_python(tmp_path):
    script = tmp_path / "vllm"
    script.write_text(
        "#!/bin/sh\n'''exec' \"/very long/venv/bin/python\" \"$0\" \"$@\"\n' '''\nimport sys\n"
    )
    assert script_python(str(script), {})[0] == "/very long/venv/bin/python"


def test_a_binary_without_a_python_is_explained(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "vllm").write_bytes(b"\x7fELF\x02\x01")
    (bindir / "vllm").chmod(0o755)
    facts = probe_vllm_env(None, "", {"PATH": str(bindir)}, None)
    assert facts.error.startswith(f"cannot tell which Python runs {bindir / 'vllm'}")
    assert judge(facts).level == "fail"


# ---------------------------------------------------------------- through the CLI


def preflight(model, *extra, env=None):
    facts = Path(model).parent / "facts-with-manifest.json"
    if not facts.exists():
        facts.write_text(dumps(base_facts()))
    args = ["preflight", "--facts", str(facts), "--model", str(model), "--table", TABLE, *extra]
    return CliRunner(env=env).invoke(main, args, catch_exceptions=False)


def test_preflight_fails_a_stock_env_given_with_vllm_env(full_skeleton, tmp_path):
    stock = make_vllm_env(tmp_path / "stock", stamp=None)
    result = preflight(full_skeleton, "--vllm-env", str(stock))
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert f"fix vllm.env: {USE_PINNED}" in lines
    assert lines[-1] == "preflight: 1 failed, 1 warnings, 33 ok"  # the warning: kv.capacity


def test_preflight_judges_the_env_named_by_flashnext_vllm_env(full_skeleton, patched_vllm_env):
    result = preflight(full_skeleton)  # the autouse fixture sets FLASHNEXT_VLLM_ENV
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == "preflight: 0 failed, 1 warnings, 34 ok"
    stale = checkout_stamp()
    stale["patches"].pop()
    old = make_vllm_env(patched_vllm_env.parent / "stale", stamp=stale)
    result = preflight(full_skeleton, env={"FLASHNEXT_VLLM_ENV": str(old)})
    assert result.exit_code == 1
    assert f"fix vllm.env: {USE_PINNED}" in result.output.splitlines()


# ---------------------------------------------------------------- the real pinned env


def needs_real_env() -> Path:
    if REAL_VLLM_ENV is None:
        pytest.skip("FLASHNEXT_VLLM_ENV is not set (checks/run sets it to the pinned env)")
    return Path(REAL_VLLM_ENV)


def test_the_real_pinned_env_passes_and_its_stock_tree_fails(tmp_path):
    real = needs_real_env()
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    facts = probe_vllm_env(str(real), "--vllm-env", environ, find_checkout())
    assert facts.version == "0.33.0" and judge(facts).level == "ok", facts
    # ENV/stock first on PYTHONPATH imports the pristine tree (pins/README.md)
    stock = probe_vllm_env(
        str(real), "--vllm-env", {**environ, "PYTHONPATH": str(real / "stock")}, None
    )
    f = judge(stock)
    assert (f.level, f.measured) == ("fail", "stock vLLM 0.33.0"), f
    assert stock.package_dir == str((real / "stock" / "vllm").resolve())


def test_the_built_env_is_found_as_pins_build_env_prints_it():
    real = needs_real_env()
    printed = subprocess.run(
        [str(REPO / "pins" / "build-env")], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()[-1]
    if Path(printed).resolve() != real.resolve():
        pytest.skip(f"FLASHNEXT_VLLM_ENV ({real}) is not the env pins/build-env prints ({printed})")
    assert find_built_env(find_checkout(), os.environ) == printed


# ---------------------------------------------------------------- serve builds it


@pytest.fixture
def checkout_without_env(tmp_path):
    """A copy of the checkout's launcher and patches with a pins/build-env that records
    its call and builds a stand-in env (the real one downloads 4 GB)."""
    root = tmp_path / "clone"
    shutil.copytree(REPO / "launcher" / "src", root / "launcher" / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))  # fmt: skip
    shutil.copytree(REPO / "patches", root / "patches")
    (root / "pins").mkdir()
    cache = tmp_path / "cache"
    build = root / "pins" / "build-env"
    build.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from pathlib import Path\n"
        "from vllm_env_fixtures import checkout_stamp, make_vllm_env\n"
        "print('build-env: installing requirements-cp311.txt from the wheelhouse', "
        "file=sys.stderr, flush=True)\n"
        "Path(os.environ['BUILD_MARKER']).touch()\n"
        "print(make_vllm_env(Path(os.environ['FLASHNEXT_CACHE']) / 'env' / 'k', "
        "stamp=checkout_stamp()))\n"
    )
    build.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHNEXT_", "STANDIN_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",  # no `vllm` anywhere
        PYTHONPATH=str(root / "launcher" / "src"),
        FLASHNEXT_CACHE=str(cache),
        BUILD_MARKER=str(tmp_path / "built"),
        VLLM_PROCESS_NAME_PREFIX=f"BUILT{os.getpid()}",
    )
    return root, env, tmp_path / "built"


def test_serve_builds_the_missing_env_then_runs_it(full_skeleton, checkout_without_env, tmp_path):
    root, env, marker = checkout_without_env
    facts = tmp_path / "facts.json"
    port = free_port()
    facts.write_text(dumps(dataclasses.replace(base_facts(), ports=())))
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(facts),
         "--model", str(full_skeleton), "--table", TABLE, "--port", str(port)],
        env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = read_until(proc, r"flashnext: ready: ", timeout_s=120)
    proc.send_signal(signal.SIGTERM)
    rest = finish(proc, 60)
    assert proc.returncode == 0, seen + rest
    cache = env["FLASHNEXT_CACHE"]
    built = f"{cache}/env/k"
    assert (
        "flashnext: no vLLM env yet: building the pinned, patched vLLM with "
        f"{root}/pins/build-env; the first build downloads about 4 GB of wheels, 9.4 GB "
        f"installed: about 15 GB of cache in {cache} (10-25 minutes on the 2 cores "
        "pins/README.md measured; later runs reuse it)\n"
    ) in seen
    assert "build-env: installing requirements-cp311.txt from the wheelhouse\n" in seen
    assert f"flashnext: vLLM: {built}/venv/bin/vllm (pins/build-env)\n" in seen
    assert marker.exists()


def test_serve_builds_nothing_while_another_check_fails(
    full_skeleton, checkout_without_env, tmp_path
):
    root, env, marker = checkout_without_env
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(VARIANTS["memlock_64k"][0](base_facts())))
    proc = subprocess.run(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(facts),
         "--model", str(full_skeleton), "--table", TABLE],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "fix vllm.env: pins/build-env (builds the pinned" in proc.stdout
    assert "host.memlock" in proc.stdout and not marker.exists()


def test_serve_starts_the_real_pinned_vllm_found_in_the_cache(tmp_path):
    # The "done": on this machine (no GPU), replayed 3x3090 facts, nothing
    # selected: the env check passes and the real `vllm serve` starts (and stops
    # at vLLM's own device check, which is the honest end here).
    real = needs_real_env()
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHNEXT_VLLM_ENV", "PYTHONPATH")}
    if find_built_env(find_checkout(), env) != str(real):
        pytest.skip(f"{real} is not the env pins/build-env has built for this checkout")
    from flashnext.skeleton import write_skeleton

    model = tmp_path / "Qwen3.8-Flash-Next"
    write_skeleton(model, "full", fixed_metadata=True)
    facts = tmp_path / "facts.json"
    port = free_port()
    facts.write_text(dumps(dataclasses.replace(base_facts(), ports=())))
    proc = subprocess.run(
        [sys.executable, "-m", "flashnext", "serve", "--replay-facts-for-testing", str(facts),
         "--model", str(model), "--table", TABLE, "--port", str(port), "--startup-timeout", "300"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "preflight: 0 failed, 2 warnings, 33 ok" in proc.stdout, out[-3000:]
    assert f"flashnext: vLLM: {real}/venv/bin/vllm (pins/build-env)\n" in proc.stderr
    assert f"flashnext: starting: vllm serve {model} " in proc.stderr
    assert "RuntimeError: Failed to infer device type" in proc.stderr  # vLLM itself, no GPU
    assert proc.returncode == 1


@pytest.mark.parametrize(
    ("stamp", "why"),
    [
        ({"patches": "0001.patch"}, "`patches` is str, not a list"),
        ({"patches": [1, 2]}, "`patches[0]` is 1, not an object with name and sha256 strings"),
        ({"patches": [{"name": 5, "sha256": "0" * 64}]}, "`patches[0]` is {'name': 5"),
        ({"vllm_version": "0.33.0"}, "`patches` is NoneType, not a list"),
    ],
)
def test_a_stamp_of_another_shape_is_unreadable_not_a_traceback(stamp, why, tmp_path):
    """Issue 39 class 4: a patch stamp whose `patches` is no list of objects."""
    from flashnext.tools import report

    f = judge(patched(stamp=stamp))
    assert (f.level, f.measured) == ("fail", "unreadable patch stamp")
    assert why in f.message
    (tmp_path / report.STAMP_NAME).write_text(json.dumps(stamp))
    applied = report.applied_patches(tmp_path, {"patches": []})
    assert why in applied["unavailable"]
