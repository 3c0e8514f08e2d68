"""The one atomic-write helper: whole file or old file, and the mode a user expects."""

from __future__ import annotations

import os
import stat

import pytest
from flashnext.atomic import write_atomic, write_text_atomic


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_mode_open_would_give(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic(tmp_path / "facts.json", "{}\n")
    finally:
        os.umask(old)
    assert mode(tmp_path / "facts.json") == 0o640  # 0666 less the umask, not mkstemp's 0600


def test_a_replaced_file_keeps_its_mode_and_a_given_mode_wins(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("old")
    path.chmod(0o604)
    write_text_atomic(path, "new")
    assert (path.read_text(), mode(path)) == ("new", 0o604)
    write_atomic(path, b"newer", mode=0o640)
    assert (path.read_bytes(), mode(path)) == (b"newer", 0o640)


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
