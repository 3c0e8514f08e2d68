"""Issue 25, class 12: the paths a user gives reach vLLM as that same path, whatever
they begin with or contain. The argv is parsed by an argparse parser declaring the
options as vLLM 0.33.0's serve does (positional model_tag, --generation-config, a
JSON --engram-config, --served-model-name nargs="+"); checks/contract parses it with
vLLM's own parser where the pinned env is built."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE


def vllm_like_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="cmd")
    serve = sub.add_parser("serve")
    serve.add_argument("model_tag", nargs="?")
    serve.add_argument("--generation-config")
    serve.add_argument("--engram-config", type=json.loads)
    serve.add_argument("--served-model-name", nargs="+")
    return parser


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("paths") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


NAMES = ["-model", "--model", "~model", "sp ace$(x)'\"\nline", "ünï", "a=b"]


@pytest.mark.parametrize("name", NAMES)
def test_relative_paths_reach_vllm_as_the_same_files(name, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / name)
    gen = f"{name}-gen"
    (tmp_path / gen).mkdir()
    (tmp_path / gen / "generation_config.json").write_text('{"temperature": 0.7}')
    table = f"{name}.bin"
    (tmp_path / table).write_bytes(b"")
    served = "-served" if name.startswith("-") else "served"
    result = CliRunner().invoke(main, [
        "plan", "--facts", str(BASE_FILE), "--model", name, "--table", table,
        "--generation-config", gen, "--served-model-name", served, "--json",
    ], catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
    argv = json.loads(result.stdout)["argv"]
    args, _ = vllm_like_parser().parse_known_args(argv[1:])
    assert os.path.samefile(args.model_tag, tmp_path / name)
    assert os.path.samefile(args.generation_config, tmp_path / gen)
    assert os.path.samefile(args.engram_config["mmap_path"], tmp_path / table)
    assert args.served_model_name == [served]
