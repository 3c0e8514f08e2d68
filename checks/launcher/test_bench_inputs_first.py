"""Issue 25, class 9: every input of `flashnext bench` is read and checked before the
first request, so a bad --plan, --facts or --out never throws a finished run away."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.cli import main  # noqa: E402
from harness import start_standin  # noqa: E402


@pytest.fixture(scope="module")
def url():
    proc, base = start_standin(STANDIN_TOKEN_INTERVAL_S="0.001")
    yield base
    proc.terminate()
    proc.wait(10)


def bench(url: str, *extra: str):
    return CliRunner().invoke(main, [
        "bench", "--url", url, "--concurrency", "1", "--decode-tokens", "4",
        "--prompt-lengths", "16", "--warmup", "0", "--runs", "1", *map(str, extra),
    ])  # fmt: skip


PLANS = {
    "binary": (b"\x80\x81\x82", "not UTF-8 text, so not a plan file"),
    "not json": (b"plan: yes\n", None),
    "array": (b"[]", "a JSON list, not a plan file (an object)"),
    "no roofline": (
        json.dumps({"argv": ["vllm"]}).encode(),
        "no decode.tokens_per_s, so not `flashnext plan --json` output; write one with "
        "`flashnext plan --json ... > plan.json`",
    ),
    "roofline not a number": (
        json.dumps({"decode": {"tokens_per_s": "fast"}}).encode(),
        "decode.tokens_per_s is not a number, so not `flashnext plan --json` output; write "
        "one with `flashnext plan --json ... > plan.json`",
    ),
}


@pytest.mark.parametrize("kind", PLANS)
def test_a_bad_plan_is_refused_before_the_benchmark_runs(kind, url, tmp_path):
    raw, words = PLANS[kind]
    plan = tmp_path / "plan.json"
    plan.write_bytes(raw)
    result = bench(url, "--plan", plan, "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    last = result.output.splitlines()[-1]
    assert last.startswith(f"Error: Invalid value for '--plan': {plan}: "), last
    if words:
        assert last == f"Error: Invalid value for '--plan': {plan}: {words}"
    assert "bench: " not in result.output  # no measurement was started
    assert not (tmp_path / "out").exists()


def test_an_out_dir_that_cannot_be_written_is_refused_first(url, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = bench(url, "--out", blocker / "results")
    assert result.exit_code == 2, result.output
    assert result.output.splitlines()[-1] == (
        f"Error: Invalid value for '--out': {blocker} is not a directory"
    )
    assert "bench: " not in result.output
