"""The product image's recipe (containers/build + containers/Containerfile), without the 9 GB build.

The full build is a documented command (containers/README.md, with its last
run's figures). Here, in seconds:
- `containers/build --dry-run` passes every ARG the Containerfile declares,
  with the values the checkout's pins and series give;
- the Debian suite ships the Python whose lock the image installs;
- the Containerfile itself, run by podman on the real Debian base with a
  one-wheel stand-in closure, refuses what it must refuse: a vLLM that is not
  a pristine 0.33.0, a missing wheelhouse, a lock that is not the one named,
  a wheel whose hash is not the lock's.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from podman_cli import CACHE, GLOBAL_FLAGS, podman
from test_run_settings import CONTAINERS, REPO, containerfile_instructions

sys.path.insert(0, str(CONTAINERS))
from debian_base import PACKAGES, PYTHON, SUITE, debian_rootfs, podman_image  # noqa: E402

SERIES = REPO / "patches" / "vllm-0.33.0" / "series"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def dry_run() -> list[str]:
    out = subprocess.run(
        [CONTAINERS / "build", "--dry-run"], capture_output=True, text=True, check=True
    ).stdout
    return shlex.split(out)


def build_args(argv: list[str]) -> dict[str, str]:
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--build-arg"]
    return dict(p.split("=", 1) for p in pairs)


def test_build_passes_every_arg_with_the_checkouts_values():
    argv = dry_run()
    assert argv[:2] == ["podman", "build"]
    assert argv[argv.index("-f") + 1] == str(CONTAINERS / "Containerfile")
    assert argv[argv.index("--format") + 1] == "docker"
    assert argv[-1] == str(REPO)
    declared = {rest.split("=")[0] for word, rest in containerfile_instructions() if word == "ARG"}
    args = build_args(argv)
    assert set(args) == declared

    pins = tomllib.loads((REPO / "pins" / "vllm.toml").read_text())
    lock = pins["lock"][PYTHON]
    assert args["LOCK"] == lock["file"] == f"requirements-cp{PYTHON.replace('.', '')}.txt"
    assert args["LOCK_SHA256"] == lock["sha256"] == sha256(REPO / "pins" / lock["file"])
    assert args["SERIES_SHA256"] == sha256(SERIES)
    assert args["VLLM_VERSION"] == pins["vllm"]["version"]
    launcher = tomllib.loads((REPO / "launcher" / "pyproject.toml").read_text())
    assert args["FLASHNEXT_VERSION"] == launcher["project"]["version"]
    assert argv[argv.index("-t") + 1] == f"localhost/flashnext:{args['FLASHNEXT_VERSION']}"
    ref = subprocess.run([CONTAINERS / "debian_base.py", "--ref"], capture_output=True, text=True)
    assert args["BASE"] == ref.stdout.strip()

    wheels = subprocess.run(
        [REPO / "pins" / "wheelhouse", "--python-version", PYTHON, "--path"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert f"{wheels}:/wheelhouse:ro" in [
        argv[i + 1] for i, a in enumerate(argv) if a == "--volume"
    ]


def test_build_refuses_an_unknown_route():
    proc = subprocess.run(
        [CONTAINERS / "build", "--from", "ubuntu"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "--from takes debian or vllm-openai, not 'ubuntu'" in proc.stderr


def test_recipe_pins_hashes_runs_unprivileged_and_labels_its_inputs():
    instr = containerfile_instructions()
    runs = " ".join(rest for word, rest in instr if word == "RUN")
    for needed in ("--require-hashes", "--no-index", "--find-links /wheelhouse", "pip check",
                   "--invalidation-mode checked-hash"):  # fmt: skip
        assert needed in runs, needed
    users = [rest for word, rest in instr if word == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    labels = " ".join(rest for word, rest in instr if word == "LABEL")
    for key, arg in (("io.flashnext.vllm.version", "VLLM_VERSION"),
                     ("io.flashnext.series.sha256", "SERIES_SHA256"),
                     ("io.flashnext.lock.sha256", "LOCK_SHA256")):  # fmt: skip
        assert f"{key}=${{{arg}}}" in labels, key
    # The label is only as good as the checks behind it: the RUN steps compare the
    # lock's and the stamp's sha256 with the same args.
    assert "${LOCK_SHA256}" in runs and "${SERIES_SHA256}" in runs


def test_the_suite_ships_the_python_of_a_lock(test_image):
    """The test image is built on the same suite (testimage.BASE_SUITE)."""
    pins = tomllib.loads((REPO / "pins" / "vllm.toml").read_text())
    assert PYTHON in pins["lock"]
    root = debian_rootfs(SUITE, ("python3", "python3-venv", "ca-certificates"), CACHE)
    assert (root / "usr" / "bin" / f"python{PYTHON}").is_file()
    assert not (root / "var" / "lib" / "apt" / "lists").exists(), "apt lists left in the root"
    # ... and the Containerfile's venv path follows it.
    assert (
        f"/opt/flashnext/venv/lib/python{PYTHON}/site-packages"
        in (CONTAINERS / "Containerfile").read_text()
    )


# ------------------------------------------- the Containerfile's refusals, for real


def fake_vllm_wheel(dest: Path) -> Path:
    """vllm 0.33.0 by name and version, with the first file the series patches altered."""
    first = re.search(r"^\d{4}-\S+\.patch", SERIES.read_text(), re.M).group(0)
    first_patch = (SERIES.parent / first).read_text()
    target = re.search(r"^--- a/(vllm/\S+)", first_patch, re.M).group(1)
    files = {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.33.0'\n",
        target: "# not the stock file\n",
        "vllm-0.33.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n",
        "vllm-0.33.0.dist-info/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append("vllm-0.33.0.dist-info/RECORD,,")
    files["vllm-0.33.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in sorted(files.items()):
            zf.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), text)
    wheel = dest / "vllm-0.33.0-py3-none-any.whl"
    wheel.write_bytes(buf.getvalue())
    return wheel


@pytest.fixture(scope="module")
def product_base() -> str:
    """The product image's real base (suite + package set), in the tests' podman store."""
    if shutil.which("podman") is None:
        pytest.fail("podman is missing: run checks/containers/run (it installs podman)")
    return podman_image(debian_rootfs(SUITE, PACKAGES, CACHE), ("podman", *GLOBAL_FLAGS))


@pytest.fixture
def context(tmp_path) -> Path:
    """A build context as containers/build's, with a one-wheel lock and wheelhouse."""
    ctx = tmp_path / "ctx"
    (ctx / "pins").mkdir(parents=True)
    (ctx / "containers").mkdir()
    shutil.copytree(REPO / "patches", ctx / "patches")
    shutil.copy(CONTAINERS / "flashnext-health", ctx / "containers")
    (tmp_path / "wheels").mkdir()
    wheel = fake_vllm_wheel(tmp_path / "wheels")
    lock = f"vllm==0.33.0 \\\n    --hash=sha256:{sha256(wheel)}\n"
    (ctx / "pins" / "requirements-test.txt").write_text(lock)
    return ctx


