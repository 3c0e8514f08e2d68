#!/usr/bin/env python3
"""The Nix derivations' way into pins/: pins/build-env's own steps, into a Nix output.

    build-vllm-env.py wheelhouse DEST [--python-version X.Y] [--seed DIR]...
                                         pip download the lock into DEST (the
                                         fixed-output step; nix/update-wheelhouse-hash)
    build-vllm-env.py install OUT WHEELS venv, offline --require-hashes install,
                                         stock copy, patches/apply, RECORD check
    build-vllm-env.py smoke OUT          the patched tree carries patches/apply's stamp
                                         for exactly this series, the stock tree none;
                                         import smoke of both trees (after autoPatchelf)
    build-vllm-env.py interface          only check that pins/ still offers these steps

Run from the source root (pins/ and patches/ beside nix/) with the CPython the
env is for; the lock is the one pins/vllm.toml names for that Python. Every
step is a function of pins/pinkit (the code behind pins/build-env), so CI's
env and the Nix env are built by the same code. What is left out is only
pins/build-env's cache (key, lock file, symlink publishing): a Nix output is
already a path named by its inputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "pins"))

from pinkit import buildenv, lockfile, meta, wheelhouse  # noqa: E402
from pinkit.target import Target  # noqa: E402

# What this script calls in pinkit; `interface` checks they are still there.
USES = {
    buildenv: (
        "Layout", "load_lock", "check_apply_script", "create_venv", "install",
        "site_packages", "copy_pristine", "apply_patches", "record_mismatches", "smoke",
    ),
    wheelhouse: ("seed", "missing", "download", "verify", "WheelhouseError"),
    lockfile: ("parse", "LockError"),
    meta: ("MetaError",),
}  # fmt: skip


# patches/apply writes this into the tree it patched (vllm/<STAMP_NAME>): the
# series it applied, each patch's sha256, the series file's sha256. Importing
# the model class proves nothing about patching (stock vLLM 0.33.0 has
# qwen4_exp too); the stamp is what tells a patched tree from a stock one.
STAMP_NAME = "_flashnext_patches.json"


class StepError(RuntimeError):
    pass


def layout() -> buildenv.Layout:
    # The cache is unused by these steps; the build's temp dir keeps it out of $out.
    return buildenv.Layout(ROOT / "pins", ROOT / "patches", Path(tempfile.gettempdir()))


def minor() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def fetch_wheelhouse(dest: Path, python_version: str, seeds: list[Path]) -> None:
    """Exactly the locked wheels in DEST, nothing else (its NAR hash is pinned)."""
    pins_meta, lock_path, _, pins = buildenv.load_lock(layout(), python_version)
    glibc = tuple(int(part) for part in pins_meta.glibc.split("."))
    dest.mkdir(parents=True)
    if seeds:
        wheelhouse.seed(dest, pins, seeds)
    if wheelhouse.missing(dest, pins):
        wheelhouse.download(sys.executable, Target(python_version, glibc), lock_path, dest)
    problems = wheelhouse.verify(dest, pins)
    if problems:
        raise StepError(f"{dest} does not match {lock_path.name}: " + "; ".join(problems[:5]))


def install(out: Path, wheels: Path) -> None:
    lay = layout()
    pins_meta, lock_path, _, _ = buildenv.load_lock(lay, minor())
    buildenv.check_apply_script(lay)
    venv = out / "venv"
    buildenv.create_venv(sys.executable, venv)
    buildenv.install(venv, lock_path, wheels)
    site = buildenv.site_packages(venv)
    buildenv.copy_pristine(site, out / "stock")
    buildenv.apply_patches(lay, site)
    problems = buildenv.record_mismatches(site, out / "stock", pins_meta.vllm_version)
    if problems:
        raise StepError("stock/vllm changed while patching: " + "; ".join(problems[:5]))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def series_patches(series: Path) -> list[str]:
    names = []
    for line in series.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            names.append(name)
    return names


def stamp_problems(lay: buildenv.Layout, site: Path, stock: Path, version: str) -> list[str]:
    """Why OUT is not this series applied to this vLLM ([] when it is)."""
    stamp_path = site / "vllm" / STAMP_NAME
    if not stamp_path.is_file():
        return [
            f"{stamp_path} is missing: the patch series was not applied "
            f"(install must run {lay.apply_script} on {site})"
        ]
    try:
        stamp = json.loads(stamp_path.read_text())
        got = [(p["name"], p["sha256"]) for p in stamp["patches"]]
        got_series, got_version = stamp["series_sha256"], stamp["vllm_version"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{stamp_path} is not a patches/apply stamp ({exc!r})"]
    series = lay.series_dir / "series"
    want = [(name, sha256_file(lay.series_dir / name)) for name in series_patches(series)]
    problems = []
    if got != want:
        problems.append(
            f"{stamp_path} lists {[n for n, _ in got]} (with their sha256), {series} "
            f"names {[n for n, _ in want]}: the tree was patched with another series"
        )
    if got_series != sha256_file(series):
        problems.append(f"{stamp_path}: series_sha256 is not the sha256 of {series}")
    if got_version != version:
        problems.append(f"{stamp_path}: vllm_version is {got_version!r}, the pins say {version!r}")
    if (stock / "vllm" / STAMP_NAME).exists():
        problems.append(f"{stock / 'vllm' / STAMP_NAME} exists: the stock tree was patched")
    return problems


def smoke(out: Path) -> None:
    lay = layout()
    pins_meta, _, _, _ = buildenv.load_lock(lay, minor())
    version = pins_meta.vllm_version
    python = out / "venv" / "bin" / "python"
    site = buildenv.site_packages(out / "venv")
    problems = stamp_problems(lay, site, out / "stock", version)
    if problems:
        raise StepError("; ".join(problems))
    buildenv.smoke(python, site / "vllm", version, None)
    buildenv.smoke(python, out / "stock" / "vllm", version, out / "stock")


def interface() -> None:
    missing = [f"{mod.__name__}.{name}" for mod, names in USES.items() for name in names
               if not hasattr(mod, name)]  # fmt: skip
    if missing:
        raise StepError(
            f"pins/pinkit no longer has {', '.join(missing)}: update nix/build-vllm-env.py "
            "to the new pins/build-env steps"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="build-vllm-env.py", description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    fetch = steps.add_parser("wheelhouse", help="download the locked wheels into DEST")
    fetch.add_argument("dest", type=Path)
    fetch.add_argument("--python-version", default=minor(), help="lock to fetch (default: ours)")
    fetch.add_argument("--seed", type=Path, action="append", default=[], metavar="DIR")
    inst = steps.add_parser("install", help="venv + install + stock copy + patches/apply")
    inst.add_argument("out", type=Path)
    inst.add_argument("wheels", type=Path)
    steps.add_parser("smoke", help="patch stamp check, import smoke of both trees").add_argument(
        "out", type=Path
    )
    steps.add_parser("interface", help="check pins/pinkit still has the steps")
    args = parser.parse_args(argv)
    try:
        if args.step == "wheelhouse":
            fetch_wheelhouse(args.dest, args.python_version, args.seed)
        elif args.step == "install":
            install(args.out, args.wheels)
        elif args.step == "smoke":
            smoke(args.out)
        else:
            interface()
    except (
        StepError,
        buildenv.BuildError,
        wheelhouse.WheelhouseError,
        meta.MetaError,
        lockfile.LockError,
    ) as exc:
        print(f"build-vllm-env: {args.step}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
