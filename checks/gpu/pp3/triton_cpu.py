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
- a comparison's result carries its operands' element type (fp32 for
  `x > y` on floats) with bool data; splatting such a scalar (`mask &
  (lse_max > -inf)`, QSA's split-K merge) then makes fp32 data, and `&`
  fails: comparisons are given the int1 type a compiled kernel gives them;
- bf16 is held as its raw uint16 bits: `tl.dot` multiplied the bits as
  integers, and fp32 -> bf16 truncated (a GPU rounds to nearest even).
  bf16 dot operands are widened to fp32 (exact; the dot accumulates in
  fp32 as an MMA does) and both casts go through torch (exact widening,
  round to nearest even), as QSA's kernels need;
- autotuners cannot time here: each runs its first config;
- nothing can be pinned without a driver: vLLM's PIN_MEMORY flags are off.

Other bf16 arithmetic is not interpreted faithfully (causal_conv1d_fn
returns NaN for bf16 input where fp16 and fp32 return numbers); the GDN
scripts use fp16 or fp32.
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


def _bf16_to_f32(bits):
    import numpy as np

    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values):
    import numpy as np
    import torch

    rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).bfloat16()
    return rounded.view(torch.int16).numpy().view(np.uint16)


def _bf16_cast(cast_impl):
    """cast_impl with bf16 <-> fp32 done as a GPU does it."""
    from triton.runtime.interpreter import TensorHandle

    def cast(self, src, dst_type):
        source, target = src.dtype.scalar, dst_type.scalar
        if source == tl.bfloat16 and target == tl.float32:
            return TensorHandle(_bf16_to_f32(src.data), tl.float32)
        if source == tl.float32 and target == tl.bfloat16:
            return TensorHandle(_f32_to_bf16(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    return cast


def _bf16_dot(create_dot):
    """create_dot with bf16 operands widened to fp32 (exact)."""
    from triton.runtime.interpreter import TensorHandle

    def widen(x):
        if x.dtype.scalar == tl.bfloat16:
            return TensorHandle(_bf16_to_f32(x.data), tl.float32)
        return x

    def dot(self, a, b, d, *rest):
        return create_dot(self, widen(a), widen(b), d, *rest)

    return dot


def _int1_result(name: str):
    """The interpreter's comparison `name`, its result typed int1."""
    import triton.runtime.interpreter as interpreter

    compare = getattr(interpreter.InterpreterBuilder, name)

    def create(self, lhs, rhs):
        return interpreter.TensorHandle(compare(self, lhs, rhs).data, tl.int1)

    return create


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

    builder = interpreter.InterpreterBuilder
    builder.cast_impl = _bf16_cast(builder.cast_impl)
    builder.create_dot = _bf16_dot(builder.create_dot)
    for name in dir(interpreter.InterpreterBuilder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(interpreter.InterpreterBuilder, name, _int1_result(name))

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
