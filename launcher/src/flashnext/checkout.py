"""The flashnext checkout this launcher runs from, when it runs from one.

`./flashnext` imports the package straight from `launcher/src` of a checkout, so
the patch series (`patches/vllm-<pin>/series`) and the env builder
(`pins/build-env`) are found beside it. The Nix package and the image install the
launcher elsewhere and carry their vLLM env: there is no checkout, and nothing is
built at run time.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from flashnext import VLLM_VERSION

BUILD_ENV = "pins/build-env"
"""The pinned env builder, relative to the checkout (pins/README.md)."""

# pins/README.md ("Measured here"): what a first `pins/build-env` costs.
BUILD_DOWNLOAD_TEXT = "about 4 GB of wheels"
BUILD_INSTALLED_TEXT = "9.4 GB installed"
BUILD_CACHE_TEXT = "about 15 GB of cache"


@dataclass(frozen=True)
class Checkout:
    root: Path

    @property
    def series_dir(self) -> Path:
        return self.root / "patches" / f"vllm-{VLLM_VERSION}"

    @property
    def build_env(self) -> Path | None:
        """pins/build-env, when this copy of the checkout has it (a source subset may not)."""
        path = self.root / BUILD_ENV
        return path if path.is_file() else None


def find_checkout(start: Path | None = None) -> Checkout | None:
    """The checkout holding this module (or `start`): the first parent with the patch
    series beside launcher/. None for an installed launcher."""
    here = (start or Path(__file__)).resolve()
    for parent in here.parents:
        c = Checkout(parent)
        if (c.series_dir / "series").is_file() and (parent / "launcher").is_dir():
            return c
    return None


def series_patches(series_dir: Path) -> tuple[tuple[str, str], ...]:
    """(name, sha256) of each patch `series` lists, in order: what patches/apply stamps.

    Raises OSError when the series or a patch cannot be read."""
    out = []
    for line in (series_dir / "series").read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            out.append((name, hashlib.sha256((series_dir / name).read_bytes()).hexdigest()))
    return tuple(out)
