"""The flake evaluated with the nixpkgs stand-in: output tree, derivation arguments, sources.

These run Nix 2.8 for real (parse, `nix flake show/check`, `nix eval`); only
nixpkgs is replaced (checks/nix/nixpkgs-standin). The builder steps the
derivations call are run for real by the pins suite (checks/pins: pins/build-env
and pins/pinkit, which nix/build-vllm-env.py calls); here, the interface check.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, repo_files

SYSTEM = "x86_64-linux"


def files_under(store_path: str) -> set[str]:
    root = Path(store_path)
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def series_names() -> list[str]:
    text = (REPO / "patches/vllm-0.33.0/series").read_text()
    return [ln.split("#", 1)[0].strip() for ln in text.splitlines() if ln.split("#", 1)[0].strip()]


# ---------------------------------------------------------------- parse and tree


def test_every_nix_file_parses(nix):
    files = [f for f in repo_files() if f.endswith(".nix")]
    assert "flake.nix" in files and "nix/outputs.nix" in files
    for rel in files:
        nix.run("nix-instantiate", "--parse", str(REPO / rel))


# nixos-26.05 branched off in May 2026: a commit it holds is not older than that.
BRANCH_OFF = 1777593600  # 2026-05-01 00:00 UTC
REAL_LOCK = json.loads((REPO / "flake.lock").read_text())


def periodic(text) -> bool:
    """`text` is one shorter piece repeated ("abc1" * 10)."""
    n = len(text)
    return any(n % k == 0 and text == text[:k] * (n // k) for k in range(1, n // 2 + 1))


def pin_problems(locked: dict, now: float) -> list[str]:
    """Why a locked github node is not a real-looking pin. Nothing here can fetch it:
    this tells a revision and hash copied from a real lock from a placeholder."""
    problems = []
    if locked.get("type") != "github" or (locked.get("owner"), locked.get("repo")) != (
        "NixOS", "nixpkgs",
    ):  # fmt: skip
        problems.append(f"not a github NixOS/nixpkgs node: {locked}")
    rev = str(locked.get("rev", ""))
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        problems.append(f"rev {rev!r} is not 40 lowercase hex digits")
    elif len(set(rev)) < 8 or periodic(rev):
        problems.append(f"rev {rev!r} repeats a few digits: a placeholder")
    nar = str(locked.get("narHash", ""))
    match = re.fullmatch(r"sha256-([A-Za-z0-9+/]{43}=)", nar)
    digest = base64.b64decode(match.group(1)) if match else b""
    if len(digest) != 32:
        problems.append(f"narHash {nar!r} is not sha256- and 32 bytes of base64")
    elif len(set(match.group(1))) < 16 or len(set(digest)) < 16 or periodic(digest):
        problems.append(f"narHash {nar!r} repeats a few characters: a placeholder")
    modified = locked.get("lastModified")
    if not isinstance(modified, int) or not BRANCH_OFF <= modified <= now:
        problems.append(f"lastModified {modified!r} is not a time since the 26.05 branch-off")
    return problems


def readme_pin() -> dict[str, str]:
    """The pair nix/README.md records with its sources (the table between the markers)."""
    text = (REPO / "nix/README.md").read_text()
    block = re.search(r"<!-- nixpkgs-pin:begin -->(.*?)<!-- nixpkgs-pin:end -->", text, re.S)
    assert block, "nix/README.md lost its nixpkgs-pin table"
    return dict(re.findall(r"^\| (rev|narHash|lastModified) \| `([^`]+)`", block.group(1), re.M))


def test_flake_lock_pins_the_one_input():
    lock = REAL_LOCK
    assert lock["version"] == 7
    assert lock["nodes"]["root"]["inputs"] == {"nixpkgs": "nixpkgs"}
    node = lock["nodes"]["nixpkgs"]
    flake_nix = (REPO / "flake.nix").read_text()
    url = re.search(r'inputs\.nixpkgs\.url = "github:NixOS/nixpkgs/([^"]+)"', flake_nix)
    assert url and node["original"] == {
        "owner": "NixOS", "repo": "nixpkgs", "ref": url.group(1), "type": "github",
    }  # fmt: skip
    assert url.group(1) == "nixos-26.05"
    assert pin_problems(node["locked"], time.time()) == []
    # The lock holds the pair whose sources nix/README.md names: neither side
    # can be edited alone.
    locked = node["locked"]
    assert readme_pin() == {
        "rev": locked["rev"], "narHash": locked["narHash"],
        "lastModified": str(locked["lastModified"]),
    }  # fmt: skip


GOOD = REAL_LOCK["nodes"]["nixpkgs"]["locked"]


@pytest.mark.parametrize(
    "change",
    [
        # What this file held before: unfetchable and, worse, accepted by the old test.
        {"rev": "0" * 40, "narHash": "sha256-" + "A" * 43 + "=", "lastModified": 0},
        {"rev": "0" * 40},
        {"rev": "a" * 40},
        {"rev": "abc123def4" * 4},
        {"rev": GOOD["rev"][:12]},
        {"rev": GOOD["rev"].upper()},
        {"narHash": "sha256-" + "A" * 43 + "="},
        {"narHash": "sha256-x"},
        {"narHash": "sha256-" + "AB" * 21 + "A="},
        {"narHash": GOOD["narHash"].replace("sha256-", "sha512-")},
        {"narHash": "sha256-" + base64.b64encode(bytes(range(31))).decode()},
        {"lastModified": 0},
        {"lastModified": 1700000000},
        {"lastModified": 4102444800},
        {"type": "tarball"},
        {"owner": "example"},
    ],
)
def test_lock_check_rejects_placeholders(change):
    assert pin_problems(dict(GOOD, **change), time.time()) != []


def test_flake_show_lists_the_documented_outputs(nix):
    tree = json.loads(nix.flake("show", "--json").stdout)
    packages = tree["packages"][SYSTEM]
    assert sorted(packages) == [
        "default", "flashnext", "image", "image-archive", "vllm-env", "wheelhouse",
    ]  # fmt: skip
    assert packages["image"]["name"] == "stream-flashnext"
    assert packages["image-archive"]["name"] == "flashnext.tar.gz"
    assert packages["default"]["name"] == packages["flashnext"]["name"]
    assert sorted(tree["apps"][SYSTEM]) == ["default", "plan", "preflight", "serve"]
    assert all(a["type"] == "app" for a in tree["apps"][SYSTEM].values())
    assert sorted(tree["checks"][SYSTEM]) == [
        "flashnext", "image-config", "launcher", "patches", "pins", "vllm-env",
    ]  # fmt: skip
    assert sorted(tree["devShells"][SYSTEM]) == ["default"]
    assert tree["formatter"][SYSTEM]["type"] == "derivation"


def test_flake_check_evaluates_everything(nix):
    """`nix flake check --no-build`: every output has the type flakes require."""
    nix.flake("check", "--no-build")


# ---------------------------------------------------------------- derivation arguments


def wheels_sha256(lock: Path) -> str:
    """The wheel set's hash as nix/pins.nix and nix/update-wheelhouse-hash compute it."""
    hashes = sorted(re.findall(r"--hash=sha256:([0-9a-f]{64})", lock.read_text()))
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def test_wheelhouse_is_fixed_output_and_fails_closed(summary):
    w = summary["wheelhouse"]
    wheels = wheels_sha256(REPO / "pins/requirements-cp312.txt")
    assert w["name"] == f"flashnext-wheelhouse-cp312-{wheels[:16]}"
    assert (w["outputHashMode"], w["outputHashAlgo"]) == ("recursive", "sha256")
    record = json.loads((REPO / "nix/wheelhouse-hash.json").read_text())
    assert record["wheels_sha256"] == wheels, (
        "the lock's wheels changed: nix/update-wheelhouse-hash"
    )
    if record["output_hash"] is None:
        assert w["outputHash"] == "sha256-" + "A" * 43 + "=" and w["hashComputed"] is False
    else:
        assert w["outputHash"] == record["output_hash"] and w["hashComputed"] is True
    assert "nix/build-vllm-env.py wheelhouse" in w["buildPhase"]


