"""Build (or reuse) the pinned, patched vLLM env: the logic behind pins/build-env.

Steps: wheelhouse from the lock -> base venv installed offline with
--require-hashes (cached in base/, keyed by the pins and the interpreter) ->
env venv cloned from the base with hard links -> pristine copy of the vllm
tree -> patches/apply -> check the pristine copy is still pristine -> import
smoke of both trees -> publish.

Publishing is atomic and never moves a venv (venvs hard-code their path):
the env is built in `env/.<key>.<random>/` and published by atomically
replacing the symlink `env/<key>` to point at it (the base likewise in
base/). A build that dies leaves only an unlinked directory, which the next
build of that key deletes; a half-built env is never reused. A per-key
lock file serialises builders; its mtime is the key's last use. After a new
env (or base) is published, the least recently used ones beyond
KEEP_ENVS (KEEP_BASES) are deleted, so a dev machine that changes the series
often does not collect a ~48 MB env (or a ~9 GB base) per change.
"""

import base64
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import envkey, lockfile, meta, venvclone, wheelhouse
from .target import Target

MANIFEST = "flashnext-env.json"
MIN_FREE_BYTES = 14 * 2**30
# Published envs and bases kept per cache, the most recently used first. An
# env is ~48 MB of patched files over hard links into its base; a base is
# the ~9 GB install of one lock. Envs do not need their base to stay.
KEEP_ENVS = 4
KEEP_BASES = 2
"""Free space a fresh build needs: the venv measured 9.4 GB, the wheelhouse
~4.3 GB (less what seeding links in)."""

SMOKE_MODULE = "vllm.models.qwen4_exp"
SMOKE_CLASS = "Qwen4ExpForCausalLM"
_SMOKE = """
import importlib, json, os, sys
import vllm
want_version, want_root = sys.argv[1], sys.argv[2]
got_root = os.path.dirname(os.path.realpath(vllm.__file__))
if vllm.__version__ != want_version:
    sys.exit(f"vllm.__version__ is {vllm.__version__!r}, expected {want_version!r}")
if got_root != os.path.realpath(want_root):
    sys.exit(f"imported vllm from {got_root}, expected {want_root}")
module = importlib.import_module(sys.argv[3])
getattr(module, sys.argv[4])
print(json.dumps({"version": vllm.__version__, "root": got_root}))
"""


class BuildError(RuntimeError):
    """A build step failed; the message names the step and how to fix it."""


@dataclass(frozen=True)
class Layout:
    """Where one build reads its inputs and writes its outputs."""

    pins_dir: Path
    patches_dir: Path
    cache: Path

    @property
    def apply_script(self) -> Path:
        return self.patches_dir / "apply"

    @property
    def series_dir(self) -> Path:
        return self.patches_dir / "vllm-0.33.0"

    @property
    def env_root(self) -> Path:
        return self.cache / "env"


def log(message: str) -> None:
    print(f"build-env: {message}", file=sys.stderr, flush=True)


def interpreter_identity(python: str) -> tuple[str, str]:
    """(`X.Y`, identity string for the key) of a CPython, or BuildError."""
    code = (
        "import os, sys; print(sys.implementation.name, '%d.%d' % sys.version_info[:2], "
        "sys.version.split()[0], os.path.realpath(getattr(sys, '_base_executable', "
        "sys.executable)))"
    )
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise BuildError(f"cannot run --python {python}: {exc}") from None
    impl, minor, full, base = out.stdout.split(maxsplit=3)
    if impl != "cpython":
        raise BuildError(f"--python {python} is {impl}, the locks are for CPython")
    return minor, f"cpython {full} {base.strip()}"


def load_lock(layout: Layout, python_minor: str) -> tuple[meta.Meta, Path, bytes, list]:
    """The lock for this Python, checked against vllm.toml (catches hand edits)."""
    pins_meta = meta.load(layout.pins_dir)
    entry = pins_meta.lock_for(python_minor)
    lock_path = layout.pins_dir / entry.file
    data = lock_path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise BuildError(
            f"{lock_path} does not match the sha256 in {meta.FILE_NAME}; it was edited by "
            "hand: restore it (git checkout) or regenerate with pins/lock"
        )
    return pins_meta, lock_path, data, lockfile.parse(data.decode(), str(lock_path))


