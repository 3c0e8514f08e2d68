"""Storage probe: path → mount (/proc/self/mountinfo) → leaf block devices (/sys).

The PLE table is read with mmap page faults on every decode step, so what
matters is the medium under the file: a local NVMe disk, not a SATA SSD,
a spinning disk, a network filesystem or RAM. Partitions and dm/md stacks
(LUKS, LVM, RAID) are followed down to the physical disks ("leaves").

Roots are parameters so tests can point the probe at synthetic /proc and
/sys trees (checks/fixtures/sysfs/). `probe_storage` never raises.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from flashnext.facts.schema import BlockDevice, StorageFacts

# Filesystems whose data lives on another machine.
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "glusterfs",
        "fuse.glusterfs",
        "9p",
        "fuse.sshfs",
        "sshfs",
        "afs",
        "lustre",
        "gpfs",
        "beegfs",
        "fuse.s3fs",
        "fuse.rclone",
        "fuse.juicefs",
        "fuse.gcsfuse",
        "fuse.mountpoint-s3",
    }
)

# Filesystems with no block device of their own (memory, or layered on other mounts).
DEVICELESS_FS = frozenset(
    {"tmpfs", "ramfs", "overlay", "aufs", "devtmpfs", "proc", "sysfs", "fuse.lxcfs", "virtiofs"}
)

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape_mount_field(text: str) -> str:
    """Undo the kernel's octal escapes in mountinfo (space → \\040, tab, newline, backslash)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), text)


@dataclass(frozen=True)
class Mount:
    """One line of /proc/<pid>/mountinfo (see proc(5))."""

    mount_id: int
    parent_id: int
    major: int
    minor: int
    root: str
    """Directory of the filesystem mounted here ("/" unless a bind mount of a subdirectory)."""
    mount_point: str
    options: str
    fs_type: str
    source: str
    super_options: str


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse mountinfo text; malformed lines are skipped, not fatal."""
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        # Optional fields (shared:N, master:N, ...) vary in number; "-" ends them.
        try:
            sep = fields.index("-", 6)
            major, minor = fields[2].split(":")
            mounts.append(
                Mount(
                    mount_id=int(fields[0]),
                    parent_id=int(fields[1]),
                    major=int(major),
                    minor=int(minor),
                    root=unescape_mount_field(fields[3]),
                    mount_point=unescape_mount_field(fields[4]),
                    options=fields[5],
                    fs_type=fields[sep + 1],
                    source=unescape_mount_field(fields[sep + 2]),
                    super_options=fields[sep + 3] if len(fields) > sep + 3 else "",
                )
            )
        except (ValueError, IndexError):
            continue
    return mounts


def read_mountinfo(proc: str = "/proc") -> list[Mount]:
    with open(os.path.join(proc, "self", "mountinfo"), encoding="utf-8", errors="replace") as f:
        return parse_mountinfo(f.read())


def _is_under(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return True
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def find_mount(mounts: list[Mount], path: str) -> Mount | None:
    """The mount that holds absolute `path`: longest mount-point prefix.

    When several mounts share a mount point (stacked mounts), the last one in
    mountinfo order is the one on top, i.e. the one the path resolves to.
    """
    best: Mount | None = None
    for m in mounts:
        if _is_under(path, m.mount_point) and (
            best is None or len(m.mount_point) >= len(best.mount_point)
        ):
            best = m
    return best


def nearest_existing(path: str) -> str:
    """`path` made absolute with symlinks resolved, or its nearest existing ancestor."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return os.path.realpath(current)


# ---------------------------------------------------------------- block devices


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


