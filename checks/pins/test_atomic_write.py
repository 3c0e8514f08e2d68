"""pinkit's atomic write: whole files only, and the mode a user would expect."""

import os
import stat

import pytest
from pinkit.atomic import write_text_atomic


def mode_of(path):
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_follows_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "lock.txt", "a\n")
    finally:
        os.umask(old)
    assert mode_of(tmp_path / "lock.txt") == 0o640
    assert (tmp_path / "lock.txt").read_text() == "a\n"


def test_a_replaced_file_keeps_its_mode(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("old\n")
    path.chmod(0o600)
    write_text_atomic(path, "new\n")
    assert mode_of(path) == 0o600
    assert path.read_text() == "new\n"


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "\udcff")  # a lone surrogate cannot be UTF-8
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["lock.txt"]
