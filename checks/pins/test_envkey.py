"""The env cache key follows every input that changes the built env."""

import shutil

import pytest
from pinkit import envkey


@pytest.fixture
def patches(tmp_path, repo):
    copy = tmp_path / "patches"
    shutil.copytree(repo / "patches", copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def _key(patches, lock=b"lock", interpreter="cpython 3.11.7 /usr/bin/python3.11"):
    return envkey.env_key(lock, envkey.patch_inputs(patches), interpreter)[0]


def test_key_is_stable(patches):
    assert _key(patches) == _key(patches)


def test_key_changes_when_a_patch_file_changes(patches):
    before = _key(patches)
    patch = sorted((patches / "vllm-0.33.0").glob("*.patch"))[0]
    patch.write_bytes(patch.read_bytes() + b"\n")
    assert _key(patches) != before


def test_key_changes_with_series_apply_lock_and_interpreter(patches):
    before = _key(patches)
    assert _key(patches, lock=b"other") != before
    assert _key(patches, interpreter="cpython 3.11.9 /usr/bin/python3.11") != before
    series = patches / "vllm-0.33.0" / "series"
    series.write_text(series.read_text() + "# reordered\n")
    after_series = _key(patches)
    assert after_series != before
    (patches / "apply").write_text((patches / "apply").read_text() + "\n# edit\n")
    assert _key(patches) != after_series


def test_prose_does_not_change_the_key(patches):
    before = _key(patches)
    (patches / "README.md").write_text("new prose\n")
    assert _key(patches) == before


def test_inputs_name_every_patch_in_the_series(patches):
    inputs = envkey.patch_inputs(patches)
    series = (patches / "vllm-0.33.0" / "series").read_text().split("\n")
    listed = [line.strip() for line in series if line.strip() and not line.startswith("#")]
    assert listed and all(f"vllm-0.33.0/{name}" in inputs for name in listed)
    assert "apply" in inputs
