"""Session fixtures shared by the launcher tests: checkpoint skeletons and their facts.

The full skeleton is the true Qwen3.8-Flash-Next inventory (sparse files, ~60 MB
of headers); it is written and read once per session.
"""

from __future__ import annotations

import os

import pytest
from flashnext.facts.model import read_model_facts
from flashnext.skeleton import write_skeleton


@pytest.fixture(scope="session", autouse=True)
def _facts_cache_in_the_session_tmp(tmp_path_factory):
    """The facts cache ($XDG_CACHE_HOME/flashnext) of this session's checkpoints stays in
    its temp dir, not the user's cache (the CLI subprocesses inherit it too)."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


@pytest.fixture(scope="session")
def full_skeleton(tmp_path_factory):
    """Full-scale checkpoint with fixed metadata (sampling keys, explicit groups)."""
    path = tmp_path_factory.mktemp("full") / "Qwen3.8-Flash-Next"
    write_skeleton(path, "full", fixed_metadata=True)
    return path


@pytest.fixture(scope="session")
def full_model(full_skeleton):
    return read_model_facts(full_skeleton)


@pytest.fixture(scope="session")
def full_model_int4(full_model):
    """The full skeleton as `flashnext checkpoint mtp-int4` leaves it: the MTP routed
    experts INT4 g128 (the writer's own byte classes, proved against its output in
    checks/checkpoint/test_mtp_int4.py), every other tensor as its real header says."""
    import dataclasses

    from flashnext.checkpoint.mtp_int4 import int4_byte_classes

    classes = int4_byte_classes(
        full_model.tensor_bytes_by_class(), int(full_model.text_config["num_experts"])
    )
    return dataclasses.replace(full_model, byte_classes=classes)


@pytest.fixture(scope="session")
def shipped_skeleton(tmp_path_factory):
    """Tiny checkpoint with the shipped export defects (targets ["Linear"], no sampling keys)."""
    path = tmp_path_factory.mktemp("shipped") / "tiny"
    write_skeleton(path, "tiny", fixed_metadata=False)
    return path


@pytest.fixture(scope="session")
def patched_vllm_env(tmp_path_factory):
    """A stand-in env whose stamp equals this checkout's series (vllm_env_fixtures.py)."""
    from vllm_env_fixtures import checkout_stamp, make_vllm_env

    return make_vllm_env(tmp_path_factory.mktemp("vllm-env") / "env", stamp=checkout_stamp())


@pytest.fixture(autouse=True)
def _vllm_env_is_the_stand_in(patched_vllm_env, monkeypatch):
    """Preflight and serve judge and run the stand-in env unless a test says otherwise;
    the real pinned env (checks/run's FLASHNEXT_VLLM_ENV) is vllm_env_fixtures.REAL_VLLM_ENV."""
    monkeypatch.setenv("FLASHNEXT_VLLM_ENV", str(patched_vllm_env))
    monkeypatch.delenv("FLASHNEXT_PROG", raising=False)


@pytest.fixture(scope="session")
def fixed_tiny(tmp_path_factory):
    """The tiny skeleton with fixed metadata, written once; tests damage copies of it."""
    path = tmp_path_factory.mktemp("tiny-fixed") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


@pytest.fixture
def tiny_copy(fixed_tiny, tmp_path):
    """A private copy of the tiny skeleton (fixed metadata) to damage."""
    import shutil

    shutil.copytree(fixed_tiny, tmp_path / "m")
    return tmp_path / "m"