def check_apply_script(layout: Layout) -> None:
    script = layout.apply_script
    if not script.is_file():
        raise BuildError(
            f"{script} does not exist: the patch series tooling (owned by patches/) is "
            "missing from this checkout; update the checkout, the env cannot be patched"
        )
    if not os.access(script, os.X_OK):
        raise BuildError(f"{script} is not executable: chmod +x {script}")


@contextmanager
def key_lock(env_root: Path, key: str):
    """Hold an exclusive lock for building `key` (other builders wait).

    Touches the lock file: its mtime is when `key` was last asked for.
    """
    env_root.mkdir(parents=True, exist_ok=True)
    lock = env_root / f"{key}.lock"
    with open(lock, "a") as handle:
        os.utime(lock)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another build of {key} is running; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def prune_least_recently_used(root: Path, keep: int, current: str) -> list[str]:
    """Delete published keys in `root` beyond the `keep` most recently used.

    Never `current`, and never a key whose lock another process holds (it is
    being built, or pruned by someone else). Lock files stay: deleting one
    while a builder waits on it would let a second builder lock a new file.
    Returns the keys removed.
    """

    def last_used(link: Path) -> float:
        try:
            return (root / f"{link.name}.lock").stat().st_mtime
        except FileNotFoundError:
            return 0.0

    links = [p for p in root.iterdir() if p.is_symlink() and not p.name.startswith(".")]
    removed = []
    for link in sorted(links, key=last_used, reverse=True)[keep:]:
        if link.name == current:
            continue
        with open(root / f"{link.name}.lock", "a") as handle:  # "a": keeps the mtime
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            target = root / os.readlink(link)
            link.unlink()
            shutil.rmtree(target, ignore_errors=True)
        log(f"removed {root.name}/{link.name}, the least recently used beyond {keep}")
        removed.append(link.name)
    return removed


def published(env_root: Path, key: str) -> Path | None:
    """The env dir for `key` if a complete one is published, else None."""
    link = env_root / key
    manifest = link / MANIFEST
    if not link.is_symlink() or not manifest.is_file():
        return None
    try:
        if json.loads(manifest.read_text()).get("key") != key:
            return None
    except json.JSONDecodeError:
        return None
    return link if (link / "venv" / "bin" / "python").exists() else None


def remove_stale(env_root: Path, key: str) -> None:
    """Delete build dirs of `key` that no link points at (from dead builds)."""
    link = env_root / key
    current = os.readlink(link) if link.is_symlink() else None
    for path in env_root.glob(f".{key}.*"):
        if path.name != current and path.is_dir() and not path.is_symlink():
            log(f"removing unfinished build {path}")
            shutil.rmtree(path, ignore_errors=True)


def _clean_pip_env() -> dict[str, str]:
    """Environment for offline pip: no user/site config, no PIP_* overrides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def _run(step: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, **kwargs
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-25:])
        raise BuildError(f"{step} failed (exit {proc.returncode}):\n{tail}")
    return proc


def create_venv(python: str, venv: Path) -> None:
    _run("creating the venv", [python, "-m", "venv", str(venv)])


def install(venv: Path, lock_path: Path, wheels: Path) -> None:
    """Install the lock from the wheelhouse only; pip re-checks every hash."""
    _run(
        "installing the lock (offline, --require-hashes)",
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "--no-index",
            "--find-links",
            str(wheels),
            "--require-hashes",
            "--only-binary=:all:",
            "--no-cache-dir",
            "--disable-pip-version-check",
            "-r",
            str(lock_path),
        ],
        env=_clean_pip_env(),
    )


def site_packages(venv: Path) -> Path:
    found = sorted((venv / "lib").glob("python3.*/site-packages"))
    if len(found) != 1:
        raise BuildError(f"expected one site-packages under {venv}/lib, found {found}")
    return found[0]


def copy_pristine(site: Path, stock: Path) -> None:
    """ENV/stock/vllm: the unpatched tree, hard-linked (patch replaces, never edits)."""
    stock.mkdir()
    shutil.copytree(site / "vllm", stock / "vllm", copy_function=os.link, symlinks=True)


def record_mismatches(site: Path, tree: Path, version: str) -> list[str]:
    """Files of `tree`/vllm whose content differs from the wheel's RECORD."""
    record = site / f"vllm-{version}.dist-info" / "RECORD"
    problems = []
    for line in record.read_text().splitlines():
        path, _, rest = line.partition(",")
        digest, _, _size = rest.partition(",")
        if not path.startswith("vllm/") or not digest.startswith("sha256="):
            continue
        want = digest[len("sha256=") :]
        target = tree / path
        try:
            got = hashlib.sha256(target.read_bytes()).digest()
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if base64.urlsafe_b64encode(got).rstrip(b"=").decode() != want:
            problems.append(f"{path}: content differs from the wheel")
    return problems


