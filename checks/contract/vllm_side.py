"""Runs under the pinned vLLM env's python (not the launcher's): asks vLLM itself.

    python vllm_side.py parse  < argv.json     # vllm serve's own parser
    python vllm_side.py pp     < cases.json    # vllm.distributed.utils.get_pp_indices

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


def parse(argv: list[str]) -> dict:
    from vllm.config.offload import UVAOffloadConfig
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    ns = parser.parse_args(argv)
    out = {k: jsonable(getattr(ns, k, None)) for k in FIELDS}
    # The offloader's byte budget, as vllm/model_executor/offloader/base.py computes it
    # from the validated config.
    uva = UVAOffloadConfig(
        cpu_offload_gb=ns.cpu_offload_gb, cpu_offload_params=ns.cpu_offload_params
    )
    out["cpu_offload_max_bytes"] = int(uva.cpu_offload_gb * 1024**3)
    return out


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
    result = {"parse": parse, "pp": pp}[sys.argv[1]](request)
    sys.stdout.write(json.dumps(result, sort_keys=True))
