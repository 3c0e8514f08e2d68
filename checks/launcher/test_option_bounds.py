"""Issue 25, classes 7 and 8: numeric options are checked at the command line, as
usage errors (exit 2) naming the option, before any value reaches the planner, a
buffer or vLLM; work sized by a user's number streams. Each case runs in a child
under an address-space limit and a timeout, so a regression fails the test, not
the CI machine."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from flashnext.skeleton import write_skeleton
from lead_fixtures import BASE_FILE

TABLE = "/nvme/flashnext/ple-table.bin"
LIMIT_BYTES = 2 << 30


def cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT_BYTES, LIMIT_BYTES))


def run(*args, env=None, code: str | None = None) -> subprocess.CompletedProcess:
    argv = ["-c", code] if code else ["-m", "flashnext", *map(str, args)]
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          timeout=120, preexec_fn=cap, env=env, check=False)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("opts") / "fixed"
    write_skeleton(path, "tiny", fixed_metadata=True)
    return path


PLAN_CASES = [
    ("--kv-cache-memory-bytes", "10" + "0" * 30),
    ("--kv-cache-memory-bytes", "0"),
    ("--max-model-len", str(1 << 40)),
    ("--mtp", "1000000000"),
    ("--mtp", "-1"),
    ("--pp-layer-partition", "-1,3,2"),
    ("--pp-layer-partition", "2,x,2"),
    ("--pp-layer-partition", "1,1,100000000000"),
    ("--port", "70000"),
]


@pytest.mark.parametrize("command", ["plan", "preflight"])
@pytest.mark.parametrize(("flag", "value"), PLAN_CASES)
def test_a_plan_option_out_of_bounds_is_a_usage_error(command, flag, value, tiny):
    result = run(command, "--facts", BASE_FILE, "--model", tiny, "--table", TABLE, flag, value)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"Error: Invalid value for '{flag}'")
    assert "Traceback" not in result.stderr


def test_the_partition_from_the_environment_is_named_too(tiny):
    import os

    env = {**os.environ, "VLLM_PP_LAYER_PARTITION": "-1,3,2"}
    result = run("plan", "--facts", BASE_FILE, "--model", tiny, "--table", TABLE, env=env)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "Error: Invalid value for '--pp-layer-partition' (env var: 'VLLM_PP_LAYER_PARTITION'): "
        "'-1,3,2': expected layer counts per rank, comma-separated, each 1 to 1024, e.g. "
        "16,16,16"
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0"])
def test_serve_startup_timeout_must_be_seconds(value, tiny):
    result = run("serve", "--dry-run", "--model", tiny, "--table", TABLE,
                 "--startup-timeout", value)  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "Error: Invalid value for '--startup-timeout': "
    )
    assert "expected seconds, more than 0 and at most 604800 (a week)" in result.stderr


BENCH_CASES = [
    ("--prompt-lengths", str(10**12)),
    ("--concurrency", "1,100000"),
    ("--decode-tokens", str(10**12)),
    ("--prefill-concurrency", str(10**9)),
    ("--runs", str(10**9)),
    ("--warmup", str(10**9)),
    ("--token-id-range", f"0,{10**15}"),
]


@pytest.mark.parametrize(("flag", "value"), BENCH_CASES)
def test_a_bench_option_out_of_bounds_is_a_usage_error(flag, value):
    # port 9 (discard): nothing answers; the value must be refused before any request
    result = run("bench", "--url", "http://127.0.0.1:9", "--facts", BASE_FILE, flag, value)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"Error: Invalid value for '{flag}'")


@pytest.mark.parametrize("flag", ["--chunk-bytes", "--sync-bytes"])
def test_table_prepare_buffer_sizes_are_bounded(flag, tiny, tmp_path):
    out = tmp_path / "t.bin"
    result = run("table", "prepare", "--model", tiny, "--out", out, "--force", flag,
                 str(1 << 50))  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].startswith(f"Error: Invalid value for '{flag}'")
    assert list(tmp_path.iterdir()) == []


def test_verify_samples_stream_instead_of_filling_memory():
    """400M samples of a 320M-row table: the rows are drawn one at a time."""
    code = (
        "import itertools, types\n"
        "from flashnext.table.verify import sample_rows\n"
        "layout = types.SimpleNamespace(rows=320_001_536)\n"
        "for samples in (400_000_000, 300_000_000):\n"
        "    first = list(itertools.islice(sample_rows(layout, samples, 7), 3))\n"
        "    print(samples, first[:2])\n"
    )
    result = run(code=code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["400000000 [0, 1]", "300000000 [0, 320001535]"]
