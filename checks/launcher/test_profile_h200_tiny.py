"""The h200-tiny profile: the tiny test checkpoint on the one lent H200, PP=1.

Preflight and the dry-run command are judged from replayed H200 facts
(h200_tiny_facts.py says where each value comes from) against the real tiny
checkpoint of checks/gpu/tiny/tiny_model.py (written with the pinned vLLM env's
python: it needs torch; FLASHNEXT_VLLM_PY, which checks/run sets) and against
the skeleton's tiny variant (always). The argv is parsed by vLLM 0.33.0's own
`vllm serve` parser in that env, and the env vars are looked up in its envs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner
from flashnext.cli import main
from flashnext.facts.schema import host_facts_from_json
from flashnext.profiles import ProfileError, available_profiles, parse_profile, select_profile
from h200_tiny_facts import h200_facts, write_h200_facts
from lead_fixtures import base_facts, split_shell_line

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "fixtures" / "standin_vllm"))
from harness import free_port  # noqa: E402

TINY_MODEL = REPO / "checks" / "gpu" / "tiny" / "tiny_model.py"
PROFILE = "h200-tiny"


def vllm_python() -> str | None:
    return os.environ.get("FLASHNEXT_VLLM_PY") or None


def needs_vllm_python() -> str:
    py = vllm_python()
    if py is None:
        pytest.skip("FLASHNEXT_VLLM_PY is not set (checks/run sets it to the pinned vLLM env)")
    return py


def prepare_table(model: Path, table: Path) -> None:
    table.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(model),
         "--out", str(table), "--force"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["tiny_model", "skeleton"])
def host(request, tmp_path_factory):
    """(model dir, table, facts file, port) of one checkpoint kind on the H200 host."""
    root = tmp_path_factory.mktemp(f"h200-{request.param}")
    model = root / "tiny"
    if request.param == "tiny_model":
        py = needs_vllm_python()
        subprocess.run([py, str(TINY_MODEL), str(model)], check=True, timeout=600)
    else:
        from flashnext.skeleton import write_skeleton

        write_skeleton(model, "tiny", fixed_metadata=True)
    table = root / "tables" / "ple.bin"
    prepare_table(model, table)
    port = free_port()
    facts = write_h200_facts(root / "facts.json", model, table, port)
    return model, table, facts, port


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def plan_args(host) -> list[str]:
    model, table, facts, port = host
    return ["--facts", str(facts), "--profile", PROFILE, "--model", str(model),
            "--table", str(table), "--port", str(port)]  # fmt: skip


def serve_args(host) -> list[str]:
    """plan_args for serve, which replays facts only through its testing flag."""
    return ["--replay-facts-for-testing", *plan_args(host)[1:]]


# ---------------------------------------------------------------- the profile


def test_the_profile_loads_beside_the_default():
    profiles = available_profiles()
    tiny, default = profiles[PROFILE], profiles["3x3090"]
    assert default.default and not tiny.default
    assert (tiny.gpu.name, tiny.gpu.count, tiny.parallel.pipeline_parallel_size) == ("H200", 1, 1)
    assert tiny.scheduler == default.scheduler.__class__(24576, 4, 512, False)
    assert tiny.compilation == default.compilation  # FULL_DECODE_ONLY, sizes 1, 2, 4
    assert tiny.memory.kv_cache_memory_bytes_max == 256 << 20
    assert tiny.memory.gpu_memory_utilization == 0.1
    q = tiny.qsa_offload
    assert (q.enabled, q.chunk_tokens, q.max_host_bytes) == (True, 1024, 16 << 30)
    assert tiny.table.medium_check == "warn"
    assert tiny.vllm.additional_config == {"gdn_prefill_backend": "triton"}
    assert tiny.env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert tiny.env["NCCL_NVLS_ENABLE"] == "0"
    # The 3x3090 profile has neither [table] nor [vllm]: the defaults change nothing.
    assert default.table.medium_check == "fail" and default.vllm.additional_config == {}


def test_a_test_profile_is_chosen_by_name_only(tmp_path):
    # A host with exactly one H200 is not a test host: without --profile it gets the
    # default (and preflight then says its GPUs do not match), never h200-tiny.
    model = tmp_path / "m"  # only the GPUs matter for the choice
    facts = h200_facts(model, tmp_path / "t.bin", free_port())
    parsed = host_facts_from_json(json.dumps(facts), source="h200")
    assert select_profile(parsed, None) == (
        available_profiles()["3x3090"],
        "default profile (no profile matches the 1 GPU(s) in the facts)",
    )
    assert select_profile(parsed, PROFILE) == (
        available_profiles()[PROFILE],
        "chosen with --profile",
    )
    assert select_profile(base_facts(), None)[0].name == "3x3090"
    assert available_profiles()[PROFILE].auto_select is False
    assert available_profiles()["3x3090"].auto_select is True
    text = (resources.files("flashnext.profiles") / "h200-tiny.toml").read_text()
    with pytest.raises(ProfileError, match="auto_select must be true or false"):
        parse_profile(text.replace("auto_select = false", 'auto_select = "no"'), "x.toml")


def test_the_optional_sections_are_validated():
    text = (resources.files("flashnext.profiles") / "h200-tiny.toml").read_text()
    bad = text.replace('medium_check = "warn"', 'medium_check = "maybe"')
    with pytest.raises(ProfileError, match="table.medium_check must be 'fail' or 'warn'"):
        parse_profile(bad, "x.toml")
    typo = text.replace("additional_config =", "additional_cfg =")
    with pytest.raises(ProfileError, match=r"x.toml \[vllm\]: unknown additional_cfg"):
        parse_profile(typo, "x.toml")


# ---------------------------------------------------------------- preflight and plan


def test_preflight_passes_on_the_h200(host):
    result = invoke("preflight", *plan_args(host), "--json")
    doc = json.loads(result.output)
    assert result.exit_code == 0, result.output
    levels = {f["id"]: f["level"] for f in doc["findings"]}
    assert doc["profile"] == PROFILE and doc["result"] == "warn"
    # the one warning: the virtio disk that calls itself rotational, accepted by the profile
    assert {k for k, v in levels.items() if v != "ok"} == {"table.medium"}
    medium = next(f for f in doc["findings"] if f["id"] == "table.medium")
    assert "rotational" in medium["message"] and "profile h200-tiny accepts it" in medium["message"]
    for check in ("gpu.count", "gpu0.vram", "gpu0.compute_capability", "gpu0.idle", "gpu0.pcie",
                  "host.ram", "host.memlock", "pp.ple_rank", "kv.capacity", "rank0.vram",
                  "model.quant_groups", "model.sampling", "table.size", "port"):  # fmt: skip
        assert levels[check] == "ok", check
    plan = doc["plan"]
    assert plan["pp_ranges"] == [[0, plan["pp_ranges"][0][1]]] and plan["ple_ranks"] == [0]
    assert plan["kv_cache_memory_bytes"]["value"] == 256 << 20
    assert plan["qsa"]["num_blocks"] * plan["qsa"]["block_tokens"] >= 4 * 24576


def test_the_3x3090_profile_still_refuses_that_disk(host):
    # Same host, the default profile: the rotational table is still a failure there.
    result = invoke("preflight", *plan_args(host), "--profile", "3x3090", "--json")
    assert result.exit_code == 1
    medium = next(f for f in json.loads(result.output)["findings"] if f["id"] == "table.medium")
    assert medium["level"] == "fail" and "accepts it" not in medium["message"]


def test_the_dry_run_command(host, patched_vllm_env):
    model, table, _, port = host
    result = invoke("serve", *serve_args(host), "--dry-run")
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    assert env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "HF_HUB_OFFLINE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "0",
        "VLLM_QSA_KV_OFFLOAD": "1",
        "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS": "1024",
        "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES": str(16 << 30),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    assert argv == [
        str(patched_vllm_env / "venv" / "bin" / "vllm"), "serve", str(model),
        "--served-model-name", "qwen3.8-flash-next",
        "--host", "127.0.0.1", "--port", str(port),
        "--pipeline-parallel-size", "1", "--tensor-parallel-size", "1",
        "--max-model-len", "24576", "--max-num-seqs", "4", "--max-num-batched-tokens", "512",
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.1",
        "--kv-cache-memory-bytes", str(256 << 20),
        "--compilation-config",
        '{"cudagraph_capture_sizes":[1,2,4],"cudagraph_mode":"FULL_DECODE_ONLY","mode":0}',
        "--additional-config", '{"gdn_prefill_backend":"triton"}',
        "--language-model-only",
        "--engram-config", json.dumps({"mmap_path": str(table)}, separators=(",", ":")),
    ]  # fmt: skip


def test_the_3x3090_command_has_no_additional_config(full_skeleton):
    facts = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
    result = invoke("serve", "--dry-run", "--replay-facts-for-testing", str(facts), "--model",
                    str(full_skeleton), "--table", "/nvme/flashnext/ple-table.bin")  # fmt: skip
    assert result.exit_code == 0, result.output
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    assert "--additional-config" not in argv
    assert set(env) == {
        "CUDA_DEVICE_ORDER", "PYTORCH_CUDA_ALLOC_CONF", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",
        "VLLM_QSA_KV_OFFLOAD", "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS",
        "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES",
        "NCCL_P2P_DISABLE",  # the facts' 3090s have no P2P (issue 13, finding 10)
    }  # fmt: skip


# ---------------------------------------------------------------- vLLM's own parser

VLLM_SIDE = r"""
import json, os, sys
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
import vllm.envs as envs

