"""Bytes and seconds as people read them: the bottom layer, imported by everything that
prints a size (sizes are bytes everywhere else; GiB = 2^30 only when printing)."""

from __future__ import annotations

GIB = 1 << 30


def gib(n: int | None) -> str:
    """Bytes → "21.71 GiB"; None → "-"."""
    return "-" if n is None else f"{n / GIB:.2f} GiB"


def size(n: int | None) -> str:
    """Bytes in the unit that keeps small limits readable: "64 KiB", "8 MiB", "3.96 GiB"."""
    if n is None:
        return "-"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            value = n / (1 << shift)
            return f"{value:.2f} {unit}" if unit == "GiB" else f"{value:.0f} {unit}"
    return f"{n} B"
