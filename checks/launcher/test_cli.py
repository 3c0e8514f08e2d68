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
        "serve",
        "--dry-run",
        "--replay-facts-for-testing",
        BASE_FILE,
        "--model",
        model_dir,
        "--table",
        TABLE,
        *extra,
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


def test_dry_run_prints_one_pasteable_command(full_skeleton, patched_vllm_env):
    result = dry_run(full_skeleton)
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    # argv[0]: the `vllm` of the env serve runs (FLASHNEXT_VLLM_ENV), not whatever PATH has
    vllm = str(patched_vllm_env / "venv" / "bin" / "vllm")
    assert argv[:3] == [vllm, "serve", str(full_skeleton)]
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
    result = invoke("serve", "--dry-run", "--replay-facts-for-testing", facts,
                    "--model", full_skeleton, "--table", TABLE, "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    # The reference host's one warning: 2 full-length requests at once, not 4.
    assert doc["result"] == "warn" and doc["dry_run"] is True
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
            "--replay-facts-for-testing",
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
    # Exit 0 with the reference host's one warning (kv.capacity: 2 full-length requests).
    assert doc["schema_version"] == 1 and doc["result"] == "warn"
    assert {f["id"] for f in doc["findings"] if f["level"] != "ok"} == {"kv.capacity"}
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
            p2p=tuple(p for p in facts.gpu.p2p if p.gpu_b < 2),  # two cards: one pair
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
    assert result.exit_code == 2
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


def test_dry_run_with_a_failed_check_prints_the_failures_then_the_command(full_skeleton, tmp_path):
    # Issue 13, finding 6: the command is still shown (to read, to file a bug), after
    # the failures, and the exit status says it would not run.
    path = tmp_path / "facts.json"
    path.write_text(dumps(VARIANTS["memlock_64k"][0](base_facts())))
    result = invoke("serve", "--dry-run", "--replay-facts-for-testing", path,
                    "--model", full_skeleton, "--table", TABLE)  # fmt: skip
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[-4] == (
        "fix host.memlock: raise it: `ulimit -l unlimited` (systemd: LimitMEMLOCK=infinity; "
        "podman/docker: --ulimit memlock=-1:-1)"
    )
    assert lines[-3] == "fix kv.capacity: accept it, or --max-model-len 72864 for 4 at once"
    assert lines[-2] == "preflight: 1 failed, 1 warnings, 33 ok"
    _, argv = split_shell_line(lines[-1])
    assert argv[1:3] == ["serve", str(full_skeleton)]
    assert result.stderr.splitlines()[1:] == [
        "serve --dry-run: 1 check(s) failed (above): serve refuses to run this command until "
        "they pass (`flashnext preflight` re-checks)"
    ]  # after the testing replay's banner
    doc = json.loads(invoke("serve", "--dry-run", "--replay-facts-for-testing", path, "--model",
                            full_skeleton, "--table", TABLE, "--json").stdout)  # fmt: skip
    assert doc["result"] == "fail" and doc["command"].startswith("env ")


# ---------------------------------------------------------------- issue 13, finding 7


def test_a_fix_is_one_whole_line_whatever_its_length(shipped_skeleton, tmp_path):
    # Not a terminal: the table is 120 columns; a fix under it must not be cut.
    deep = tmp_path.joinpath(*["a-rather-long-directory-name"] * 6) / "Qwen3.8-Flash-Next"
    deep.parent.mkdir(parents=True)
    import shutil

    shutil.copytree(shipped_skeleton, deep)
    result = invoke("preflight", "--facts", BASE_FILE, "--model", deep, "--table", TABLE)
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert f"fix model.quant_groups: flashnext checkpoint fix --model {deep}" in lines
    assert len(f"{deep}") > 120
    check = invoke("checkpoint", "check", "--model", deep)
    fixes = [line for line in check.stdout.splitlines() if line.startswith("fix ")]
    assert f"fix duplicate-targets: flashnext checkpoint fix --model {deep}" in fixes
    assert len(fixes) == len(set(fixes))  # three groups' same fix is said once


def test_fixes_name_the_command_as_invoked(shipped_skeleton, monkeypatch):
    monkeypatch.setenv("FLASHNEXT_PROG", "./flashnext")
    result = invoke("preflight", "--facts", BASE_FILE, "--model", shipped_skeleton,
                    "--table", TABLE)  # fmt: skip
    lines = result.stdout.splitlines()
    assert f"fix model.quant_groups: ./flashnext checkpoint fix --model {shipped_skeleton}" in lines
    assert (
        "serve: not starting vLLM: fix the failed checks above (`./flashnext preflight` re-checks)"
        in invoke("serve", "--replay-facts-for-testing", BASE_FILE, "--model", shipped_skeleton,
                  "--table", TABLE).stderr
    )  # fmt: skip
    # an error's fix too (a ClickException), and only where `flashnext` is the command
    bench = invoke("bench", "--url", "http://127.0.0.1:9", "--runs", "1", "--warmup", "0",
                   "--facts", BASE_FILE)  # fmt: skip
    assert bench.exit_code == 1 and "start the server (`./flashnext serve`)" in bench.stderr


def test_the_root_script_says_how_it_was_invoked(shipped_skeleton, tmp_path):
    # ./flashnext's venv, prebuilt where checks/lib.sh looks for it: this Python.
    env = {**os.environ, "FLASHNEXT_CACHE": str(tmp_path), "FLASHNEXT_PYTHON": sys.executable}
    key = subprocess.run(
        ["bash", "-c", '. checks/lib.sh && launcher_venv_key "$PWD"'],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    bindir = tmp_path / "launcher" / key / "bin"
    bindir.mkdir(parents=True)
    (bindir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    (bindir.parent / ".complete").touch()
    proc = subprocess.run(
        ["./flashnext", "preflight", "--facts", str(BASE_FILE), "--model", str(shipped_skeleton),
         "--table", TABLE],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    fix = f"fix model.quant_groups: ./flashnext checkpoint fix --model {shipped_skeleton}"
    assert fix in proc.stdout.splitlines()


def test_serve_prints_the_version_and_starts_nothing():
    """The image's entrypoint is `flashnext serve`, so `podman run IMAGE --version` asks serve."""
    from flashnext import __version__

    result = invoke("serve", "--version")
    assert result.exit_code == 0
    assert result.output == f"flashnext, version {__version__}\n"
