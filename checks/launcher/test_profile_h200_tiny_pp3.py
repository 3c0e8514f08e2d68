"""The h200-tiny-pp3 profile: the 12-layer tiny checkpoint under PP=3, for the
PP=3-on-one-GPU harness (checks/gpu/pp3).

Preflight judges replayed facts of three H200s (the lent card's recording,
three times): the GPU-count check is met by those facts, not switched off,
and the real one-card facts still fail it. The plan puts the PLE layer on
rank 0 and one QSA layer on every rank, and its argv is the PP=3 command
with the profile's graphs and the QSA offload env.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.profiles import available_profiles
from h200_tiny_facts import h200_facts
from lead_fixtures import split_shell_line
from test_profile_h200_tiny import TINY_MODEL, needs_vllm_python, prepare_table

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
sys.path.insert(0, str(REPO / "checks" / "gpu" / "pp3"))
from emulation import replicate_gpu  # noqa: E402
from harness import free_port  # noqa: E402

PROFILE = "h200-tiny-pp3"


def three_h200s(facts: dict) -> dict:
    """The lent card's facts as three cards (indexes 0-2, placeholder UUIDs): the
    transformation checks/gpu/serve/serve-tiny applies to the host's probe."""
    return replicate_gpu(facts, 3)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """(model, table, three-card facts file, one-card facts file, port)."""
    py = needs_vllm_python()
    root = tmp_path_factory.mktemp("h200-pp3")
    model = root / "tiny12"
    subprocess.run([py, str(TINY_MODEL), str(model), "--layers", "12"], check=True, timeout=600)
    table = root / "tables" / "ple.bin"
    prepare_table(model, table)
    port = free_port()
    one = h200_facts(model, table, port)
    (root / "one.json").write_text(json.dumps(one))
    (root / "three.json").write_text(json.dumps(three_h200s(one)))
    return model, table, root / "three.json", root / "one.json", port


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def args_for(host, facts: Path) -> list[str]:
    model, table, _, _, port = host
    return ["--facts", str(facts), "--profile", PROFILE, "--model", str(model),
            "--table", str(table), "--port", str(port)]  # fmt: skip


def test_the_profile_is_h200_tiny_with_a_pipeline():
    profiles = available_profiles()
    pp3, pp1, product = profiles[PROFILE], profiles["h200-tiny"], profiles["3x3090"]
    assert (pp3.gpu.name, pp3.gpu.count, pp3.parallel.pipeline_parallel_size) == ("H200", 3, 3)
    assert pp3.auto_select is False and pp3.default is False
    # what the harness must not differ in from the PP=1 runs
    assert pp3.scheduler == pp1.scheduler and pp3.compilation == pp1.compilation
    assert pp3.qsa_offload == pp1.qsa_offload and pp3.env == pp1.env
    # the pipeline's own reserves are the product's
    assert pp3.memory.pp_buffer_bytes == product.memory.pp_buffer_bytes
    assert pp3.memory.min_shm_bytes == product.memory.min_shm_bytes


def test_three_replayed_cards_pass_and_the_one_real_card_does_not(host):
    three, one = host[2], host[3]
    result = invoke("preflight", *args_for(host, three), "--json")
    doc = json.loads(result.output)
    levels = {f["id"]: f["level"] for f in doc["findings"]}
    assert result.exit_code == 0, result.output
    assert levels["gpu.count"] == "ok" and levels["pp.ple_rank"] == "ok"
    plan = doc["plan"]
    assert plan["pp_ranges"] == [[0, 4], [4, 8], [8, 12]] and plan["ple_ranks"] == [0]
    result = invoke("preflight", *args_for(host, one), "--json")
    levels = {f["id"]: f["level"] for f in json.loads(result.output)["findings"]}
    assert result.exit_code == 1 and levels["gpu.count"] == "fail"


def test_the_dry_run_is_the_pp3_command(host):
    # serve judges the host it runs on; the harness replays the three cards loudly
    replay = [
        "--replay-facts-for-testing" if a == "--facts" else a for a in args_for(host, host[2])
    ]
    result = invoke("serve", *replay, "--dry-run")
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "3"
    assert argv[argv.index("--compilation-config") + 1] == (
        '{"cudagraph_capture_sizes":[1,2,4],"cudagraph_mode":"FULL_DECODE_ONLY","mode":0}'
    )
    assert env["VLLM_QSA_KV_OFFLOAD"] == "1" and env["VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS"] == "1024"
    # nothing of the one-GPU emulation is in the shipped command
    assert not any("ONE_GPU" in k or "NCCL_HOSTID" in k for k in env)
