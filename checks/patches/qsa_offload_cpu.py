"""QSA K/V offload (patches 0020-0022) on CPU, for the proofs that plan and bind it.

The offload's host arena pins memory with cudaHostRegister, and the QSA layer
asks for flash-attn varlen before it builds: neither exists here. `offload_on_cpu`
sets VLLM_QSA_KV_OFFLOAD=1, answers the flash-attn check yes and puts `CpuArena`
(HostArena's interface over plain CPU memory) in the arena's place. On the stock
tree there is no offload module; the proofs then fail on what they check.
"""

from __future__ import annotations

import pytest


class CpuArena:
    """HostArena's interface over plain CPU memory (no cudaHostRegister here)."""

    created: list[CpuArena] = []

    def __init__(self, shape, dtype, device):
        import torch

        self.host = torch.zeros(shape, dtype=dtype)
        self.device_view = self.host
        self.nbytes = self.host.numel() * self.host.element_size()
        self.released = False
        CpuArena.created.append(self)

    def release(self):
        self.released = True
        self.device_view = self.host = None


def offload_on_cpu(mp: pytest.MonkeyPatch) -> None:
    mp.setenv("VLLM_QSA_KV_OFFLOAD", "1")
    import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (qsa imports model)
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    mp.setattr(qsa, "is_flash_attn_varlen_func_available", lambda: True)
    try:
        from vllm.models.qwen4_exp.nvidia.ops import qsa_offload
    except ImportError:
        return  # stock tree
    mp.setattr(qsa_offload, "HostArena", CpuArena)
