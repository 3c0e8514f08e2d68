"""The preflight / plan / serve commands end to end, through Click and as a real process."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.schema import dumps
from lead_fixtures import BASE_FILE, VARIANTS, base_facts, split_shell_line

REPO = Path(__file__).resolve().parents[2]
TABLE = "/nvme/flashnext/ple-table.bin"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def dry_run(model_dir, *extra):
    return invoke(
        "serve", "--dry-run", "--facts", BASE_FILE, "--model", model_dir, "--table", TABLE, *extra
    )


def flag_values(argv: list[str]) -> dict[str, str | None]:
    """--flag value pairs; a flag followed by another flag has no value."""
    flags: dict[str, str | None] = {}
    for i, word in enumerate(argv):
        if word.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            flags[word] = None if nxt is None or nxt.startswith("--") else nxt
    return flags


def test_every_command_has_help():
    for name, command in main.commands.items():
        result = invoke(name, "--help")
        assert result.exit_code == 0, name
        assert command.help and len(command.help.split()) > 3, f"{name} lacks help"
        sub = getattr(command, "commands", {})
        for subname in sub:
            assert invoke(name, subname, "--help").exit_code == 0, (name, subname)


def test_dry_run_prints_one_pasteable_command(full_skeleton):
    result = dry_run(full_skeleton)
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    assert argv[:3] == ["vllm", "serve", str(full_skeleton)]
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"] == "0"
    flags = flag_values(argv[3:])
    assert flags["--host"] == "127.0.0.1"  # loopback unless told otherwise
    assert flags["--pipeline-parallel-size"] == "3"
    assert flags["--kv-cache-memory-bytes"].isdigit()


def test_compilation_config_is_one_json_never_dotted(full_skeleton):
    # SPEC row CLI: `--compilation-config '{json}'` plus a dotted
    # `--compilation-config.x` makes vLLM 0.33.0 drop the JSON silently.
    _, argv = split_shell_line(dry_run(full_skeleton).output.strip().splitlines()[-1])
    assert argv.count("--compilation-config") == 1
    assert not [a for a in argv if a.startswith("--compilation-config.")]
    config = json.loads(argv[argv.index("--compilation-config") + 1])
    assert config == {
        "mode": 0,
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [1, 2, 4],
    }


def test_dry_run_json_carries_findings_and_plan(full_skeleton, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(base_facts()))  # with the table's manifest recorded
    result = invoke("serve", "--dry-run", "--facts", facts, "--model", full_skeleton,
                    "--table", TABLE, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["result"] == "ok" and doc["dry_run"] is True
    assert doc["plan"]["profile"] == "3x3090"
    assert doc["command"].startswith("env ")


def test_serve_refuses_on_a_failed_check_and_starts_nothing(full_skeleton, tmp_path):
    facts = VARIANTS["memlock_64k"][0](base_facts())
    path = tmp_path / "facts.json"
    path.write_text(dumps(facts))
    marker = tmp_path / "vllm-started"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "vllm").write_text(f"#!/bin/sh\ntouch {marker}\n")
    (fake / "vllm").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashnext",
            "serve",
            "--facts",
            path,
            "--model",
            full_skeleton,
            "--table",
            TABLE,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "host.memlock" in proc.stdout
    assert "serve: not starting vLLM" in proc.stderr
    assert not marker.exists()


def test_preflight_json_and_exit_codes(full_skeleton, tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(dumps(base_facts()))  # with the table's manifest recorded
    ok = invoke("preflight", "--facts", facts, "--model", full_skeleton, "--table", TABLE, "--json")
    assert ok.exit_code == 0
    doc = json.loads(ok.output)
    assert doc["schema_version"] == 1 and doc["result"] == "ok"
    assert {f["level"] for f in doc["findings"]} == {"ok"}
    bad = tmp_path / "bad.json"
    bad.write_text(dumps(VARIANTS["table_on_nfs"][0](base_facts())))
    failed = invoke("preflight", "--facts", bad, "--model", full_skeleton, "--table", TABLE)
    assert failed.exit_code == 1
    assert "table.medium" in failed.output and "nfs4" in failed.output


def test_plan_json(full_skeleton):
    result = invoke(
        "plan", "--facts", BASE_FILE, "--model", full_skeleton, "--table", TABLE, "--json"
    )
    assert result.exit_code == 0
    doc = json.loads(result.output)
    assert [r["layers"] for r in doc["ranks"]] == [[0, 16], [16, 32], [32, 48]]
    assert doc["kv_cache_memory_bytes"]["source"] in ("derived", "profile")
    assert doc["argv"][:2] == ["vllm", "serve"]


def test_plan_refuses_a_profile_for_other_gpus(full_skeleton, tmp_path):
    facts = base_facts()
    a100 = dataclasses.replace(
        facts,
        gpu=dataclasses.replace(
            facts.gpu,
            devices=tuple(
                dataclasses.replace(d, name="NVIDIA A100-SXM4-80GB") for d in facts.gpu.devices[:2]
            ),
        ),
    )
    path = tmp_path / "a100.json"
    path.write_text(dumps(a100))
    result = invoke("plan", "--facts", path, "--model", full_skeleton, "--profile", "3x3090")
    assert result.exit_code == 1
    assert "profile 3x3090 is for 3x GeForce RTX 3090, the facts show 2x NVIDIA A100" in (
        result.output
    )


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ('{"schema_version": 99}', "schema_version 99, this flashnext reads version 1"),
        ("not json", "not JSON"),
        ('{"schema_version": 1, "memory": {"bogus": 1}}', "unknown field(s) bogus"),
    ],
)
def test_unreadable_facts_file_is_a_clear_error(tmp_path, content, words):
    path = tmp_path / "facts.json"
    path.write_text(content)
    result = invoke("preflight", "--facts", path)
    assert result.exit_code == 1
    assert words in result.output


def test_unknown_profile_is_a_usage_error(full_skeleton):
    result = invoke("plan", "--facts", BASE_FILE, "--model", full_skeleton, "--profile", "8xH100")
    assert result.exit_code == 1
    assert "unknown profile '8xH100'; available: 3x3090" in result.output


def test_readme_main_command_reports_honestly_on_this_machine(tmp_path):
    # The README's main command, run for real on a machine without the GPUs,
    # the model or the table: it probes, reports every failure, starts nothing.
    readme = (REPO / "README.md").read_text()
    assert "./flashnext serve --model" in readme
    proc = subprocess.run(
        [
            str(REPO / "flashnext"),
            "serve",
            "--model",
            tmp_path / "Qwen3.8-Flash-Next",
            "--table",
            tmp_path / "ple-table.bin",
            "--port",
            "18123",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "gpu.nvml" in out and "NVML" in out
    assert "model.dir" in out and "table.path" in out
    assert "serve: not starting vLLM" in proc.stderr


def test_plan_table_ends_with_the_command_on_one_pasteable_line(full_skeleton):
    args = ["plan", "--facts", BASE_FILE, "--model", full_skeleton, "--table", TABLE]
    doc = json.loads(invoke(*args, "--json").output)
    text = invoke(*args).output.rstrip().splitlines()
    env, argv = split_shell_line(text[-1])
    assert argv == doc["argv"] and env == doc["env"]
