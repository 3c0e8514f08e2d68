"""Runs under the pinned vLLM env's python (not the launcher's): asks vLLM itself.

    python vllm_side.py parse  < argv.json     # vllm serve's own parser
    python vllm_side.py pp     < cases.json    # vllm.distributed.utils.get_pp_indices
    python vllm_side.py decode_graphs < argv.json   # the V2 runner's decode graphs

Prints one JSON document on stdout. Kept free of flashnext imports: the
launcher never imports vLLM, and vLLM's env need not have the launcher.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

FIELDS = (
    "model_tag",
    "served_model_name",
    "host",
    "port",
    "pipeline_parallel_size",
    "tensor_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "compilation_config",
    "language_model_only",
    "engram_config",
    "generation_config",
    "speculative_config",
    "cpu_offload_gb",
    "cpu_offload_params",
)


def jsonable(value):
    if isinstance(value, set):
        return sorted(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return json.loads(json.dumps(dataclasses.asdict(value), default=str))
    return value


def serve_args(argv: list[str]):
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)


def parse(argv: list[str]) -> dict:
    from vllm.config.offload import UVAOffloadConfig

    ns = serve_args(argv)
    out = {k: jsonable(getattr(ns, k, None)) for k in FIELDS}
    # The offloader's byte budget, as vllm/model_executor/offloader/base.py computes it
    # from the validated config.
    uva = UVAOffloadConfig(
        cpu_offload_gb=ns.cpu_offload_gb, cpu_offload_params=ns.cpu_offload_params
    )
    out["cpu_offload_max_bytes"] = int(uva.cpu_offload_gb * 1024**3)
    return out


def decode_graphs(argv: list[str]) -> dict:
    """Per decode batch of 1..max_num_seqs requests, the token count of the FULL
    graph vLLM's V2 runner replays for it, or None where it runs eager: the
    argv's capture sizes as VllmConfig._set_cudagraph_sizes settles them, then
    the candidates CudaGraphManager._init_candidates builds, both vLLM's own
    code on a CUDA host's values (this CPU platform would turn graphs off, so
    neither gets a whole VllmConfig or a device: only what the two read)."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    ns = serve_args(argv)
    drafts = (ns.speculative_config or {}).get("num_speculative_tokens", 0)
    query_len = 1 + drafts  # VllmConfig.uniform_decode_query_len for MTP
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=ns.compilation_config,
        scheduler_config=SimpleNamespace(
            max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens
        ),
        uniform_decode_query_len=query_len,
        speculative_config=None,  # no dynamic drafts: one decode query length
    )
    VllmConfig._set_cudagraph_sizes(config)
    manager = object.__new__(CudaGraphManager)
    vars(manager).update(
        vllm_config=config,
        compilation_config=config.compilation_config,
        cudagraph_mode=config.compilation_config.cudagraph_mode,
        max_num_reqs=ns.max_num_seqs,
        decode_query_len=query_len,
        varlen_decode=False,  # adaptive verification off
        lora_capture_cases=[0],
        ubatch_runner=None,
        _candidates={},
        _capture_descs={},
    )
    manager._init_candidates()
    graphs = {}
    for n in range(1, ns.max_num_seqs + 1):
        fits = [
            d.num_tokens
            for d in manager._candidates.get((n * query_len, 0), [])
            if d.cg_mode == CUDAGraphMode.FULL
            and d.uniform_token_count == query_len
            and (d.num_reqs or 0) >= n
        ]
        graphs[str(n)] = min(fits) if fits else None
    return {
        "num_speculative_tokens": drafts,
        "capture_sizes": config.compilation_config.cudagraph_capture_sizes,
        "graph_tokens_by_requests": graphs,
    }


def pp(cases: list[dict]) -> list:
    import vllm.envs as envs
    from vllm.distributed.utils import get_pp_indices

    out = []
    for case in cases:
        if case["partition"] is None:
            os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        else:
            os.environ["VLLM_PP_LAYER_PARTITION"] = case["partition"]
        if hasattr(envs, "cache_clear"):  # envs values may be cached per process
            envs.cache_clear()
        try:
            out.append(
                [list(get_pp_indices(case["layers"], r, case["pp"])) for r in range(case["pp"])]
            )
        except ValueError as exc:
            out.append({"error": str(exc)})
    return out


if __name__ == "__main__":
    request = json.load(sys.stdin)
    verbs = {"parse": parse, "pp": pp, "decode_graphs": decode_graphs}
    result = verbs[sys.argv[1]](request)
    sys.stdout.write(json.dumps(result, sort_keys=True))
