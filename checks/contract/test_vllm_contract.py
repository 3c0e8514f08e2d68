"""What the launcher assumes about vLLM, asked of the real (patched) vLLM 0.33.0.

The launcher never imports vLLM; these tests run vLLM's own code in the pinned
env (`pins/build-env`, path in FLASHNEXT_VLLM_PY) and compare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.plan.partition import PartitionError, pp_layer_ranges

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "checks" / "launcher"))
from lead_fixtures import BASE_FILE, base_facts, split_shell_line  # noqa: E402

TABLE = "/nvme/flashnext/ple-table.bin"


def vllm_python() -> str:
    py = os.environ.get("FLASHNEXT_VLLM_PY")
    if not py:
        pytest.fail("FLASHNEXT_VLLM_PY is not set: run this suite through checks/contract/run")
    return py


def ask_vllm(mode: str, request) -> object:
    proc = subprocess.run(
        [vllm_python(), str(HERE / "vllm_side.py"), mode],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def skeleton(tmp_path_factory):
    from flashnext.skeleton import write_skeleton

    # Full scale: the facts fixture's table has the full model's size.
    path = tmp_path_factory.mktemp("contract") / "Qwen3.8-Flash-Next"
    write_skeleton(path, "full", fixed_metadata=True)
    return path


@pytest.fixture(scope="module")
def parsed(skeleton):
    """`serve --dry-run`'s argv, parsed by `vllm serve`'s own parser."""
    result = CliRunner().invoke(
        main,
        [
            "serve",
            "--dry-run",
            "--replay-facts-for-testing",
            str(BASE_FILE),
            "--model",
            str(skeleton),
            "--table",
            TABLE,
            "--kv-cache-memory-bytes",
            "300000000",
            "--generation-config",
            str(skeleton),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    # `vllm` from PATH, or the full path of the env serve found (the pinned
    # env pins/build-env built, --vllm-env): either way vLLM's own CLI.
    assert Path(argv[0]).name == "vllm" and argv[1] == "serve"
    return env, ask_vllm("parse", argv[2:])


def test_every_value_arrives_where_intended(parsed, skeleton):
    _, ns = parsed
    assert ns["model_tag"] == str(skeleton)
    assert ns["served_model_name"] == ["qwen3.8-flash-next"]
    assert (ns["host"], ns["port"]) == ("127.0.0.1", 8000)
    assert (ns["pipeline_parallel_size"], ns["tensor_parallel_size"]) == (3, 1)
    assert (ns["max_model_len"], ns["max_num_seqs"], ns["max_num_batched_tokens"]) == (
        262144,
        4,
        512,
    )
    assert ns["enable_prefix_caching"] is False
    assert ns["gpu_memory_utilization"] == 0.97
    assert ns["kv_cache_memory_bytes"] == 300_000_000
    assert ns["language_model_only"] is True
    assert ns["generation_config"] == str(skeleton)


def test_compilation_config_json_arrives_whole(parsed):
    comp = parsed[1]["compilation_config"]
    assert comp["mode"] == 0
    assert comp["cudagraph_mode"] in ("FULL_DECODE_ONLY", 3, [2, 0])  # enum as dumped
    assert comp["cudagraph_capture_sizes"] == [1, 2, 4]


def test_engram_config_takes_the_table_path(parsed):
    # The patch series adds EngramConfig.mmap_path (0010); stock vLLM rejects it.
    assert parsed[1]["engram_config"]["mmap_path"] == TABLE


def test_dotted_form_would_drop_the_json():
    # Why the launcher emits one JSON (SPEC row CLI): vLLM 0.33.0 lets a dotted
    # --compilation-config.x replace an earlier JSON instead of merging.
    ns = ask_vllm(
        "parse",
        [
            "m",
            "--compilation-config",
            '{"cudagraph_capture_sizes":[1,2,4],"mode":0}',
            "--compilation-config.cudagraph_mode",
            "FULL_DECODE_ONLY",
        ],
    )
    assert ns["compilation_config"]["cudagraph_capture_sizes"] != [1, 2, 4]


@pytest.fixture(scope="module")
def mtp_parsed(skeleton):
    """The 3x3090 plan with MTP on and the drafter's experts INT4 (as `checkpoint
    mtp-int4` leaves them), its argv parsed by `vllm serve`'s own parser."""
    import dataclasses

    from flashnext.checkpoint.mtp_int4 import int4_byte_classes
    from flashnext.facts.model import read_model_facts
    from flashnext.plan.command import serve_command
    from flashnext.plan.planner import PlanOptions, plan
    from flashnext.profiles import available_profiles

    model = read_model_facts(skeleton)
    classes = int4_byte_classes(model.tensor_bytes_by_class(), 512)
    model = dataclasses.replace(model, byte_classes=classes)
    shipped = available_profiles()["3x3090"]
    profile = dataclasses.replace(shipped, mtp=dataclasses.replace(shipped.mtp, enabled=True))
    # 128k: with the drafter a 262,144-token request does not fit the pool, and vLLM
    # would refuse to start (checks/patches/test_kv_request_capacity.py).
    options = PlanOptions(
        model_dir=str(skeleton),
        table_path=TABLE,
        generation_config_dir=str(skeleton),
        max_model_len=131_072,
    )
    p = plan(base_facts(), model, profile, options)
    assert p.mtp is not None and p.mtp.fits, p.mtp.reason
    argv = serve_command(p, profile, options).argv
    return p, argv, ask_vllm("parse", list(argv[2:]))


def test_vllm_takes_the_mtp_argv(mtp_parsed, skeleton):
    p, argv, ns = mtp_parsed
    assert ns["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1}
    assert ns["cpu_offload_gb"] == float(p.mtp.cpu_offload_gb)
    assert ns["cpu_offload_params"] == ["mtp.embed_tokens", "mtp.layers.48.mlp.experts"]
    # vLLM's byte budget covers everything the segments select.
    host = p.mtp.placed_bytes["host"]
    assert ns["cpu_offload_max_bytes"] >= host["routed_experts"] + host["embed_tokens"]
    assert ns["kv_cache_memory_bytes"] == p.kv_cache_memory_bytes.value
    # The flag after the segments is still read as its own (nargs="+" stops there).
    assert argv[argv.index("--cpu-offload-params") + 3] == "--generation-config"
    assert ns["generation_config"] == str(skeleton)


def _with_capture_sizes(argv, sizes):
    argv = list(argv)
    at = argv.index("--compilation-config") + 1
    argv[at] = json.dumps(json.loads(argv[at]) | {"cudagraph_capture_sizes": sizes})
    return argv


def test_with_mtp_every_decode_batch_replays_a_full_graph(mtp_parsed):
    """FULL_DECODE_ONLY is the profile's mode: each decode of 1-4 requests must
    find a captured graph in vLLM's V2 runner. With MTP K=1 a decode of n
    requests is 2n tokens; the profile's sizes alone (what the plan emitted
    before decode_capture_sizes) leave 3 and 4 requests eager."""
    _, argv, _ = mtp_parsed
    mtp = ask_vllm("decode_graphs", list(argv[2:]))
    assert mtp["num_speculative_tokens"] == 1 and mtp["capture_sizes"] == [1, 2, 4, 8]
    assert mtp["graph_tokens_by_requests"] == {"1": 2, "2": 4, "3": 8, "4": 8}
    before = ask_vllm("decode_graphs", _with_capture_sizes(argv[2:], [1, 2, 4]))
    assert before["graph_tokens_by_requests"] == {"1": 2, "2": 4, "3": None, "4": None}


def test_without_mtp_every_decode_batch_replays_a_full_graph(skeleton):
    from flashnext.plan.command import compilation_config_json
    from flashnext.profiles import available_profiles

    profile = available_profiles()["3x3090"]
    argv = [str(skeleton), "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
            "--compilation-config", compilation_config_json(profile)]  # fmt: skip
    got = ask_vllm("decode_graphs", argv)
    assert got["graph_tokens_by_requests"] == {"1": 1, "2": 2, "3": 4, "4": 4}


CASES = [
    {"layers": 48, "pp": 3, "partition": None},
    {"layers": 7, "pp": 3, "partition": None},
    {"layers": 50, "pp": 3, "partition": None},
    {"layers": 49, "pp": 4, "partition": None},
    {"layers": 48, "pp": 3, "partition": "1,23,24"},
    {"layers": 48, "pp": 3, "partition": "20,14,14"},
    {"layers": 48, "pp": 3, "partition": "16,16"},
    {"layers": 48, "pp": 3, "partition": "16,16,15"},
]


def test_partition_matches_get_pp_indices():
    theirs = ask_vllm("pp", CASES)
    for case, expected in zip(CASES, theirs, strict=True):
        if isinstance(expected, dict):  # vLLM refuses it: so must we
            with pytest.raises(PartitionError):
                pp_layer_ranges(case["layers"], case["pp"], case["partition"])
        else:
            ours = pp_layer_ranges(case["layers"], case["pp"], case["partition"])
            assert [list(r) for r in ours] == expected, case
