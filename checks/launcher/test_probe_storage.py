"""Storage probe: mountinfo parsing, sysfs walking on synthetic trees, and this machine's disks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from flashnext.facts.storage import (
    find_mount,
    nearest_existing,
    parse_mountinfo,
    probe_storage,
    unescape_mount_field,
)

SYSFS = Path(__file__).resolve().parents[1] / "fixtures" / "sysfs"


# ---------------------------------------------------------------- mountinfo


def test_parse_mountinfo_fields_optional_tags_and_escapes():
    text = (
        "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 shared:7 - ext3 /dev/root "
        "rw,errors=continue\n"
        "40 27 0:45 / /srv/my\\040data rw,relatime - nfs4 server:/export\\040x rw,vers=4.2\n"
        "41 27 0:46 / /no-optional rw - tmpfs tmpfs rw\n"
        "garbage line\n"
    )
    a, b, c = parse_mountinfo(text)
    assert (a.mount_id, a.parent_id, a.major, a.minor) == (36, 35, 98, 0)
    assert (a.root, a.mount_point, a.fs_type, a.source) == (
        "/mnt1",
        "/mnt/parent",
        "ext3",
        "/dev/root",
    )
    assert a.super_options == "rw,errors=continue"
    assert (b.mount_point, b.fs_type, b.source) == (
        "/srv/my data",
        "nfs4",
        "server:/export x",
    )
    assert (c.mount_point, c.fs_type) == ("/no-optional", "tmpfs")


def test_unescape_tab_newline_backslash():
    assert unescape_mount_field(r"a\011b\012c\134d") == "a\tb\nc\\d"


def test_find_mount_longest_prefix_by_component_and_stacking():
    mounts = parse_mountinfo(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
        "2 1 8:2 / /data rw - ext4 /dev/sda2 rw\n"
        "3 1 0:50 / /data rw - tmpfs tmpfs rw\n"  # mounted over /data: this one is visible
        "4 1 8:3 / /database rw - ext4 /dev/sda3 rw\n"
    )
    assert find_mount(mounts, "/data/x").mount_id == 3
    assert find_mount(mounts, "/data").mount_id == 3
    assert find_mount(mounts, "/database/y").mount_id == 4
    assert find_mount(mounts, "/datax").mount_id == 1  # a string prefix is not a parent dir


def test_nearest_existing_resolves_symlinks(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert nearest_existing(str(tmp_path / "link" / "not" / "yet")) == str(tmp_path / "real")


# ---------------------------------------------------------------- synthetic trees

CASES = {
    # case: (fs type, source, leaves as (name, transport, rotational, model), medium)
    "nvme_partition": (
        "ext4",
        "/dev/nvme0n1p2",
        [("nvme0n1", "nvme", False, "SYNTHETIC NVME SSD 2TB")],
        "nvme",
    ),
    "dm_crypt_lvm_nvme": (
        "btrfs",
        "/dev/mapper/vg0-root",
        [("nvme0n1", "nvme", False, "SYNTHETIC NVME SSD 2TB")],
        "nvme",
    ),
    "md_raid1_nvme": (
        "xfs",
        "/dev/md0",
        [
            ("nvme0n1", "nvme", False, "SYNTHETIC NVME SSD 2TB"),
            ("nvme1n1", "nvme", False, "SYNTHETIC NVME SSD 2TB"),
        ],
        "nvme",
    ),
    "sata_ssd": (
        "ext4",
        "/dev/sda1",
        [("sda", "sata", False, "SYNTHETIC SATA SSD")],
        "sata",
    ),
    "sata_hdd": (
        "ext4",
        "/dev/sdb1",
        [("sdb", "sata", True, "SYNTHETIC SATA HDD 7200")],
        "sata",
    ),
    "usb_disk": (
        "exfat",
        "/dev/sdc1",
        [("sdc", "usb", False, "SYNTHETIC USB SSD")],
        "usb",
    ),
    "virtio": ("ext4", "/dev/vda1", [("vda", "virtio", True, None)], "virtio"),
    # issue 39 class 5: an image in /dev/shm on loop0 is RAM, not a disk
    "loop_on_tmpfs": ("ext4", "/dev/loop0", [("loop0", "ram", False, None)], "ram"),
    "loop_on_disk": ("ext4", "/dev/loop1", [("loop1", "loop", False, None)], "loop"),
    "nvme_tcp": (
        "xfs",
        "/dev/nvme1n1",
        [("nvme1n1", "network", False, "SYNTHETIC NVMEOF TARGET")],
        "network",
    ),
}


def probe_in(case: str, path: str | os.PathLike[str], proc: Path | None = None):
    root = SYSFS / case
    return probe_storage(path, proc=str(proc or root / "proc"), sys=str(root / "sys"))


@pytest.mark.parametrize("case", sorted(CASES))
def test_synthetic_tree_resolves_to_leaf_disks(case, tmp_path):
    fs_type, source, leaves, medium = CASES[case]
    table = tmp_path / "ple.bin"
    table.write_bytes(b"\0" * 4096)
    facts = probe_in(case, table)
    assert facts.error is None
    assert (facts.mount_point, facts.fs_type, facts.mount_source) == (
        "/",
        fs_type,
        source,
    )
    assert [(d.name, d.transport, d.rotational, d.model) for d in facts.devices] == leaves
    assert facts.transport == medium
    assert facts.rotational is any(rot for _, _, rot, _ in leaves)
    assert facts.network is False
    # The file's own facts come from the real file, whatever tree describes the disk.
    assert (facts.exists, facts.is_regular_file, facts.size_bytes, facts.readable) == (
        True,
        True,
        4096,
        True,
    )
    st = os.statvfs(tmp_path)  # others write to this disk meanwhile: allow some drift
    assert facts.free_bytes == pytest.approx(st.f_bavail * st.f_frsize, abs=256 << 20)


def test_fixture_trees_are_current(tmp_path):
    """The committed trees are exactly what build.py writes (edit build.py, then rerun it)."""
    subprocess.run([sys.executable, str(SYSFS / "build.py"), str(tmp_path)], check=True)
    for case in CASES:
        assert _tree(tmp_path / case) == _tree(SYSFS / case), f"rerun {SYSFS / 'build.py'}"


def _tree(base: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in filenames + dirnames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(base))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = p.read_text()
    return out


def _proc_with(tmp_path: Path, *lines: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    return proc


def test_dm_stack_by_major_minor(tmp_path):
    proc = _proc_with(tmp_path, "27 1 254:1 / / rw - ext4 /dev/mapper/vg0-root rw")
    facts = probe_in("dm_crypt_lvm_nvme", tmp_path, proc)
    assert [d.name for d in facts.devices] == ["nvme0n1"]


def test_bind_mount_resolves_like_its_source(tmp_path):
    # A bind mount of a subdirectory: root field is the subdirectory, device is the partition.
    data = tmp_path / "data"
    data.mkdir()
    proc = _proc_with(
        tmp_path,
        "27 1 8:1 / / rw - ext4 /dev/sda1 rw",
        f"90 27 259:2 /srv/models {data} rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw",
    )
    facts = probe_in("nvme_partition", data / "model", proc)
    assert facts.mount_point == str(data)
    assert facts.exists is False
    assert [(d.name, d.transport) for d in facts.devices] == [("nvme0n1", "nvme")]


@pytest.mark.parametrize(
    ("fs_type", "source", "network"),
    [
        ("nfs4", "fileserver:/export/models", True),
        ("cifs", "//nas/share", True),
        ("fuse.sshfs", "me@host:/data", True),
        ("9p", "hostshare", True),
        ("ceph", "10.0.0.1:6789:/", True),
        ("tmpfs", "tmpfs", False),
        ("overlay", "overlay", False),
        ("ramfs", "ramfs", False),
    ],
)
def test_network_and_deviceless_filesystems(tmp_path, fs_type, source, network):
    mnt = tmp_path / "mnt point"  # a space, escaped as \040 in mountinfo
    mnt.mkdir()
    escaped = str(mnt).replace(" ", "\\040")
    proc = _proc_with(
        tmp_path,
        "27 1 259:2 / / rw - ext4 /dev/nvme0n1p2 rw",
        f"91 27 0:77 / {escaped} rw,relatime - {fs_type} {source} rw",
    )
    facts = probe_in("nvme_partition", mnt / "table.bin", proc)
    assert facts.error is None
    assert (facts.mount_point, facts.fs_type, facts.mount_source) == (
        str(mnt),
        fs_type,
        source,
    )
    assert facts.network is network
    assert facts.devices == ()
    assert facts.transport == ("network" if network else "none")


def test_unknown_device_is_an_error_not_a_crash(tmp_path):
    proc = _proc_with(tmp_path, "27 1 8:99 / / rw - ext4 /dev/sdz9 rw")
    facts = probe_in("nvme_partition", tmp_path, proc)
    assert facts.devices == ()
    assert facts.fs_type == "ext4"
    assert "no block device found for ext4 mount /" in facts.error


def test_missing_mountinfo_is_an_error_not_a_crash(tmp_path):
    facts = probe_storage(tmp_path, proc=str(tmp_path / "no-proc"), sys=str(tmp_path / "no-sys"))
    assert facts.exists is True
    assert facts.mount_point is None
    assert facts.error.startswith("cannot read mountinfo:")


# ---------------------------------------------------------------- this machine


def _findmnt(path: str) -> tuple[str, str, str]:
    out = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET,FSTYPE,SOURCE", "--target", path],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], out[1], out[2]


@pytest.mark.skipif(shutil.which("findmnt") is None, reason="util-linux findmnt not installed")
def test_real_work_disk_resolves():
    here = str(Path(__file__).resolve())
    facts = probe_storage(here)
    target, fstype, source = _findmnt(here)
    assert facts.error is None
    assert (facts.mount_point, facts.fs_type) == (target, fstype)
    assert facts.mount_source == source
    assert facts.is_regular_file and facts.readable
    assert facts.size_bytes == os.path.getsize(here)
    assert facts.devices, "a real disk-backed mount must resolve to at least one leaf device"
    assert all(d.transport != "unknown" for d in facts.devices), facts.devices
    if shutil.which("lsblk") and source.startswith("/dev/"):
        # lsblk walks the same stack independently (-s: from the device down to its disks).
        listed = subprocess.run(
            ["lsblk", "-s", "-n", "-r", "-o", "NAME,TYPE,ROTA", source],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\n")
        disks = {
            name: rota == "1"
            for name, kind, rota in (line.split() for line in listed if line.strip())
            if kind == "disk"
        }
        assert {d.name: d.rotational for d in facts.devices} == disks


def test_real_dev_shm_is_tmpfs_without_devices():
    facts = probe_storage("/dev/shm")
    assert facts.fs_type == "tmpfs"
    assert facts.devices == ()
    assert facts.transport == "none"
    assert facts.network is False
    st = os.statvfs("/dev/shm")
    assert facts.free_bytes == pytest.approx(st.f_bavail * st.f_frsize, abs=256 << 20)


# ---------------------------------------------------------------- real mounts, private namespace

PROBE_CHILD = (
    "import dataclasses, json, sys\n"
    "from flashnext.facts.storage import probe_storage\n"
    "print(json.dumps([dataclasses.asdict(probe_storage(p)) for p in sys.argv[1:]]))\n"
)


def _in_private_mounts(tmp_path: Path, setup: str, *paths: str) -> list[dict]:
    """Run `setup` (shell) in a new mount namespace, then probe `paths` from Python there.

    The mounts vanish with the namespace; nothing is left on the host.
    """
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare not installed")
    script = f'set -e\n{setup}\nexec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", script, "bash"]
        + [sys.executable, "-c", PROBE_CHILD, *paths],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot make private mounts here: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout)


def test_real_tmpfs_with_a_space_and_a_bind_mount(tmp_path):
    spaced = tmp_path / "mnt x"
    bound = tmp_path / "bound"
    source = Path(__file__).resolve().parent
    setup = (
        f'mkdir -p "{spaced}" "{bound}"\n'
        f'mount -t tmpfs -o size=16m flashnext-test "{spaced}"\n'
        f'mount --bind "{source}" "{bound}"'
    )
    tmpfs, bind, original = _in_private_mounts(
        tmp_path, setup, str(spaced / "table.bin"), str(bound / "x"), str(source)
    )
    assert (tmpfs["mount_point"], tmpfs["fs_type"], tmpfs["mount_source"]) == (
        str(spaced),
        "tmpfs",
        "flashnext-test",
    )
    assert tmpfs["devices"] == [] and tmpfs["free_bytes"] == 16 << 20
    # A bind mount reaches the same disk as the directory it shows.
    assert bind["mount_point"] == str(bound)
    assert bind["devices"] == original["devices"] != []
    assert bind["fs_type"] == original["fs_type"]


def test_real_loop_device(tmp_path):
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("e2fsprogs not installed")
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    setup = f'mkdir -p "{mnt}"\nmount -o loop "{image}" "{mnt}"'
    (facts,) = _in_private_mounts(tmp_path, setup, str(mnt / "ple.bin"))
    assert facts["fs_type"] == "ext4"
    assert facts["mount_source"].startswith("/dev/loop")
    (device,) = facts["devices"]
    assert device["transport"] == "loop"
    assert device["name"] == os.path.basename(facts["mount_source"])
    rotational = Path(f"/sys/class/block/{device['name']}/queue/rotational")
    if rotational.exists():  # the loop device may already be released after the child exited
        assert device["rotational"] is (rotational.read_text().strip() == "1")


def test_a_table_on_a_loop_over_tmpfs_is_refused_as_ram(tmp_path):
    """Issue 39 class 5: ext4 on loop0 whose image sits in /dev/shm is RAM, not NVMe."""
    from flashnext.table.storage_policy import storage_refusal

    table = tmp_path / "ple.bin"
    table.write_bytes(b"\0" * 4096)
    refusal = storage_refusal(probe_in("loop_on_tmpfs", table))
    assert refusal is not None
    assert "is on loop0, a block device in RAM (a loop over tmpfs, zram)" in refusal
    assert storage_refusal(probe_in("loop_on_disk", table)) is None