request = json.load(sys.stdin)
ns = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(request["argv"])
ns.model = ns.model_tag  # as `vllm serve` does (vllm/entrypoints/cli/serve.py)
args = AsyncEngineArgs.from_cli_args(ns)  # every flag lands in an engine field

def j(v):
    if hasattr(v, "model_dump"):
        return v.model_dump(mode="json")
    if hasattr(v, "__dataclass_fields__"):
        import dataclasses
        return json.loads(json.dumps(dataclasses.asdict(v), default=str))
    return v

keys = ["model_tag", "served_model_name", "host", "port", "pipeline_parallel_size",
        "tensor_parallel_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
        "enable_prefix_caching", "gpu_memory_utilization", "kv_cache_memory_bytes",
        "compilation_config", "additional_config", "language_model_only", "engram_config"]
out = {k: j(getattr(ns, k, None)) for k in keys}
out["engine_additional_config"] = j(args.additional_config)
out["engine_model"] = args.model
out["unknown_env"] = [k for k in request["env"] if k.startswith("VLLM_")
                      and k not in envs.environment_variables]
print(json.dumps(out, default=str))
"""


def test_vllm_parses_the_dry_run_command(host):
    py = needs_vllm_python()
    model, table, _, port = host
    result = invoke("serve", *serve_args(host), "--dry-run")
    env, argv = split_shell_line(result.output.strip().splitlines()[-1])
    assert Path(argv[0]).name == "vllm" and argv[1] == "serve"
    proc = subprocess.run(
        [py, "-c", VLLM_SIDE],
        input=json.dumps({"argv": argv[2:], "env": env}),
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ns = json.loads(proc.stdout.strip().splitlines()[-1])
    assert ns["model_tag"] == ns["engine_model"] == str(model)
    assert ns["served_model_name"] == ["qwen3.8-flash-next"]
    assert (ns["host"], ns["port"]) == ("127.0.0.1", port)
    assert (ns["pipeline_parallel_size"], ns["tensor_parallel_size"]) == (1, 1)
    assert (ns["max_model_len"], ns["max_num_seqs"], ns["max_num_batched_tokens"]) == (
        24576,
        4,
        512,
    )
    assert ns["enable_prefix_caching"] is False
    assert ns["gpu_memory_utilization"] == 0.1
    assert ns["kv_cache_memory_bytes"] == 256 << 20
    comp = ns["compilation_config"]
    assert comp["mode"] == 0 and comp["cudagraph_capture_sizes"] == [1, 2, 4]
    assert ns["additional_config"] == {"gdn_prefill_backend": "triton"}
    assert ns["engine_additional_config"] == {"gdn_prefill_backend": "triton"}
    assert ns["language_model_only"] is True
    assert ns["engram_config"]["mmap_path"] == str(table)
    # every VLLM_* variable the plan sets is one vLLM (with our patches) registers
    assert ns["unknown_env"] == []
