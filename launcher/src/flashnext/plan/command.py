"""A finished Plan → the `vllm serve` argv (the environment is the plan's).

Flag names are vLLM 0.33.0's own (a test parses our argv with vLLM's parser).
`--compilation-config` is emitted as ONE JSON object: mixing it with a dotted
`--compilation-config.x` makes 0.33.0 silently drop the JSON (SPEC row CLI).
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass
from typing import Any

from flashnext.facts.schema import dumps
from flashnext.plan import speed_basis
from flashnext.plan.decode_graphs import decode_capture_sizes
from flashnext.plan.options import PlanOptions
from flashnext.plan.planner import Plan
from flashnext.profiles import Profile

ENGRAM_MMAP_PATH = "mmap_path"  # 0010: EngramConfig field, the PLE table file


def compilation_config_json(profile: Profile, num_speculative_tokens: int = 0) -> str:
    comp = profile.compilation
    doc = {
        "mode": comp.mode,
        "cudagraph_mode": comp.cudagraph_mode,
        "cudagraph_capture_sizes": decode_capture_sizes(
            comp.cudagraph_capture_sizes, num_speculative_tokens
        ),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class ServeCommand:
    """What serve executes: `vllm serve` argv (argv[0] is replaced by the chosen env's
    executable at exec time) and the environment added to the caller's."""

    argv: tuple[str, ...]
    env: dict[str, str]


def path_argument(path: str) -> str:
    """`path` as vLLM must receive it to open that same path: a relative path beginning
    with "-" would be read as an option by vLLM's argument parser; "./" keeps it a
    path. Every other character reaches vLLM as it is (argv, not a shell)."""
    return f"./{path}" if path.startswith("-") else path


def serve_command(plan: Plan, profile: Profile, options: PlanOptions) -> ServeCommand:
    """The plan rendered as `vllm serve` flags, each commented with why."""
    sched = profile.scheduler
    argv = ["vllm", "serve", path_argument(options.model_dir or "MODEL_DIR")]
    name = options.served_model_name
    # A name beginning with "-" goes as --flag=NAME, or vLLM would read it as an option.
    argv += (
        [f"--served-model-name={name}"] if name.startswith("-") else ["--served-model-name", name]
    )
    argv += ["--host", options.host, "--port", str(options.port)]
    # Nothing in the model divides by 3: pipeline, not tensor, parallel.
    argv += ["--pipeline-parallel-size", str(profile.parallel.pipeline_parallel_size)]
    argv += ["--tensor-parallel-size", str(profile.parallel.tensor_parallel_size)]
    argv += ["--max-model-len", str(plan.max_model_len.value)]
    argv += ["--max-num-seqs", str(sched.max_num_seqs)]
    # With prefix caching off this is the prefill chunk size.
    argv += ["--max-num-batched-tokens", str(sched.max_num_batched_tokens)]
    argv += [
        "--enable-prefix-caching" if sched.enable_prefix_caching else "--no-enable-prefix-caching"
    ]
    argv += ["--gpu-memory-utilization", str(profile.memory.gpu_memory_utilization)]
    # Setting KV bytes skips vLLM's memory profiling (and its cudagraph double count).
    argv += ["--kv-cache-memory-bytes", str(plan.kv_cache_memory_bytes.value)]
    drafts = profile.mtp.num_speculative_tokens if plan.mtp is not None and plan.mtp.fits else 0
    argv += ["--compilation-config", compilation_config_json(profile, drafts)]
    if profile.vllm.additional_config:  # one JSON object, like --compilation-config
        extra = json.dumps(profile.vllm.additional_config, sort_keys=True, separators=(",", ":"))
        argv += ["--additional-config", extra]
    # The checkpoint ships a vision tower; text serving keeps it off the GPUs.
    argv += ["--language-model-only"]
    if options.table_path:
        engram = {ENGRAM_MMAP_PATH: path_argument(options.table_path)}
        argv += ["--engram-config", json.dumps(engram, sort_keys=True, separators=(",", ":"))]
    if plan.mtp is not None and plan.mtp.fits:
        # One JSON object, like --compilation-config.
        spec = {"method": "mtp", "num_speculative_tokens": drafts}
        argv += ["--speculative-config", json.dumps(spec, sort_keys=True, separators=(",", ":"))]
        # The drafter's routed experts and embedding in pinned host memory, read in
        # place (patch 0031): the segments select nothing of the target's, and the
        # GiB cover exactly what they select (plan/mtp.py).
        argv += ["--cpu-offload-gb", plan.mtp.cpu_offload_gb]
        argv += ["--cpu-offload-params", *plan.mtp.offload_params]
    if options.generation_config_dir:
        argv += ["--generation-config", path_argument(options.generation_config_dir)]
    return ServeCommand(tuple(argv), dict(plan.env))


def plan_json(plan: Plan, command: ServeCommand) -> dict[str, Any]:
    """`plan --json`: the plan's JSON with the argv, hashed over both (canonical JSON)."""
    doc = plan.to_json()
    doc.pop("plan_hash")
    doc["argv"] = list(command.argv)
    doc["plan_hash"] = hashlib.sha256(dumps(doc).encode()).hexdigest()
    # What the speed figures rest on, outside the hash: a run filling in a basis
    # changes no plan (results record plan hashes as the argv's identity).
    doc["speed_basis"] = speed_basis.to_json(plan.profile)
    return doc


def shell_line(argv: tuple[str, ...] | list[str], env: dict[str, str]) -> str:
    """The command as one pasteable shell line: `env K=V ... vllm serve ...`."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return " ".join(["env", *assignments, *(shlex.quote(a) for a in argv)])