def apply_patches(layout: Layout, site: Path) -> None:
    _run(f"{layout.apply_script} {site}", [str(layout.apply_script), str(site)])


def smoke(python: Path, vllm_root: Path, version: str, pythonpath: Path | None) -> dict:
    """Import vllm and the qwen4_exp model class in a fresh process on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = _run(
        f"import smoke of {vllm_root}",
        [str(python), "-c", _SMOKE, version, str(vllm_root), SMOKE_MODULE, SMOKE_CLASS],
        env=env,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_free_space(path: Path, need: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < need:
        raise BuildError(
            f"{path} has {free / 2**30:.1f} GiB free, a build needs {need / 2**30:.1f} GiB; "
            "free space or point FLASHNEXT_CACHE at a larger disk"
        )


def ensure_wheelhouse(layout, python, target, lock_path, lock_sha, pins, seed_dirs) -> Path:
    """The complete wheelhouse for this lock, filling it first if needed."""
    wheels = wheelhouse.path_for(layout.cache, lock_sha)
    if wheelhouse.is_complete(wheels, lock_sha):
        return wheels
    siblings = sorted(p for p in wheels.parent.glob("*") if p != wheels)
    taken = wheelhouse.seed(wheels, pins, [*seed_dirs, *siblings])
    missing = wheelhouse.missing(wheels, pins)
    log(f"wheelhouse {wheels}: {taken} wheels seeded, {len(missing)} to download")
    if missing:
        wheelhouse.download(python, target, lock_path, wheels)
    else:  # nothing for pip to check: hash what is there ourselves
        problems = wheelhouse.verify(wheels, pins)
        if problems:
            raise wheelhouse.WheelhouseError(
                f"{wheels} does not match the lock: "
                + "; ".join(problems[:5])
                + f"; delete {wheels} and rerun"
            )
    wheelhouse.mark_complete(wheels, lock_sha)
    return wheels


def build(
    layout: Layout,
    python: str,
    seed_dirs: list[Path],
    rebuild: bool = False,
    min_free_bytes: int = MIN_FREE_BYTES,
    keep_envs: int = KEEP_ENVS,
) -> Path:
    """Return the env dir for this lock + patch series, building it if needed.

    Two cached layers: the base (the lock installed, unpatched; keyed by the
    pins and the interpreter) and the env (a hard-link clone of the base with
    the series applied; keyed by the base and the patch inputs). A patch
    change costs a clone and the patching, not a 9 GB install.
    """
    minor, identity = interpreter_identity(python)
    pins_meta, lock_path, _, pins = load_lock(layout, minor)
    check_apply_script(layout)
    digest = lockfile.pins_digest(pins)
    key, inputs = envkey.env_key(digest, envkey.patch_inputs(layout.patches_dir), identity)
    env_root = layout.env_root
    with key_lock(env_root, key):
        hit = published(env_root, key)
        if hit is not None and not rebuild:
            log(f"cache hit {key}")
            return hit
        remove_stale(env_root, key)
        started = time.monotonic()
        base = ensure_base(
            layout,
            python,
            Target(minor, _glibc(pins_meta)),
            pins_meta,
            lock_path,
            pins,
            digest,
            identity,
            seed_dirs,
            rebuild,
            min_free_bytes,
        )
        build_dir = _new_build_dir(env_root, key)
        try:
            log(f"cloning the base {base.parent.name} (hard links)")
            try:
                venvclone.clone(python, base, build_dir / "venv")
            except (OSError, subprocess.CalledProcessError) as exc:
                raise BuildError(f"cloning the base {base} failed: {exc}") from None
            _patch_and_smoke(layout, build_dir, pins_meta.vllm_version, base)
            _write_manifest(build_dir, key, inputs, lock_path, pins_meta, started)
            _publish(env_root, key, build_dir)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        log(f"built {key} in {time.monotonic() - started:.0f} s")
        prune_least_recently_used(env_root, keep_envs, key)
        return env_root / key


def ensure_base(
    layout,
    python,
    target,
    pins_meta,
    lock_path,
    pins,
    digest,
    identity,
    seed_dirs,
    rebuild,
    min_free_bytes,
) -> Path:
    """The real path of the base venv (the lock installed, unpatched), building it if needed."""
    key, inputs = envkey.base_key(digest, identity)
    root = layout.cache / "base"
    with key_lock(root, key):
        hit = published(root, key)
        if hit is not None and not rebuild:
            log(f"base cache hit {key}")
            return (hit / "venv").resolve()
        remove_stale(root, key)
        check_free_space(root, min_free_bytes)
        started = time.monotonic()
        wheels = ensure_wheelhouse(layout, python, target, lock_path, digest, pins, seed_dirs)
        build_dir = _new_build_dir(root, key)
        try:
            venv = build_dir / "venv"
            log("creating the base venv")
            create_venv(python, venv)
            log(f"installing {lock_path.name} from the wheelhouse")
            install(venv, lock_path, wheels)
            _write_manifest(build_dir, key, inputs, lock_path, pins_meta, started)
            _publish(root, key, build_dir)
        except BaseException:
            shutil.rmtree(build_dir, ignore_errors=True)
            raise
        log(f"built base {key} in {time.monotonic() - started:.0f} s")
        prune_least_recently_used(root, KEEP_BASES, key)
        return (root / key / "venv").resolve()


def _new_build_dir(root: Path, key: str) -> Path:
    build_dir = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    build_dir.chmod(0o755)  # mkdtemp makes it private; the env is for every user
    return build_dir


def _write_manifest(build_dir, key, inputs, lock_path, pins_meta, started) -> None:
    manifest = {
        "key": key,
        "inputs": inputs,
        "lock": lock_path.name,
        "vllm_version": pins_meta.vllm_version,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (build_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _glibc(pins_meta: meta.Meta) -> tuple[int, int]:
    major, minor = pins_meta.glibc.split(".")
    return int(major), int(minor)


def _patch_and_smoke(layout, build_dir, version, base: Path) -> None:
    venv = build_dir / "venv"
    site = site_packages(venv)
    log("copying the pristine vllm tree to stock/")
    copy_pristine(site, build_dir / "stock")
    log(f"applying the patch series: {layout.apply_script} {site}")
    apply_patches(layout, site)
    problems = record_mismatches(site, build_dir / "stock", version)
    if problems:
        # The files are shared with the base: it is no longer pristine either.
        base_link = base.parent.parent / base.parent.name.split(".")[1]
        base_link.unlink(missing_ok=True)
        raise BuildError(
            "stock/vllm no longer matches the wheel after patching (patches/apply edited "
            "hard-linked files in place; it must replace files, as GNU patch does; the "
            "shared base was dropped and will be reinstalled): " + "; ".join(problems[:5])
        )
    log("import smoke: patched tree")
    smoke(venv / "bin" / "python", site / "vllm", version, None)
    log("import smoke: stock tree")
    smoke(venv / "bin" / "python", build_dir / "stock" / "vllm", version, build_dir / "stock")


def _publish(env_root: Path, key: str, build_dir: Path) -> None:
    """Point env/<key> at build_dir in one rename."""
    tmp_link = env_root / f".{key}.link"
    tmp_link.unlink(missing_ok=True)
    os.symlink(build_dir.name, tmp_link)
    old = os.readlink(env_root / key) if (env_root / key).is_symlink() else None
    os.replace(tmp_link, env_root / key)
    if old and old != build_dir.name:
        shutil.rmtree(env_root / old, ignore_errors=True)
