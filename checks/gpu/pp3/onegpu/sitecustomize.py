"""Test-only shim: vLLM's pipeline-parallel ranks all on one GPU.

Active only when FLASHNEXT_PP_ONE_GPU=1 and this folder is first on
PYTHONPATH (checks/gpu/pp3 sets both; nothing shipped does). Two things stop
three ranks sharing cuda:0, and each is bent here, nowhere else:

- every worker asks ParallelConfig.get_local_gpu_index which GPU to take;
  here it is always 0;
- NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). A distinct
  NCCL_HOSTID per rank makes NCCL treat them as separate hosts that talk over
  loopback sockets (NCCL_SOCKET_IFNAME=lo). It is set in that same call, which
  vLLM makes before it starts NCCL.

The caller also passes distributed_executor_backend="mp" (or
--distributed-executor-backend mp), which skips vLLM's GPU-count check.
Every result written under this shim says so (`emulated`: true).
"""

import os

if os.environ.get("FLASHNEXT_PP_ONE_GPU") == "1":
    try:
        from vllm.config import parallel as _parallel

        def _every_rank_on_gpu0(self, local_rank, dp_local_rank=None):
            os.environ["NCCL_HOSTID"] = f"flashnext-onegpu-rank{local_rank}"
            return 0

        _parallel.ParallelConfig.get_local_gpu_index = _every_rank_on_gpu0
    except Exception as exc:  # noqa: BLE001 - a shim that did not apply must say so, not crash
        print(f"flashnext pp3 shim: not applied: {exc!r}", flush=True)
