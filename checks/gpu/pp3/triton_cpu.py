"""Run the pinned vLLM's Triton kernels on CPU, through Triton's interpreter.

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python SCRIPT   (VLLM_TARGET_DEVICE unset)

`enable()` makes the pinned tree's GDN kernels runnable here, changing no
kernel: vLLM keeps Triton only when one driver is active or the devices are
emptied (hence CUDA_VISIBLE_DEVICES=); on a CPU platform it would swap in
its CPU ops instead (hence no VLLM_TARGET_DEVICE). What the interpreter
itself lacks is bridged:

- causal_conv1d_fn's grid function stores plain tensors into META
  (batch_ptr); they are converted as the interpreter converts arguments;
- FLA binds `tl.exp` and its kin to module names at import, and the
  interpreter patches `tl` only while a kernel runs: those names are bound
  to jitted functions that look `tl.exp` up then;
- autotuners cannot time here: each runs its first config;
- nothing can be pinned without a driver: vLLM's PIN_MEMORY flags are off.

bf16 is not interpreted faithfully (causal_conv1d_fn returns NaN for bf16
input where fp16 and fp32 return numbers); scripts use fp16 or fp32.
FLA's chunk prefill kernel cannot run (a loop index used as a tensor).
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl


# Jitted stand-ins for FLA's import-time aliases of tl.exp & co.: they look
# `tl.exp` up when a kernel runs, after the interpreter has patched `tl`
# (a jitted function must see `tl` among its module's names).
@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _exp2(x):
    return tl.exp2(x)


@triton.jit
def _log(x):
    return tl.log(x)


@triton.jit
def _log2(x):
    return tl.log2(x)


def enable() -> None:
    for name, wanted in (("TRITON_INTERPRET", "1"), ("CUDA_VISIBLE_DEVICES", "")):
        if os.environ.get(name) != wanted:
            raise SystemExit(f"run with {name}={wanted!r}")
    if "VLLM_TARGET_DEVICE" in os.environ:
        raise SystemExit("unset VLLM_TARGET_DEVICE (a CPU platform swaps the kernels out)")

    import torch
    import triton.runtime.interpreter as interpreter

    grid_executor_init = interpreter.GridExecutor.__init__

    def init(self, fn, arg_names, grid, *rest):
        if callable(grid):
            inner = grid

            def grid(args):
                size = inner(args)
                for name, value in list(args.items()):
                    if isinstance(value, torch.Tensor):
                        args[name] = interpreter._implicit_cvt(value)
                return size

        grid_executor_init(self, fn, arg_names, grid, *rest)

    interpreter.GridExecutor.__init__ = init

    # The modules whose kernels the scripts run, imported before they are patched.
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn  # noqa: F401
    import vllm.v1.attention.backends.gdn_attn  # noqa: F401
    from vllm.third_party.flash_linear_attention.ops import op

    late = [(op.exp, _exp), (op.exp2, _exp2), (op.log, _log), (op.log2, _log2)]
    for module in _vllm_modules():
        if module.__name__.startswith("vllm.third_party.flash_linear_attention"):
            for name, value in list(vars(module).items()):
                for bound, jitted in late:
                    if value is bound:
                        setattr(module, name, jitted)
        if getattr(module, "PIN_MEMORY", None) is True:
            module.PIN_MEMORY = False

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
    import capture  # the harness's own finder of vLLM's autotuners

    capture.pin_autotune(None)


def _vllm_modules():
    return [
        m
        for n, m in list(sys.modules.items())
        if m is not None and (n == "vllm" or n.startswith("vllm."))
    ]