def build(ctx: Path, base: str, volume: bool = True, **override: str):
    args = {
        "BASE": base,
        "LOCK": "requirements-test.txt",
        "LOCK_SHA256": sha256(ctx / "pins" / "requirements-test.txt"),
        "SERIES_SHA256": sha256(SERIES),
        "VLLM_VERSION": "0.33.0",
        "FLASHNEXT_VERSION": "0.0.0",
        **override,
    }
    argv = [
        "build",
        "--isolation",
        "chroot",
        "--layers=false",
        "-f",
        str(CONTAINERS / "Containerfile"),
    ]
    if volume:
        argv += ["--volume", f"{ctx.parent / 'wheels'}:/wheelhouse:ro"]
    for name, value in args.items():
        argv += ["--build-arg", f"{name}={value}"]
    proc = podman(*argv, str(ctx), check=False, timeout=300)
    return proc.returncode, proc.stdout.decode() + proc.stderr.decode()


def test_a_vllm_that_is_not_pristine_stops_the_build(product_base, context):
    rc, out = build(context, product_base)
    assert rc != 0
    assert "patches/apply: error: vllm/" in out, out[-2000:]
    assert "differs from stock vLLM 0.33.0" in out
    assert "STEP 11/" not in out, "the build went on past the series"


def test_no_wheelhouse_stops_the_build(product_base, context):
    rc, out = build(context, product_base, volume=False)
    assert rc != 0
    assert "no wheelhouse at /wheelhouse: use containers/build" in out, out[-2000:]


