#!/usr/bin/env python3
"""Shared libraries the wheels in a site-packages need but nothing will provide.

    elf-deps.py SITE_PACKAGES [--ignore PATTERN]...

What autoPatchelf will do in nix/vllm-env.nix, predicted without Nix: every
ELF file's DT_NEEDED must be a library somewhere in the tree (autoPatchelf
indexes the output's own libraries), one of the derivation's buildInputs
(glibc, the GCC runtime, zlib: BUILD_INPUT_LIBS), or match an ignore pattern
(fnmatch, as autoPatchelfIgnoreMissingDeps). Prints the rest, one line per
library with who needs it, and exits 1 if there are any: the Nix build
would stop there. Needs readelf (binutils). Run it on an env from
pins/build-env (same wheels as the Nix env, other Python ABI tag).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

# Sonames the buildInputs of nix/vllm-env.nix provide: glibc (stdenv),
# stdenv.cc.cc.lib (libstdc++, libgcc_s, libgomp, libatomic), zlib.
BUILD_INPUT_LIBS = frozenset(
    {
        "ld-linux-x86-64.so.2", "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2",
        "librt.so.1", "libutil.so.1", "libresolv.so.2",
        "libstdc++.so.6", "libgcc_s.so.1", "libgomp.so.1", "libatomic.so.1",
        "libz.so.1",
    }
)  # fmt: skip


def elf_files(root: Path):
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if ".so" not in name or path.is_symlink():
                continue
            with path.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    yield path


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]


def unresolved(root: Path, ignore: list[str]) -> dict[str, list[str]]:
    files = list(elf_files(root))
    present = {p.name for p in files}
    missing: dict[str, list[str]] = defaultdict(list)
    for path in files:
        for lib in needed(path):
            if lib in present or lib in BUILD_INPUT_LIBS:
                continue
            if any(fnmatch.fnmatchcase(lib, pattern) for pattern in ignore):
                continue
            missing[lib].append(str(path.relative_to(root)))
    return dict(missing)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site_packages", type=Path)
    parser.add_argument("--ignore", action="append", default=[], metavar="PATTERN")
    args = parser.parse_args(argv)
    if not args.site_packages.is_dir():
        print(f"elf-deps: {args.site_packages} is not a directory", file=sys.stderr)
        return 2
    missing = unresolved(args.site_packages, args.ignore)
    for lib, users in sorted(missing.items()):
        print(f"{lib}: needed by {len(users)} file(s), e.g. {sorted(users)[0]}")
    if missing:
        print(
            "elf-deps: add these to buildInputs (if nixpkgs has them and they are needed) or "
            "to autoPatchelfIgnoreMissingDeps in nix/vllm-env.nix (with the reason)",
            file=sys.stderr,
        )
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
