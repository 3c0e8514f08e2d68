"""Test-only: the PP=3-on-one-GPU shim plus issue 27's per-process hooks.

First on PYTHONPATH for the perf harness (checks/gpu/perf/pp3_perf.py); every
process of the engine (the engine core, the three workers) imports it at
start. Python imports one `sitecustomize`, so this one runs the PP=3 shim's
(checks/gpu/pp3/onegpu/sitecustomize.py, unchanged, by path; its import hook
serves the kernels' patch below too) and then:

- FLASHNEXT_PERF_3090_KERNELS=1: the kernels a 3090 takes. When vLLM's
  Humming priority module is imported, its sm90 preference is emptied
  (rank_fit_worker.select_3090_kernels does the same in-process; here it
  reaches the spawned workers). VLLM_DISABLED_KERNELS (the harness's env)
  leaves out Machete and CUTLASS W4A8.
- FLASHNEXT_PERF_MEMORY=1: a thread samples, every 20 ms, NVML's memory
  for this process (nvmlDeviceGetComputeRunningProcesses, matched by pid;
  `pid_visible` false when the container's pids are not NVML's), torch's
  reserved bytes and its peak of allocated bytes (max_memory_allocated: the
  tensors' own need; p1's reserved peaks, on a card with room to spare,
  were over the plan by 1.4-2.5 GB and cannot say whether a 3090 would
  need them), and keeps the peak of each phase ("start" until the harness
  closes it through step_probe.memory).

Imports nothing of vLLM or torch itself; nothing shipped imports it.
"""

import importlib.util
import os
import sys
import threading
import time

_SHIM = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "pp3",
    "onegpu",
    "sitecustomize.py",
)


def _load_pp3_shim():
    """The PP=3 shim, by path; it acts only under FLASHNEXT_PP_ONE_GPU=1, and its
    import hook (`after_import`) serves this shim too."""
    spec = importlib.util.spec_from_file_location("_flashnext_pp3_onegpu", _SHIM)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_HUMMING = "vllm.model_executor.layers.quantization.utils.humming.priority"


def _no_humming_preference(module):
    module._HUMMING_PREFERRED_CAPABILITIES = frozenset()


class MemorySampler:
    PERIOD_S = 0.02
    KINDS = ("nvml", "reserved", "allocated")

    def __init__(self):
        self.pid = os.getpid()
        self.phase = "start"
        self.peaks = {}
        self.pid_visible = None
        self.lock = threading.Lock()
        self._nvml = None
        threading.Thread(target=self._run, daemon=True, name="perf-memory").start()

    def _sample(self):
        nvml_bytes = None
        if self._nvml is not None:
            pynvml, handle = self._nvml
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            mine = [p.usedGpuMemory for p in procs if p.pid == self.pid and p.usedGpuMemory]
            if mine:
                self.pid_visible = True
                nvml_bytes = int(sum(mine))
            elif procs and self.pid_visible is None:
                self.pid_visible = False
        reserved = allocated = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            reserved = int(torch.cuda.memory_reserved())
            # The allocator's own peak since its last reset: spikes between
            # samples are in it (vLLM resets it while profiling; a sample
            # before that keeps what came before).
            allocated = int(torch.cuda.max_memory_allocated())
        return nvml_bytes, reserved, allocated

    def _run(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # noqa: BLE001 - recorded as no NVML view
            self._nvml = None
        while True:
            try:
                sample = self._sample()
            except Exception:  # noqa: BLE001 - a failed sample is skipped
                sample = (None,) * len(self.KINDS)
            self.record(sample)
            time.sleep(self.PERIOD_S)

    def record(self, sample):
        """Keep each kind's peak in the current phase."""
        with self.lock:
            peak = self.peaks.setdefault(self.phase, dict.fromkeys(self.KINDS))
            for key, value in zip(self.KINDS, sample, strict=True):
                if value is not None and (peak[key] is None or value > peak[key]):
                    peak[key] = value

    def close_phase(self, next_phase):
        with self.lock:
            done = dict(self.peaks)
            self.phase = next_phase
        return {"pid": self.pid, "pid_visible": self.pid_visible, "peaks": done}


PERF_SAMPLER = None
_pp3 = _load_pp3_shim()
if os.environ.get("FLASHNEXT_PERF_3090_KERNELS") == "1":
    _pp3.after_import(_HUMMING, _no_humming_preference)
if os.environ.get("FLASHNEXT_PERF_MEMORY") == "1":
    PERF_SAMPLER = MemorySampler()
