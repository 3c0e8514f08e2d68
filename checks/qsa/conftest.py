"""CPU proofs of the QSA offload kernels' algorithm (no GPU, no vLLM import).

Needs torch and triton (the pinned vLLM env has both). The kernel module is
read out of patches/vllm-0.33.0/0021-qsa-offload-kernels.patch, never copied.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

torch = pytest.importorskip("torch", reason="checks/qsa needs torch (use the vLLM env python)")


@pytest.fixture(scope="session")
def offload():
    from qsa_module import load_offload_module

    return load_offload_module()
