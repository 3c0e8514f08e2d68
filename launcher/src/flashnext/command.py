"""Plan → the `vllm serve` argv and environment.

Flag names are vLLM 0.33.0's own (a test parses our argv with vLLM's parser).
`--compilation-config` is emitted as ONE JSON object: mixing it with a dotted
`--compilation-config.x` makes 0.33.0 silently drop the JSON (SPEC row CLI).
"""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING

from flashnext.profiles import Profile

if TYPE_CHECKING:
    from flashnext.host_pools import HostPools
    from flashnext.plan import PlanOptions

# Knobs our patch series adds to vLLM (patches/vllm-0.33.0/): registered in
# vllm/envs.py or as EngramConfig fields, never read ad hoc.
ENV_QSA_OFFLOAD = "VLLM_QSA_KV_OFFLOAD"  # 0020: host K/V arenas on
ENV_QSA_OFFLOAD_MAX_HOST_BYTES = "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES"  # 0020: cap per rank
ENV_QSA_OFFLOAD_CHUNK_TOKENS = "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS"  # 0020: prefill chunk
ENGRAM_MMAP_PATH = "mmap_path"  # 0010: EngramConfig field, the PLE table file


def compilation_config_json(profile: Profile) -> str:
    comp = profile.compilation
    doc = {
        "mode": comp.mode,
        "cudagraph_mode": comp.cudagraph_mode,
        "cudagraph_capture_sizes": list(comp.cudagraph_capture_sizes),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def build_command(
    profile: Profile,
    options: PlanOptions,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    qsa: HostPools | None,
    topology_env: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """`topology_env`: variables the GPU topology calls for (plan.nccl_env)."""
    sched = profile.scheduler
    argv = ["vllm", "serve", options.model_dir or "MODEL_DIR"]
    argv += ["--served-model-name", options.served_model_name]
    argv += ["--host", options.host, "--port", str(options.port)]
    # Nothing in the model divides by 3: pipeline, not tensor, parallel.
    argv += ["--pipeline-parallel-size", str(profile.parallel.pipeline_parallel_size)]
    argv += ["--tensor-parallel-size", str(profile.parallel.tensor_parallel_size)]
    argv += ["--max-model-len", str(max_model_len)]
    argv += ["--max-num-seqs", str(sched.max_num_seqs)]
    # With prefix caching off this is the prefill chunk size.
    argv += ["--max-num-batched-tokens", str(sched.max_num_batched_tokens)]
    argv += [
        "--enable-prefix-caching" if sched.enable_prefix_caching else "--no-enable-prefix-caching"
    ]
    argv += ["--gpu-memory-utilization", str(profile.memory.gpu_memory_utilization)]
    # Setting KV bytes skips vLLM's memory profiling (and its cudagraph double count).
    argv += ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]
    argv += ["--compilation-config", compilation_config_json(profile)]
    if profile.vllm.additional_config:  # one JSON object, like --compilation-config
        extra = json.dumps(profile.vllm.additional_config, sort_keys=True, separators=(",", ":"))
        argv += ["--additional-config", extra]
    # The checkpoint ships a vision tower; text serving keeps it off the GPUs.
    argv += ["--language-model-only"]
    if options.table_path:
        engram = {ENGRAM_MMAP_PATH: options.table_path}
        argv += ["--engram-config", json.dumps(engram, sort_keys=True, separators=(",", ":"))]
    if options.generation_config_dir:
        argv += ["--generation-config", options.generation_config_dir]

    env = dict(profile.env)
    env.update(topology_env or {})
    if options.pp_layer_partition:
        env["VLLM_PP_LAYER_PARTITION"] = options.pp_layer_partition
    if qsa is not None:
        env[ENV_QSA_OFFLOAD] = "1"
        env[ENV_QSA_OFFLOAD_MAX_HOST_BYTES] = str(profile.qsa_offload.max_host_bytes)
        env[ENV_QSA_OFFLOAD_CHUNK_TOKENS] = str(profile.qsa_offload.chunk_tokens)
    return argv, env


def shell_line(argv: tuple[str, ...] | list[str], env: dict[str, str]) -> str:
    """The command as one pasteable shell line: `env K=V ... vllm serve ...`."""
    assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())]
    return " ".join(["env", *assignments, *(shlex.quote(a) for a in argv)])
