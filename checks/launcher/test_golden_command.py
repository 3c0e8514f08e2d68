"""The shipped profile's `vllm serve` argv and environment, byte for byte (golden files)."""

from __future__ import annotations

import json

from click.testing import CliRunner
from flashnext.cli import main
from golden_command import GOLDEN_DIR, MODEL_ARG, PLAN_ARGS, golden_files


def test_shipped_profile_argv_and_env_equal_the_golden_files(full_skeleton, monkeypatch):
    assert full_skeleton.name == MODEL_ARG
    monkeypatch.chdir(full_skeleton.parent)
    result = CliRunner().invoke(main, PLAN_ARGS)
    assert result.exit_code == 0, result.output
    for name, text in golden_files(json.loads(result.output)).items():
        # On a difference: checks/launcher/golden/regenerate, then review the diff.
        assert text == (GOLDEN_DIR / name).read_text(), name


def test_golden_files_would_catch_a_changed_argument():
    # The comparison is over whole files: one flag value changed is a different file.
    plan = {"argv": ["vllm", "serve", "--max-num-seqs", "4"], "env": {"B": "2", "A": "1"}}
    files = golden_files(plan)
    assert files == {"3x3090.argv": "vllm\nserve\n--max-num-seqs\n4\n", "3x3090.env": "A=1\nB=2\n"}
    plan["argv"][-1] = "5"
    assert golden_files(plan)["3x3090.argv"] != files["3x3090.argv"]