def test_a_lock_other_than_the_one_named_stops_the_build(product_base, context):
    rc, out = build(context, product_base, LOCK_SHA256="0" * 64)
    assert rc != 0
    assert "is not the lock whose sha256 LOCK_SHA256 names" in out, out[-2000:]


def test_a_wheel_with_another_hash_stops_the_build(product_base, context):
    lock = context / "pins" / "requirements-test.txt"
    lock.write_text(f"vllm==0.33.0 \\\n    --hash=sha256:{'ab' * 32}\n")
    rc, out = build(context, product_base)
    assert rc != 0
    assert "DO NOT MATCH THE HASHES" in out, out[-2000:]


# ------------------------------------------- containers/check-image on real images


def checkout_stamp() -> dict:
    """The stamp patches/apply writes for this checkout's series (its own code)."""
    loader = importlib.machinery.SourceFileLoader("patches_apply", str(REPO / "patches" / "apply"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[loader.name] = module  # its dataclasses look themselves up there
    loader.exec_module(module)
    version, patches = module.load(SERIES)
    return module.stamp_payload(version, SERIES, patches)


def image_with_stamp(base: str, stamp: dict, tmp_path: Path) -> str:
    """`base` + a vllm package holding `stamp` + the labels containers/build sets."""
    ctx = tmp_path / f"stamped-{len(stamp['patches'])}"
    (ctx / "vllm").mkdir(parents=True)
    (ctx / "vllm" / "__init__.py").write_text("")
    (ctx / "vllm" / "_flashnext_patches.json").write_text(json.dumps(stamp))
    args = build_args(dry_run())
    (ctx / "Containerfile").write_text(
        f"FROM {base}\nCOPY vllm /tmp/vllm\n"
        "RUN cp -r /tmp/vllm \"$(python3 -c 'import sysconfig; "
        'print(sysconfig.get_paths()["purelib"])\')"\n'
        f"LABEL io.flashnext.vllm.version={args['VLLM_VERSION']} "
        f"io.flashnext.series.sha256={args['SERIES_SHA256']} "
        f"io.flashnext.lock.sha256={args['LOCK_SHA256']} io.flashnext.lock.file={args['LOCK']}\n"
    )
    ref = (
        f"localhost/flashnext-stamped:{hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:12]}"
    )
    podman("build", "--isolation", "chroot", "--tag", ref, str(ctx))
    return ref


def check_image(ref: str, tmp_path: Path) -> subprocess.CompletedProcess:
    conf = tmp_path / "containers.conf"  # the host-safe ulimits podman_cli.RUN_FLAGS passes
    conf.write_text('[containers]\ndefault_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]\n')
    env = {**os.environ, "PODMAN_FLAGS": shlex.join(GLOBAL_FLAGS), "CONTAINERS_CONF": str(conf)}
    return subprocess.run(
        [CONTAINERS / "check-image", ref], capture_output=True, text=True, env=env, timeout=300
    )


def test_check_image_accepts_this_checkouts_stamp_and_names_a_stale_one(test_image, tmp_path):
    stamp = checkout_stamp()
    ref = image_with_stamp(test_image, stamp, tmp_path)
    try:
        proc = check_image(ref, tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert f"({len(stamp['patches'])} patches), labels: as this checkout" in proc.stdout
    finally:
        podman("rmi", "--force", ref, check=False)

    stale = dict(stamp, patches=stamp["patches"][:-1])  # an image built before the last patch
    ref = image_with_stamp(test_image, stale, tmp_path)
    try:
        proc = check_image(ref, tmp_path)
        assert proc.returncode == 1
        assert (
            "stamp patches" in proc.stderr and "differ from this checkout's series" in proc.stderr
        )
        assert "rebuild the image from this checkout: containers/build" in proc.stderr
    finally:
        podman("rmi", "--force", ref, check=False)


def test_check_image_refuses_an_image_without_a_patched_vllm(test_image, tmp_path):
    proc = check_image(test_image, tmp_path)
    assert proc.returncode == 1
    assert "cannot read the patch stamp: no vllm package in the image" in proc.stderr
    assert "label io.flashnext.series.sha256 is None" in proc.stderr
