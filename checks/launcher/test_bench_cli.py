"""`flashnext bench` and `flashnext report` through the real Click CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures" / "standin_vllm"))
from flashnext.cli import main  # noqa: E402
from harness import start_standin  # noqa: E402

FACTS = Path(__file__).resolve().parents[1] / "fixtures" / "facts" / "3x3090-nvme.json"


@pytest.fixture
def standin():
    procs = []

    def start(**env):
        proc, url = start_standin(**env)
        procs.append(proc)
        return url

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def test_bench_cli_writes_raw_and_summary(standin, tmp_path):
    url = standin(STANDIN_TOKEN_INTERVAL_S="0.01")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"decode": {"tokens_per_s": 160.0}}))
    res = CliRunner().invoke(main, [
        "bench", "--url", url, "--concurrency", "1,2", "--decode-tokens", "8",
        "--prompt-lengths", "64", "--warmup", "0", "--runs", "1",
        "--facts", str(FACTS), "--plan", str(plan), "--out", str(tmp_path / "out"), "--json",
    ])  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [d["concurrency"] for d in doc["summary"]["decode"]] == [1, 2]
    assert doc["environment"]["facts"]["hostname"] == "<hostname>"  # redacted like a report
    assert doc["environment"]["facts"]["gpu"]["devices"][0]["uuid"] == "<redacted>"
    assert doc["comparison"][1]["metric"] == "decode tok/s, c=1 vs roofline"
    assert len((tmp_path / "out" / "raw.jsonl").read_text().splitlines()) == 1 + 2 + 1
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["summary"] == doc["summary"]


def test_bench_cli_fails_on_rejected_streams(standin):
    url = standin(STANDIN_TRUNCATE_AFTER="2")
    res = CliRunner().invoke(main, [
        "bench", "--url", url, "--concurrency", "1", "--decode-tokens", "4",
        "--prompt-lengths", "8", "--warmup", "0", "--runs", "1", "--facts", str(FACTS),
    ])  # fmt: skip
    assert res.exit_code == 1
    assert "bench: rejected decode c=1 run 0: stream ended without [DONE]" in res.output


def test_bench_cli_bad_values_are_usage_errors():
    res = CliRunner().invoke(main, ["bench", "--url", "http://x", "--concurrency", "1,a"])
    assert res.exit_code == 2
    assert "'1,a': expected comma-separated integers" in res.output


def test_report_cli_writes_a_redacted_file(tmp_path):
    out = tmp_path / "report.json"
    res = CliRunner().invoke(main, ["report", "--facts", str(FACTS), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"report written to {out} (redacted: ")
    doc = json.loads(out.read_text())
    assert doc["facts"]["hostname"] == "<hostname>"
    assert doc["versions"]["vllm_pinned"] == "0.33.0"
    assert "patches" in doc["patch_series"] or "unavailable" in doc["patch_series"]
    assert "fixture-3x3090" not in out.read_text()


def test_bench_reports_the_servers_mtp_acceptance_over_its_own_requests(standin, tmp_path):
    # The stand-in counts one draft of 2 tokens per generated token after the first,
    # 60% accepted, into vLLM's spec-decode counters on /metrics.
    url = standin(STANDIN_SPEC_ACCEPT="0.6", STANDIN_SPEC_K="2")
    first = ["bench", "--url", url, "--concurrency", "1", "--decode-tokens", "6",
             "--prompt-lengths", "", "--warmup", "0", "--runs", "1",
             "--facts", str(FACTS)]  # fmt: skip
    warm = CliRunner().invoke(main, first)
    assert warm.exit_code == 0, warm.output  # counters now stand above zero before the next
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"mtp": {"projection": {"acceptance_rate": 0.65}}}))
    args = ["bench", "--url", url, "--concurrency", "1,2", "--decode-tokens", "11",
            "--prompt-lengths", "64", "--warmup", "0", "--runs", "1", "--facts", str(FACTS),
            "--plan", str(plan)]  # fmt: skip
    doc = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)
    # Only this bench's requests: 1 + 2 streams of 11 tokens (10 drafts each), and
    # the prefill's 1-token request drafts nothing.
    assert doc["spec_decode"] == {
        "drafts": 30, "draft_tokens": 60, "accepted_tokens": 36,
        "acceptance_rate": 0.6, "mean_acceptance_length": 2.2,
    }  # fmt: skip
    row = next(r for r in doc["comparison"] if r["metric"] == "MTP acceptance rate")
    assert (row["measured"], row["reference"], row["ratio"]) == (0.6, 0.65, round(0.6 / 0.65, 4))
    table = CliRunner().invoke(main, args)
    assert "MTP: 36 of 60 draft tokens accepted (rate 0.600, mean acceptance length 2.20)" in (
        table.output
    )


def test_bench_without_mtp_reports_no_acceptance(standin):
    url = standin()
    res = CliRunner().invoke(main, ["bench", "--url", url, "--concurrency", "1",
                                    "--decode-tokens", "4", "--prompt-lengths", "",
                                    "--warmup", "0", "--runs", "1", "--facts", str(FACTS),
                                    "--json"])  # fmt: skip
    doc = json.loads(res.stdout)
    assert doc["spec_decode"] is None
    assert all(r["metric"] != "MTP acceptance rate" for r in doc["comparison"])


def test_report_of_a_bad_facts_file_says_why_in_each_part(tmp_path):
    """A bug report is still written, and no part of it hides the cause."""
    facts = tmp_path / "facts.json"
    facts.write_text("garbage")
    res = CliRunner().invoke(main, ["report", "--facts", str(facts)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    for part in ("facts", "plan", "preflight"):
        assert (
            "not JSON" in doc[part]["unavailable"] and "flashnext facts" in doc[part]["unavailable"]
        )
