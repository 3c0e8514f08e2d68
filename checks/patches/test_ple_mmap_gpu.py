"""Patch 0012's ple_mmap module of the tree under test; on a GPU: pinned staging, H2D, FULL replay.

    pytest checks/patches/test_ple_mmap_gpu.py --vllm-tree=...  # GPU tests skip without CUDA
    python checks/patches/test_ple_mmap_gpu.py                  # same checks, no pytest needed

The module under test is vllm/models/qwen4_exp/common/ple_mmap.py (0012
creates it; 0013 only calls it before forward) of the vLLM tree that `import
vllm` finds, as in every proof: ENV/stock first on PYTHONPATH for the stock
tree, which has no such module (the proofs then fail there, strictly). It is
imported by path, without importing the rest of vLLM: it needs only torch and
the standard library (its docstring says so), so a GPU host needs the tree,
not vLLM's dependencies.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

try:
    import pytest
except ImportError:  # run as a script on a GPU host without pytest
    pytest = None

if pytest is not None:
    torch = pytest.importorskip("torch")  # the launcher venv has no torch
else:
    import torch

PATCH = "0012-qwen4-exp-ple-mmap-backend.patch"
MODULE = Path("models/qwen4_exp/common/ple_mmap.py")  # inside the vllm package
ROWS, DIM, HEADS = 200_003, 160, 16

proves = pytest.mark.proves(PATCH) if pytest else (lambda test: test)
needs_cuda = (
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
    if pytest
    else (lambda test: test)
)


def vllm_package_dir() -> Path:
    """The vllm package `import vllm` would load, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vllm is not on sys.path"
    return Path(spec.origin).parent


def load_ple_mmap() -> ModuleType:
    """ple_mmap.py of the tree under test, imported from its file in that tree."""
    path = vllm_package_dir() / MODULE
    if not path.is_file():
        raise ModuleNotFoundError(f"{path} does not exist (a tree without {PATCH})")
    spec = importlib.util.spec_from_file_location("vllm_tree_ple_mmap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_table(directory: Path) -> tuple[Path, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(ROWS, DIM, generator=gen).to(torch.bfloat16)
    path = directory / "ple.bin"
    path.write_bytes(rows.view(torch.uint8).numpy().tobytes())
    return path, rows


@proves
def test_module_in_the_tree_gathers_on_cpu(tmp_path: Path) -> None:
    mod = load_ple_mmap()
    assert Path(mod.__file__).is_relative_to(vllm_package_dir())
    path, rows = write_table(tmp_path)
    table, _mapping = mod.open_mapped_table(str(path), ROWS, DIM, torch.bfloat16)
    gather = mod.HostRowGather(table, 512 * HEADS, torch.device("cpu"))
    for tokens in (4, 64, 512):  # serial below 1024 rows, on the thread pool above
        ids = torch.randint(0, ROWS, (tokens, HEADS))
        assert torch.equal(gather.rows(gather.gather(ids)), rows[ids.view(-1)])


@proves
@needs_cuda
def test_gather_fills_the_device_buffer_with_the_rows(tmp_path: Path) -> None:
    mod = load_ple_mmap()
    path, rows = write_table(tmp_path)
    table, _mapping = mod.open_mapped_table(str(path), ROWS, DIM, torch.bfloat16)
    gather = mod.HostRowGather(table, 512 * HEADS, torch.device("cuda"))
    assert gather.staging.is_pinned() and gather.host_ids.is_pinned()
    address = gather.device_rows.data_ptr()
    for tokens in (1, 4, 512):
        ids = torch.randint(0, ROWS, (tokens, HEADS), device="cuda")
        n = gather.gather(ids)
        got = gather.rows(n).cpu()
        assert torch.equal(got, rows[ids.view(-1).cpu()])
    assert gather.device_rows.data_ptr() == address


@proves
@needs_cuda
def test_full_graph_replay_reads_each_steps_rows(tmp_path: Path) -> None:
    """A captured graph reads the fixed buffer; gathers between replays change what it sees."""
    mod = load_ple_mmap()
    path, rows = write_table(tmp_path)
    table, _mapping = mod.open_mapped_table(str(path), ROWS, DIM, torch.bfloat16)
    tokens = 4
    gather = mod.HostRowGather(table, 512 * HEADS, torch.device("cuda"))
    weight = torch.randn(HEADS * DIM, 8, device="cuda", dtype=torch.bfloat16)
    gather.mark_dummy(tokens * HEADS)
    out = torch.empty(tokens, 8, device="cuda", dtype=torch.bfloat16)

    def forward() -> None:  # what the PLE layer does with the rows: a projection
        out.copy_(gather.rows(tokens * HEADS).view(tokens, -1) @ weight)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for step in range(5):
        ids = torch.randint(0, ROWS, (tokens, HEADS), device="cuda")
        gather.gather(ids)
        graph.replay()
        want = rows[ids.view(-1).cpu()].view(tokens, -1).cuda() @ weight
        assert torch.equal(out, want), f"step {step}: replay saw stale rows"


@proves
@needs_cuda
def test_pinned_staging_is_released_with_the_gather(tmp_path: Path) -> None:
    """The allocator reuses freed staging memory; a second registration must not fail."""
    import gc

    mod = load_ple_mmap()
    path, rows = write_table(tmp_path)
    table, _mapping = mod.open_mapped_table(str(path), ROWS, DIM, torch.bfloat16)
    for _ in range(4):
        gather = mod.HostRowGather(table, 512 * HEADS, torch.device("cuda"))
        ids = torch.randint(0, ROWS, (2, HEADS), device="cuda")
        assert torch.equal(gather.rows(gather.gather(ids)).cpu(), rows[ids.view(-1).cpu()])
        torch.cuda.synchronize()
        del gather
        gc.collect()


def gather_timings(directory: Path) -> dict[str, float]:
    """Figures for the record (not asserted): warm per-step gather latency."""
    mod = load_ple_mmap()
    path, _ = write_table(directory)
    table, _mapping = mod.open_mapped_table(str(path), ROWS, DIM, torch.bfloat16)
    gather = mod.HostRowGather(table, 512 * HEADS, torch.device("cuda"))
    figures = {}
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages would survive DONTNEED
    for tokens in (1, 512):  # cold: the table's page cache dropped first
        ids = torch.randint(0, ROWS, (tokens, HEADS), device="cuda")
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gather.gather(ids)
        torch.cuda.synchronize()
        figures[f"gather_ms_{tokens}_tokens_cold"] = (time.perf_counter() - t0) * 1e3
    os.close(fd)
    for tokens in (1, 4, 512):
        ids = torch.randint(0, ROWS, (tokens, HEADS), device="cuda")
        gather.gather(ids)  # warm: rows in the page cache
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            gather.gather(ids)
        torch.cuda.synchronize()
        figures[f"gather_ms_{tokens}_tokens_warm"] = (time.perf_counter() - t0) * 1e3 / 50
    return figures


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    with tempfile.TemporaryDirectory() as d:
        for test in (
            test_module_in_the_tree_gathers_on_cpu,
            test_gather_fills_the_device_buffer_with_the_rows,
            test_full_graph_replay_reads_each_steps_rows,
            test_pinned_staging_is_released_with_the_gather,
        ):
            sub = Path(d) / test.__name__
            sub.mkdir()
            test(sub)
            print(f"PASS {test.__name__}")
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        print(f"module: {vllm_package_dir() / MODULE}")
        for key, value in gather_timings(Path(d)).items():
            print(f"{key}: {value:.3f}")
    os._exit(0)
