"""Issue 25, class 1: `serve` judges the host it runs on. Replayed facts (--facts,
FLASHNEXT_FACTS) are refused as a usage error; the testing replay is an explicit,
announced and recorded opt-in; a dry run prints its warnings too."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.schema import dumps
from lead_fixtures import BASE_FILE, base_facts, split_shell_line

TABLE = "/nvme/flashnext/ple-table.bin"
REFUSAL = (
    "serve judges the host it runs on, not facts recorded elsewhere: {drop} (replayed "
    "facts are for `flashnext plan` and `flashnext preflight`); to test serve against "
    "recorded facts, pass --replay-facts-for-testing FILE (FLASHNEXT_TEST_REPLAY_FACTS)"
)


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "serve"])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_refuses_replayed_facts(how, dry_run, shipped_skeleton, tmp_path):
    args = ["serve", "--model", shipped_skeleton, "--table", tmp_path / "t.bin"]
    args += ["--dry-run"] if dry_run else []
    if how == "flag":
        result = invoke(*args, "--facts", BASE_FILE)
        hint, drop = "'--facts'", "drop --facts"
    else:
        result = invoke(*args, env={"FLASHNEXT_FACTS": str(BASE_FILE)})
        hint, drop = "FLASHNEXT_FACTS", "unset FLASHNEXT_FACTS"
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        f"Error: Invalid value for {hint}: " + REFUSAL.format(drop=drop)
    )
    assert "Traceback" not in result.output


def test_the_testing_replay_is_announced_and_recorded(full_skeleton, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(base_facts()))
    result = invoke("serve", "--dry-run", "--replay-facts-for-testing", facts,
                    "--model", full_skeleton, "--table", TABLE, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == (
        f"flashnext: TESTING ONLY: judging the facts replayed from {facts} "
        "(--replay-facts-for-testing), not this host: the GPU, memory and table checks "
        "below say nothing about this machine"
    )
    assert json.loads(result.stdout)["replayed_facts_for_testing"] == str(facts)
    by_env = invoke("serve", "--dry-run", "--model", full_skeleton, "--table", TABLE, "--json",
                    env={"FLASHNEXT_TEST_REPLAY_FACTS": str(facts)})  # fmt: skip
    assert by_env.exit_code == 0, by_env.output
    assert json.loads(by_env.stdout)["replayed_facts_for_testing"] == str(facts)


def test_a_dry_run_prints_its_warnings_before_the_command(full_skeleton, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(base_facts()))  # the reference host: one warning, kv.capacity
    result = invoke("serve", "--dry-run", "--replay-facts-for-testing", facts,
                    "--model", full_skeleton, "--table", TABLE)  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[-3] == "fix kv.capacity: accept it, or --max-model-len 72864 for 4 at once"
    assert lines[-2].startswith("preflight: 0 failed, 1 warnings, ")
    assert split_shell_line(lines[-1])[1][1:3] == ["serve", str(full_skeleton)]