class BlockTree:
    """Read-only view of /sys block devices under a given sysfs root."""

    def __init__(self, sys: str = "/sys") -> None:
        self.sys = sys

    def class_dir(self, name: str) -> str:
        return os.path.join(self.sys, "class", "block", name)

    def name_of(self, major: int, minor: int) -> str | None:
        """Kernel name ("nvme0n1p2", "dm-0") of device MAJ:MIN, via /sys/dev/block."""
        link = os.path.join(self.sys, "dev", "block", f"{major}:{minor}")
        if not os.path.exists(link):
            return None
        return os.path.basename(os.path.realpath(link))

    def name_of_source(self, source: str) -> str | None:
        """Kernel name from a mount source like /dev/sda1 or /dev/mapper/root (btrfs shows 0:N)."""
        if not source.startswith("/dev/"):
            return None
        base = os.path.basename(source)
        if source.startswith("/dev/mapper/"):
            for name in self._names():
                if _read(os.path.join(self.class_dir(name), "dm", "name")) == base:
                    return name
            return None
        return base if os.path.exists(self.class_dir(base)) else None

    def _names(self) -> list[str]:
        try:
            return sorted(os.listdir(os.path.join(self.sys, "class", "block")))
        except OSError:
            return []

    def whole_disk(self, name: str) -> str:
        """A partition's parent disk ("nvme0n1p2" → "nvme0n1"); other devices unchanged."""
        path = os.path.realpath(self.class_dir(name))
        if os.path.exists(os.path.join(path, "partition")):
            return os.path.basename(os.path.dirname(path))
        return name

    def leaves(self, name: str, _seen: frozenset[str] = frozenset()) -> list[str]:
        """Physical disks under `name`, following partitions and dm/md slaves recursively."""
        disk = self.whole_disk(name)
        if disk in _seen:  # a cycle cannot happen in a sane sysfs; do not loop if it does
            return []
        try:
            slaves = sorted(os.listdir(os.path.join(self.class_dir(disk), "slaves")))
        except OSError:
            slaves = []
        if not slaves:
            return [disk]
        found: list[str] = []
        for slave in slaves:
            for leaf in self.leaves(slave, _seen | {disk}):
                if leaf not in found:
                    found.append(leaf)
        return found

    def describe(self, name: str) -> BlockDevice:
        base = self.class_dir(name)
        rotational = _read(os.path.join(base, "queue", "rotational"))
        model = _read(os.path.join(base, "device", "model"))
        return BlockDevice(
            name=name,
            rotational=None if rotational not in ("0", "1") else rotational == "1",
            transport=self.transport(name),
            model=model or None,
        )

    def transport(self, name: str) -> str:
        """How the disk is attached, from its kernel name and its sysfs device path."""
        devpath = os.path.realpath(self.class_dir(name))
        parts = devpath.split("/")
        own = (_read(os.path.join(self.class_dir(name), "device", "transport")) or "").lower()
        if name.startswith("nvme") or "nvme" in parts:
            # NVMe over fabrics (tcp/rdma/fc) is remote storage that looks local.
            return "network" if own in ("tcp", "rdma", "fc") else "nvme"
        if name.startswith("loop"):
            return "loop"
        if name.startswith(("ram", "zram", "pmem")):
            return "ram"
        if name.startswith("mmcblk"):
            return "mmc"
        if name.startswith(("nbd", "rbd")):
            return "network"
        # USB before ATA/SCSI: a USB enclosure also shows a SCSI host in its path.
        if any(p.startswith("usb") for p in parts):
            return "usb"
        if name.startswith("vd") or any(p.startswith("virtio") for p in parts):
            return "virtio"
        if any(re.fullmatch(r"ata\d+", p) for p in parts) or own in ("sata", "ata"):
            return "sata"
        if any(p.startswith("session") for p in parts) or own == "iscsi":
            return "network"  # iSCSI
        if any(re.fullmatch(r"target\d+:\d+:\d+", p) for p in parts) or own in ("sas", "scsi"):
            return "scsi"
        return "unknown"


# ---------------------------------------------------------------- the probe


def _path_facts(path: str) -> dict[str, object]:
    try:
        st = os.stat(path)
    except OSError:
        return {"exists": os.path.lexists(path)}
    regular = os.path.isfile(path)
    mode = os.R_OK if regular else os.R_OK | os.X_OK  # a directory must also be listable
    return {
        "exists": True,
        "is_regular_file": regular,
        "size_bytes": st.st_size if regular else None,
        "readable": os.access(path, mode),
    }


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize  # what a non-root writer can still use


def probe_storage(
    path: str | os.PathLike[str], proc: str = "/proc", sys: str = "/sys"
) -> StorageFacts:
    """Facts about `path` and the storage under it. Never raises."""
    abspath = os.path.abspath(os.fspath(path))
    try:
        return _probe_storage(abspath, proc, sys)
    except Exception as exc:  # a probe reports, it does not crash the caller
        return StorageFacts(path=abspath, error=f"storage probe failed: {exc!r}")


def _probe_storage(abspath: str, proc: str, sys: str) -> StorageFacts:
    facts = _path_facts(abspath)
    anchor = nearest_existing(abspath)
    free = _free_bytes(anchor)
    try:
        mounts = read_mountinfo(proc)
    except OSError as exc:
        error = f"cannot read mountinfo: {exc}"
        return StorageFacts(path=abspath, free_bytes=free, error=error, **facts)
    mount = find_mount(mounts, anchor)
    if mount is None:
        return StorageFacts(
            path=abspath, free_bytes=free, error=f"no mount found for {anchor}", **facts
        )
    common = dict(
        path=abspath,
        mount_point=mount.mount_point,
        fs_type=mount.fs_type,
        mount_source=mount.source,
        free_bytes=free,
        **facts,
    )
    if mount.fs_type in NETWORK_FS:
        return StorageFacts(network=True, **common)
    if mount.fs_type in DEVICELESS_FS:
        return StorageFacts(**common)

    tree = BlockTree(sys)
    name = tree.name_of(mount.major, mount.minor) if mount.major else None
    if name is None:
        name = tree.name_of_source(mount.source)
    if name is None:
        try:  # last resort: the device number the kernel gives the file itself
            dev = os.stat(anchor).st_dev
            name = tree.name_of(os.major(dev), os.minor(dev)) if os.major(dev) else None
        except OSError:
            name = None
    if name is None:
        return StorageFacts(
            error=(
                f"no block device found for {mount.fs_type} mount {mount.mount_point} "
                f"(device {mount.major}:{mount.minor}, source {mount.source})"
            ),
            **common,
        )
    devices = tuple(_loop_in_ram(tree, tree.describe(leaf), mounts)
                    for leaf in tree.leaves(name))  # fmt: skip
    return StorageFacts(devices=devices, **common)


RAM_FS = frozenset({"tmpfs", "ramfs"})


def _loop_in_ram(tree: BlockTree, device: BlockDevice, mounts: list[Mount]) -> BlockDevice:
    """A loop device whose backing file lives on tmpfs (/dev/shm) is RAM, not a disk:
    `ram`, like zram; any other loop stays `loop`."""
    if device.transport != "loop":
        return device
    backing = _read(os.path.join(tree.class_dir(device.name), "loop", "backing_file"))
    if not backing:
        return device
    mount = find_mount(mounts, backing.removesuffix(" (deleted)"))
    if mount is None or mount.fs_type not in RAM_FS:
        return device
    return dataclasses.replace(device, transport="ram", rotational=False)
