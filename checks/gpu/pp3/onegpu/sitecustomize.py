"""Test-only shim: vLLM's pipeline-parallel ranks all on one GPU.

Active only when FLASHNEXT_PP_ONE_GPU=1 and this folder is first on
PYTHONPATH (checks/gpu/pp3 and `checks/gpu/serve/serve-tiny` with PP_ONE_GPU=1 set
both; nothing shipped does; the values are checks/gpu/pp3/emulation.py's).
Three things stop three ranks sharing cuda:0, and each is bent here, nowhere
else:

- vLLM refuses a world size above the GPU count unless the executor backend
  is given ("World size (3) is larger than the number of available GPUs
  (1)"). The harness passes distributed_executor_backend="mp"; a `vllm serve`
  started by the launcher runs the plan's argv, which names no backend. Here
  a ParallelConfig with pipeline_parallel_size > 1 and no backend gets "mp",
  what vLLM itself picks when the GPUs are there;
- every worker asks ParallelConfig.get_local_gpu_index which GPU to take;
  here it is always 0;
- NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). A distinct
  NCCL_HOSTID per rank makes NCCL treat them as separate hosts that talk over
  loopback sockets (NCCL_SOCKET_IFNAME=lo). It is set in that same call, which
  vLLM makes before it starts NCCL.

The patch is applied when vllm.config.parallel is first imported (an import
hook), so a process that never imports vLLM (the launcher that starts `vllm
serve`, the bench client) never does either. Every result written under this
shim says so (`emulated`: true).
"""

import os
import sys

_TARGET = "vllm.config.parallel"


def _patch(module):
    cls = module.ParallelConfig

    def _every_rank_on_gpu0(self, local_rank, dp_local_rank=None):
        os.environ["NCCL_HOSTID"] = f"flashnext-onegpu-rank{local_rank}"
        return 0

    post_init = cls.__post_init__

    def _mp_when_no_backend(self):
        if self.distributed_executor_backend is None and self.pipeline_parallel_size > 1:
            self.distributed_executor_backend = "mp"
        post_init(self)

    cls.get_local_gpu_index = _every_rank_on_gpu0
    cls.__post_init__ = _mp_when_no_backend


def _patch_or_say(module):
    try:
        _patch(module)
    except Exception as exc:  # noqa: BLE001 - a shim that did not apply must say so, not crash
        print(f"flashnext pp3 shim: not applied: {exc!r}", flush=True)


class AfterImport:
    """A meta path finder for one module: it is found and loaded as usual, then
    `then(module)` runs before anyone can use it."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec
        then = self.then

        def exec_then(module):
            exec_module(module)
            then(module)

        loader.exec_module = exec_then  # this spec's own loader instance
        return spec


def after_import(name, then):
    """`then(module)` now if `name` is imported already, else as soon as it is.
    The perf shim (checks/gpu/perf/onegpu_perf/sitecustomize.py) hooks its own
    module through this one."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, AfterImport(name, then))


if os.environ.get("FLASHNEXT_PP_ONE_GPU") == "1":
    after_import(_TARGET, _patch_or_say)