def test_vllm_env_gets_the_pins_and_the_series(summary):
    env = summary["vllmEnv"]
    pins = tomllib.loads((REPO / "pins/vllm.toml").read_text())
    assert env["version"] == pins["vllm"]["version"] == "0.33.0"
    src = Path(env["src"])
    # The series and every patch it names flow in byte for byte.
    names = series_names()
    for rel in [
        "patches/vllm-0.33.0/series",
        "patches/apply",
        *[f"patches/vllm-0.33.0/{n}" for n in names],
    ]:  # noqa: E501
        assert (src / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    for rel in ["pins/vllm.toml", "pins/requirements-cp312.txt", "nix/build-vllm-env.py"]:
        assert (src / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    assert f'nix/build-vllm-env.py install "$out" {env["wheelhouse"]}' in env["buildPhase"]
    assert env["doInstallCheck"] and "nix/build-vllm-env.py smoke" in env["installCheckPhase"]
    # patches/apply is executed directly: its shebang must be patched in the sandbox.
    assert "patchShebangs pins patches" in env["postPatch"]
    assert "libcuda.so.1" in env["autoPatchelfIgnoreMissingDeps"]
    assert {"auto-patchelf-hook-standin", "auto-add-driver-runpath-hook-standin"} <= set(
        env["hooks"]
    )
    assert env["dontStrip"]


def test_sources_are_filtered(summary):
    tops = {
        key: {f.split("/")[0] for f in files_under(summary[key]["src"])}
        for key in ("wheelhouse", "vllmEnv", "flashnext")
    }
    assert tops["wheelhouse"] == {"pins", "nix"}
    assert tops["vllmEnv"] == {"pins", "patches", "nix"}
    assert tops["flashnext"] == {"launcher"}
    assert files_under(summary["wheelhouse"]["src"]) & {"nix/outputs.nix", "nix/README.md"} == set()


def test_flashnext_runs_in_the_vllm_env(summary):
    f = summary["flashnext"]
    assert f["mainProgram"] == "flashnext"
    assert f"{f['vllmEnv']}/venv/bin/python -m pip install --no-index --no-deps" in f["buildPhase"]
    fixup = f["postFixup"]
    assert f'--prefix PATH : "{f["vllmEnv"]}/venv/bin"' in fixup
    assert '--suffix LD_LIBRARY_PATH : "/run/opengl-driver/lib"' in fixup
    assert re.search(r"--run \"\. /nix/store/[a-z0-9]{32}-find-libcuda\.sh\"", fixup)
    assert summary["default"] is True


def check_config(config: dict, path: Path) -> subprocess.CompletedProcess:
    path.write_text(json.dumps(config))
    checker = [sys.executable, str(REPO / "nix/check-image-config.py"),
               "--readme", str(REPO / "containers/README.md"), "--config", str(path)]  # fmt: skip
    return subprocess.run(checker, capture_output=True, text=True)


def test_image_config_is_the_documented_contract(summary, tmp_path):
    """The config object dockerTools gets; checks/containers loads it into podman."""
    image = summary["image"]
    assert image["config"]["Entrypoint"] == [
        f"{summary['flashnext']['out']}/bin/flashnext",
        "serve",
    ]
    assert image["imageTag"] == f"{summary['flashnext']['version']}-abcdef0"
    assert "mkdir -m 1777 tmp" in image["extraCommands"]
    assert any(c.endswith("-nss-cacert-standin") for c in image["contents"])
    # /etc/passwd and /etc/group: getpwuid() and ~ resolve inside the image.
    assert any(c.endswith("-fake-nss-standin") for c in image["contents"])
    assert image["config"]["Healthcheck"] == {
        "Test": ["CMD", "flashnext-health"],
        "Interval": 30 * 10**9, "Timeout": 10 * 10**9, "StartPeriod": 35 * 60 * 10**9,
        "Retries": 3,
    }  # fmt: skip
    ok = check_config(image["config"], tmp_path / "config.json")
    assert ok.returncode == 0, ok.stderr
    # ... and the check can fail: a drifted entrypoint, env var and healthcheck are named.
    drifted = dict(image["config"], Entrypoint=["/bin/vllm", "serve"])
    drifted["Env"] = [e for e in drifted["Env"] if not e.startswith("LD_LIBRARY_PATH=")]
    del drifted["Healthcheck"]
    bad = check_config(drifted, tmp_path / "drifted.json")
    assert bad.returncode == 1
    assert "Entrypoint is ['/bin/vllm', 'serve']" in bad.stderr
    assert "Env LD_LIBRARY_PATH: image has None" in bad.stderr
    assert "Healthcheck: the image has none" in bad.stderr


def test_image_archive_is_the_same_image_not_streamed(summary):
    archive, image = summary["imageArchive"], summary["image"]
    assert archive["name"] == "flashnext.tar.gz"
    for key in ("config", "contents", "imageTag", "extraCommands"):
        assert archive[key] == image[key], key


def test_image_config_check_runs_the_same_checker(summary):
    check = summary["checks"]["image-config"]
    assert "nix/check-image-config.py" in check["script"]
    assert "--readme containers/README.md" in check["script"]
    assert files_under(check["src"]) == {"containers/README.md", "nix/check-image-config.py"}


def test_apps_call_the_subcommands(summary):
    for name in ("serve", "preflight", "plan"):
        app = summary["apps"][name]
        assert app["program"].endswith(f"-flashnext-{name}")
        (drv,) = app["drvs"]
        text = Path(drv).read_text()
        assert f"{summary['flashnext']['out']}/bin/flashnext {name}" in text
    assert summary["apps"]["default"]["program"] == summary["apps"]["serve"]["program"]


def test_sandbox_checks_run_the_suites(summary):
    checks = summary["checks"]
    assert (
        "pytest" in checks["launcher"]["script"]
        and "checks/launcher" in checks["launcher"]["script"]
    )
    assert "checks/pins" in checks["pins"]["script"]
    script = checks["patches"]["script"]
    assert "--vllm-tree=stock" in script and "--vllm-tree=patched" in script
    assert f"{summary['vllmEnv']['src']}" not in script  # runs the env, not its source
    # A deselected test that was renamed would silently run (and fail) in the sandbox.
    for name, check in checks.items():
        for path, func in re.findall(r"--deselect \"?([^\s:]+)::(\w+)", check["script"]):
            assert f"def {func}(" in (REPO / path).read_text(), f"{name}: {path}::{func} is gone"


def test_dev_shell_and_formatter(summary):
    assert summary["formatter"].startswith("nixfmt")
    names = " ".join(summary["devShellPackages"])
    for tool in ("ruff", "patch", "podman", "nixfmt", "python3"):
        assert tool in names


# ---------------------------------------------------------------- edits, in a copy of the repo


def test_unrelated_edits_do_not_rebuild_the_env(repo_copy):
    before = repo_copy.summary()["drvPaths"]
    init = repo_copy.cwd / "launcher/src/flashnext/__init__.py"
    init.write_text(init.read_text() + "# edited by checks/nix\n")
    readme = repo_copy.cwd / "containers/README.md"
    readme.write_text(readme.read_text() + "\nedited\n")
    after = repo_copy.summary()["drvPaths"]
    assert after["packages"]["wheelhouse"] == before["packages"]["wheelhouse"]
    assert after["packages"]["vllm-env"] == before["packages"]["vllm-env"]
    assert after["packages"]["flashnext"] != before["packages"]["flashnext"]
    assert after["checks"]["image-config"] != before["checks"]["image-config"]


def test_a_patch_edit_rebuilds_the_env_not_the_wheelhouse(repo_copy):
    before = repo_copy.summary()["drvPaths"]["packages"]
    series = repo_copy.cwd / "patches/vllm-0.33.0/series"
    series.write_text(series.read_text() + "# edited by checks/nix\n")
    after = repo_copy.summary()["drvPaths"]["packages"]
    assert after["wheelhouse"] == before["wheelhouse"]
    assert after["vllm-env"] != before["vllm-env"]


def _relock(copy: Path, line: str) -> None:
    """Change the lock the way pins/lock would: new bytes, vllm.toml updated to match."""
    lock = copy / "pins/requirements-cp312.txt"
    old = hashlib.sha256(lock.read_bytes()).hexdigest()
    lock.write_text(lock.read_text() + line)
    new = hashlib.sha256(lock.read_bytes()).hexdigest()
    toml = copy / "pins/vllm.toml"
    toml.write_text(toml.read_text().replace(old, new))


NEW_WHEEL = "example-wheel==1.0 \\\n    --hash=sha256:" + "0" * 64 + "\n"


def test_new_wheels_without_new_wheelhouse_hash_fail_closed(repo_copy):
    _relock(repo_copy.cwd, NEW_WHEEL)
    proc = repo_copy.summary(check=False)
    assert proc.returncode != 0
    assert "names other wheels" in proc.stderr and "nix/update-wheelhouse-hash" in proc.stderr


def test_relock_with_the_same_wheels_keeps_the_wheelhouse(repo_copy, summary):
    _relock(repo_copy.cwd, "# regenerated by a newer pins/lock, same wheels\n")
    after = repo_copy.summary()
    # The download step's inputs changed (the lock's bytes), its output did not:
    # Nix reuses a wheelhouse it has (no second 4 GB download).
    assert after["wheelhouseOutPath"] == summary["wheelhouseOutPath"]


def test_hand_edited_lock_is_refused(repo_copy):
    lock = repo_copy.cwd / "pins/requirements-cp312.txt"
    lock.write_text(lock.read_text() + "# hand edit\n")
    proc = repo_copy.summary(check=False)
    assert proc.returncode != 0 and "the lock was edited by hand" in proc.stderr


def test_placeholder_record_tracks_the_lock(repo_copy):
    """--placeholder re-records the lock (hash null): evaluation works, the build fails closed."""
    _relock(repo_copy.cwd, NEW_WHEEL)
    script = repo_copy.cwd / "nix/update-wheelhouse-hash"
    subprocess.run([script, "--placeholder"], check=True, capture_output=True)
    w = repo_copy.summary()["wheelhouse"]
    assert w["outputHash"] == "sha256-" + "A" * 43 + "=" and w["hashComputed"] is False


# ---------------------------------------------------------------- pieces run outside Nix


def test_builder_steps_exist_in_pins():
    """nix/build-vllm-env.py calls pins/pinkit; pins/build-env runs the same code for real
    in the pins suite (checks/pins)."""
    proc = subprocess.run(
        [sys.executable, "nix/build-vllm-env.py", "interface"], cwd=REPO, capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def pins_env_site_packages() -> Path | None:
    """site-packages of the newest env pins/build-env published (the pins suite builds it)."""
    cache = Path(os.environ.get("FLASHNEXT_CACHE", Path.home() / ".cache" / "flashnext"))
    envs = [p for p in (cache / "env").glob("*") if p.is_symlink() and (p / "venv").is_dir()]
    for env in sorted(envs, key=lambda p: p.stat().st_mtime, reverse=True):
        found = sorted((env / "venv" / "lib").glob("python3.*/site-packages"))
        if found:
            return found[0]
    return None


def test_autopatchelf_ignore_list_covers_the_locked_wheels(summary):
    """Predicts the Nix build's autoPatchelf step on the same wheels, without Nix:
    every library a wheel needs is in the tree, a buildInput, or ignored with a reason."""
    site = pins_env_site_packages()
    if site is None:
        pytest.skip(
            "no env from pins/build-env under $FLASHNEXT_CACHE/env (checks/pins/run builds it)"
        )
    elf_deps = [sys.executable, str(REPO / "nix/elf-deps.py"), str(site)]
    bare = subprocess.run(elf_deps, capture_output=True, text=True)
    assert bare.returncode == 1 and "libcuda.so.1:" in bare.stdout  # the scan sees something
    ignores = [
        a for p in summary["vllmEnv"]["autoPatchelfIgnoreMissingDeps"] for a in ("--ignore", p)
    ]
    proc = subprocess.run([*elf_deps, *ignores], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("dirs", "preset", "expected"),
    [
        (["empty", "driver", "other"], None, "driver"),
        (["empty", "other"], None, None),
        (["driver"], "/custom", "/custom"),
    ],
)
def test_find_libcuda(tmp_path, dirs, preset, expected):
    for name in ("empty", "other", "driver"):
        (tmp_path / name).mkdir()
    (tmp_path / "driver/libcuda.so.1").write_bytes(b"")
    env = {"LD_LIBRARY_PATH": ":".join(str(tmp_path / d) for d in dirs), "PATH": "/usr/bin:/bin"}
    if preset:
        env["TRITON_LIBCUDA_PATH"] = preset
    script = f'. {REPO / "nix/find-libcuda.sh"}; printf %s "${{TRITON_LIBCUDA_PATH-unset}}"'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True).stdout
    want = {None: "unset", "driver": str(tmp_path / "driver")}.get(expected, expected)
    assert out == want
