"""What a lock is for: one CPython minor version on x86_64 manylinux, wheels only."""

import re
from dataclasses import dataclass

PYTHONS = ("3.11", "3.12")
"""CPython versions we lock: 3.11 is CI's, 3.12 the image's."""

GLIBC_FLOOR = (2, 31)
"""Oldest glibc the lock must install on. llguidance 1.7 (required by vllm 0.33.0
on x86_64) ships only manylinux_2_31 wheels, so nothing older can work; locking
at the floor keeps the lock valid on every newer host (Ubuntu 22.04, Debian 12,
nixpkgs), because pip's hash check only accepts the locked file."""

# Legacy manylinux aliases pip lists right after the PEP 600 tag they equal.
_LEGACY_ALIAS = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


class TargetError(ValueError):
    """A python version or glibc we cannot lock for."""


@dataclass(frozen=True)
class Target:
    """A CPython version on x86_64 Linux with glibc >= `glibc`."""

    python: str
    """`X.Y`, e.g. "3.12"."""
    glibc: tuple[int, int] = GLIBC_FLOOR
    """Oldest glibc (major, minor) the chosen wheels must run on."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"3\.\d{1,2}", self.python):
            raise TargetError(f"python version must look like 3.12, got {self.python!r}")
        if self.glibc[0] != 2 or not 5 <= self.glibc[1] <= 99:
            raise TargetError(f"glibc must be 2.5 .. 2.99, got {self.glibc!r}")

    @property
    def tag(self) -> str:
        """`cp312` for 3.12: names the lock file."""
        return "cp" + self.python.replace(".", "")

    @property
    def lock_name(self) -> str:
        return f"requirements-{self.tag}.txt"

    def platforms(self) -> list[str]:
        """manylinux tags from the floor down, in pip's own preference order.

        pip 23 does not expand `--platform manylinux_2_31_x86_64` to the older
        tags a glibc 2.31 host also accepts, so all of them are listed.
        """
        tags = []
        for minor in range(self.glibc[1], 4, -1):
            tags.append(f"manylinux_2_{minor}_x86_64")
            if minor in _LEGACY_ALIAS:
                tags.append(f"{_LEGACY_ALIAS[minor]}_x86_64")
        return tags

    def pip_target_args(self) -> list[str]:
        """pip options that select wheels for this target whatever host runs pip."""
        args = ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python]
        for platform in self.platforms():
            args += ["--platform", platform]
        return args


def parse_glibc(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", text.strip())
    if match is None:
        raise TargetError(f"glibc must look like 2.31, got {text!r}")
    return int(match[1]), int(match[2])
