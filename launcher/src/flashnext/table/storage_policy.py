"""Which filesystems the flat table must not live on, judged from StorageFacts (pure).

Decode reads 16 random 320-byte rows per token from the table. A spinning disk
does ~100 random reads/s, a network filesystem adds a round trip per page fault,
and tmpfs/overlay keep the 95 GiB in RAM or in a container's writable layer.
"""

from __future__ import annotations

from flashnext.facts.schema import StorageFacts
from flashnext.units import size

IN_MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs"}
LAYERED_FS = {"overlay", "overlayfs", "aufs", "fuse-overlayfs"}


def storage_refusal(facts: StorageFacts) -> str | None:
    """Why the table must not go to this filesystem, or None when it is fine."""
    where = f"{facts.path} (mount {facts.mount_point or '?'}, {facts.fs_type or '?'})"
    if facts.error and facts.fs_type is None:
        return f"{where}: storage probe failed ({facts.error}); cannot tell the medium"
    if facts.network:
        return f"{where} is a network filesystem: every cold row is a network round trip"
    if facts.fs_type in IN_MEMORY_FS:
        return (
            f"{where} lives in RAM: the 95 GiB table would use the host memory it is meant to save"
        )
    in_ram = [d.name for d in facts.devices if d.transport == "ram"]
    if in_ram:
        return (
            f"{where} is on {', '.join(in_ram)}, a block device in RAM (a loop over tmpfs, "
            "zram): the 95 GiB table would use the host memory it is meant to save"
        )
    if facts.fs_type in LAYERED_FS:
        return (
            f"{where} is an overlay (container writable layer): mount a host NVMe directory instead"
        )
    if facts.rotational:
        disks = ", ".join(d.name for d in facts.devices if d.rotational) or "?"
        return f"{where} is on a rotational disk ({disks}): random row reads would stall decode"
    return None


def space_refusal(facts: StorageFacts, needed_bytes: int) -> str | None:
    """Why there is not enough room for the table, or None."""
    if facts.free_bytes is not None and facts.free_bytes < needed_bytes:
        return (
            f"{facts.mount_point or facts.path} has {size(facts.free_bytes)} free, "
            f"the table needs {size(needed_bytes)} more"
        )
    return None
