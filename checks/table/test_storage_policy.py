"""Which output filesystems `table prepare` refuses, judged from StorageFacts records."""

from __future__ import annotations

import pytest
from flashnext.facts.schema import BlockDevice, StorageFacts
from flashnext.table.storage_policy import space_refusal, storage_refusal

NVME = BlockDevice(name="nvme0n1", rotational=False, transport="nvme")
HDD = BlockDevice(name="sda", rotational=True, transport="sata")


def _facts(**kw) -> StorageFacts:
    base = {"path": "/data", "exists": True, "mount_point": "/data", "fs_type": "ext4"}
    return StorageFacts(**{**base, **kw})


@pytest.mark.parametrize(
    ("facts", "reason"),
    [
        (_facts(devices=(NVME,)), None),
        (_facts(devices=(HDD,)), "is on a rotational disk (sda)"),
        (_facts(devices=(NVME, HDD)), "is on a rotational disk (sda)"),
        (_facts(fs_type="nfs4", network=True), "is a network filesystem"),
        (_facts(fs_type="tmpfs"), "lives in RAM"),
        (_facts(fs_type="overlay"), "is an overlay (container writable layer)"),
        (_facts(fs_type=None, error="no mount found"), "storage probe failed (no mount found)"),
    ],
)
def test_storage_refusal(facts: StorageFacts, reason: str | None) -> None:
    got = storage_refusal(facts)
    if reason is None:
        assert got is None
    else:
        assert got is not None and reason in got
        assert got.startswith(f"/data (mount /data, {facts.fs_type or '?'})")


def test_space_refusal_names_both_sizes() -> None:
    facts = _facts(devices=(NVME,), free_bytes=10 << 30)
    assert space_refusal(facts, 5 << 30) is None
    assert (
        space_refusal(facts, 96 << 30) == "/data has 10.00 GiB free, the table needs 96.00 GiB more"
    )
