"""Patches 0010-0013: the Qwen4Exp PLE table served from a memory-mapped flat file.

0010 the loader skips unused tensors one by one, 0011 dummy weights leave a
read-only mapping alone, 0012 the mmap backend, 0013 its gather before
forward. Run with the real vLLM 0.33.0 code on CPU (tiny qwen4_exp, real
safetensors shards, real mmap). Every `proves` test fails on the stock tree,
where EngramConfig has no mmap_path and the table can only be loaded into
memory. What needs a GPU (pinned staging, H2D copy, FULL graph replay) is
proven by checks/patches/test_ple_mmap_gpu.py against the same ple_mmap module.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import socket
from pathlib import Path

import pytest
from ple_table_fixture import OTHER_NAME, SHARD_NAME, PleTable, table_geometry, write_ple_table
from tiny_qwen4_exp import engine_args, write_tiny_qwen4_exp

PATCH_LOADER = "0010-model-loader-skip-unused-tensors.patch"
PATCH_DUMMY = "0011-dummy-load-skips-mapped-weights.patch"
PATCH = "0012-qwen4-exp-ple-mmap-backend.patch"
PATCH_GATHER = "0013-qwen4-exp-ple-gather-before-forward.patch"


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ple(tmp_path_factory: pytest.TempPathFactory) -> PleTable:
    return write_ple_table(tmp_path_factory.mktemp("ple"))


@pytest.fixture(scope="module")
def dist(ple: PleTable):
    """vLLM's world/TP/ETP groups of one CPU process (gloo), as a worker has them."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    config = engine_args(ple.model_dir).create_engine_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )  # fmt: skip
        parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def _config(ple: PleTable, **engram):
    return engine_args(ple.model_dir, engram_config=engram).create_engine_config()


def _ngram_embedding(config):
    """The PLE layer's n-gram embedding module as the model builds it (CPU, bf16)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    text_config = config.model_config.hf_text_config
    with set_current_vllm_config(config), torch.device("cpu"):
        return Qwen4ExpNGramEmbedding(
            text_config,
            int(text_config.ple_embed_dim),
            0,
            config.scheduler_config.max_num_batched_tokens,
            data_parallel_rank=0,
            prefix="model.layers.1.ple.ple_embedding",
            params_dtype=torch.bfloat16,
        )


def _batch(seed: int):
    """Three requests of 5, 1 and 9 tokens with their n-gram context, as the runner passes them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 512, (15,), generator=gen, dtype=torch.int32)
    query_start_loc = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    ngram_context = torch.randint(0, 512, (3, 2), generator=gen, dtype=torch.int32)
    return input_ids, query_start_loc, ngram_context


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _resident_pages(path: Path, offset: int, length: int) -> int:
    """Page-cache pages of a file range (mincore over a fresh read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    start = offset // mmap.PAGESIZE * mmap.PAGESIZE
    span = offset + length - start
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, span, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        assert addr not in (None, ctypes.c_void_p(-1).value), "mmap failed"
        pages = (span + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(span), vec) == 0
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(span))
        return sum(b & 1 for b in bytes(vec))
    finally:
        os.close(fd)


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # DONTNEED leaves dirty pages in the cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- proofs


@pytest.mark.proves(PATCH)
def test_engram_config_selects_the_mmap_backend(ple: PleTable, dist) -> None:
    from vllm.models.qwen4_exp.common.ngram_embedding import Qwen4ExpPLEMmapEmbedding

    config = _config(ple, mmap_path=str(ple.table_path))
    assert config.engram_config.mmap_path == str(ple.table_path)
    # The backend changes the graph (hash); the file's location does not.
    other = _config(ple, mmap_path="/elsewhere/ple.bin")
    assert config.engram_config.compute_hash() == other.engram_config.compute_hash()
    assert config.engram_config.compute_hash() != _config(ple).engram_config.compute_hash()

    module = _ngram_embedding(config)
    table = module.ngram_embedding
    assert isinstance(table, Qwen4ExpPLEMmapEmbedding)
    assert tuple(table.weight.shape) == (ple.rows, ple.dim)
    # The weight is the mapping itself, not a copy of it.
    mapping_addr = ctypes.addressof(ctypes.c_char.from_buffer(table._mapping))
    assert table.weight.data_ptr() == mapping_addr


@pytest.mark.proves(PATCH)
def test_vllm_serve_flag_selects_the_table(ple: PleTable) -> None:
    """The exact flag the launcher emits (flashnext.command), through `vllm serve`'s parser."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    flag = json.dumps({"mmap_path": str(ple.table_path)}, sort_keys=True, separators=(",", ":"))
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args = parser.parse_args(
        ["--model", str(ple.model_dir), "--engram-config", flag, "--load-format", "dummy",
         "--skip-tokenizer-init", "--max-model-len", "512", "--enforce-eager",
         "--language-model-only"]
    )  # fmt: skip
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    assert config.engram_config.mmap_path == str(ple.table_path)
    assert config.engram_config.cpu_offload is True


@pytest.mark.proves(PATCH)
def test_mmap_config_rejects_device_table(ple: PleTable) -> None:
    with pytest.raises(ValueError, match=r"cannot be combined with cpu_offload=False"):
        _config(ple, mmap_path=str(ple.table_path), cpu_offload=False)


@pytest.mark.proves(PATCH)
def test_gathered_rows_equal_the_checkpoint_rows(ple: PleTable, dist) -> None:
    import torch

    module = _ngram_embedding(_config(ple, mmap_path=str(ple.table_path)))
    table = module.ngram_embedding
    flat = torch.cat(ple.shards)
    gen = torch.Generator().manual_seed(1)
    for n in (1, 16 * 7, 16 * 33):
        ids = torch.randint(0, ple.rows, (n // 16 or 1, ple.heads), generator=gen)
        # Make sure shard edges and the last row are in the sample.
        ids.view(-1)[:3] = torch.tensor([0, ple.shards[0].shape[0], ple.rows - 1])
        table.gather_rows(ids)
        got = table.prepared_rows(ids.shape[0])
        assert torch.equal(got, flat[ids.view(-1)].view(ids.shape[0], -1))


@pytest.mark.proves(PATCH_GATHER)
def test_forward_matches_the_stock_cpu_path(ple: PleTable, dist) -> None:
    """Same batch through the stock device-table path (loaded from the shards) and mmap."""
    import torch

    reference = _ngram_embedding(_config(ple, cpu_offload=False))
    loaded = reference.load_weights(
        (f"ngram_embedding.shard_{i}.weight", s) for i, s in enumerate(ple.shards)
    )
    assert loaded == {"ngram_embedding.weight"}
    mapped = _ngram_embedding(_config(ple, mmap_path=str(ple.table_path)))

    for seed in range(3):
        input_ids, qsl, context = _batch(seed)
        hidden = torch.zeros(input_ids.shape[0], 8, dtype=torch.bfloat16)
        want = reference(hidden, input_ids, qsl, context)
        mapped.prepare_host_rows(input_ids, qsl, context)
        got = mapped(hidden, input_ids, qsl, context)
        assert got.shape == want.shape == (input_ids.shape[0], ple.heads * ple.dim)
        assert torch.equal(got, want)


@pytest.mark.proves(PATCH)
def test_host_staging_stays_on_the_host_under_a_device_default(ple: PleTable) -> None:
    """vLLM builds the model under a CUDA default device (`with torch.device`):
    the gather's staging and id buffers must still be host memory, or
    cudaHostRegister fails on a device pointer (seen on an H200: "cudaHostRegister
    of 4194304 bytes of PLE staging failed"). `meta` stands in for CUDA here:
    any buffer that ignores the default device lands there too."""
    import torch
    from vllm.models.qwen4_exp.common import ple_mmap

    table, _mapping = ple_mmap.open_mapped_table(
        str(ple.table_path), ple.rows, ple.dim, torch.bfloat16
    )
    with torch.device("meta"):
        gather = ple_mmap.HostRowGather(table, 64, torch.device("cpu"))
    assert gather.staging.device.type == "cpu"
    assert gather.host_ids.device.type == "cpu"
    ids = torch.tensor([[0, ple.rows - 1]])
    gather.gather(ids)  # and it still gathers the table's rows
    assert torch.equal(gather.rows(2), table[ids.view(-1)])


@pytest.mark.proves(PATCH_GATHER)
def test_model_state_gathers_for_the_models_ple_layer(ple: PleTable, dist) -> None:
    """The runner's Qwen4ExpModelState finds the mapped table in the real model and
    prepares its rows (here: the dummy batch of profile/capture runs) before forward."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    config = _config(ple, mmap_path=str(ple.table_path))
    with set_current_vllm_config(config), torch.device("cpu"):
        model = Qwen4ExpForConditionalGeneration(vllm_config=config, prefix="")
        state = Qwen4ExpModelState(config, model, None, torch.device("cpu"))
    ple_layer = model.language_model.model.layers[1].ple.ple_embedding
    assert state.ple_host_tables == [ple_layer]

    num_tokens = 6
    inputs = state.prepare_dummy_inputs(2, num_tokens)
    hidden = torch.zeros(num_tokens, 8, dtype=torch.bfloat16)
    input_ids = torch.zeros(num_tokens, dtype=torch.int32)
    rows = ple_layer(hidden, input_ids, inputs["query_start_loc"], inputs["ngram_context"])
    assert rows.shape == (num_tokens, ple.heads * ple.dim)


@pytest.mark.proves(PATCH_GATHER)
def test_forward_path_does_no_host_gather(
    ple: PleTable, dist, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the model's forward does with the PLE layer of the real model: start
    its prefetch while the layer before runs (Qwen4ExpModel._start_layer_ple_prefetch),
    then compute the layer's embedding. With 0013 that gathers nothing on the host:
    the rows come from prepare_host_rows (Qwen4ExpModelState.prepare_inputs, before
    forward), and a forward without them is refused. 0012 alone gathers in the
    prefetch hook, inside forward (and outside any captured graph)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.common import ple_mmap
    from vllm.models.qwen4_exp.nvidia.model import (
        Qwen4ExpForConditionalGeneration,
        Qwen4ExpModel,
    )

    config = _config(ple, mmap_path=str(ple.table_path))
    with set_current_vllm_config(config), torch.device("cpu"):
        model = Qwen4ExpForConditionalGeneration(vllm_config=config, prefix="")
    layer = model.language_model.model.layers[1]
    embedding = layer.ple.ple_embedding
    gathers: list[int] = []
    real_gather = ple_mmap.HostRowGather.gather

    def counting_gather(self, ids):
        gathers.append(ids.numel())
        return real_gather(self, ids)

    monkeypatch.setattr(ple_mmap.HostRowGather, "gather", counting_gather)
    input_ids, qsl, context = _batch(0)
    hidden = torch.zeros(input_ids.shape[0], 8, dtype=torch.bfloat16)

    def forward():
        Qwen4ExpModel._start_layer_ple_prefetch(layer, input_ids, qsl, context)
        return embedding(hidden, input_ids, qsl, context)

    with pytest.raises(RuntimeError, match=r"were not prepared .*prepare_inputs before forward"):
        forward()
    assert gathers == [], "the forward path gathered rows on the host"

    embedding.prepare_host_rows(input_ids, qsl, context)  # what prepare_inputs calls
    assert gathers == [input_ids.shape[0] * ple.heads]
    rows = forward()
    assert gathers == [input_ids.shape[0] * ple.heads], "forward gathered again"
    ids = embedding.compute_ngram_ids(input_ids, qsl, context)
    want = torch.cat(ple.shards)[ids.reshape(-1)].view(input_ids.shape[0], -1)
    assert torch.equal(rows, want)


@pytest.mark.proves(PATCH)
def test_wrong_size_table_is_refused_with_the_fix(ple: PleTable, dist, tmp_path: Path) -> None:
    short = tmp_path / "short.bin"
    short.write_bytes(ple.table_path.read_bytes()[: -ple.dim * 2])
    expected = ple.rows * ple.dim * 2
    message = (
        f"PLE table file {short} is {expected - ple.dim * 2} bytes, but this model's n-gram "
        f"table is {ple.rows} rows x {ple.dim} x torch.bfloat16 = {expected} bytes. "
        f"Write it from this checkpoint with `flashnext table prepare --model "
        f"<checkpoint dir> --out {short}`"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _ngram_embedding(_config(ple, mmap_path=str(short)))


@pytest.mark.proves(PATCH)
def test_manifest_dtype_mismatch_is_refused(ple: PleTable, dist, tmp_path: Path) -> None:
    table = tmp_path / "ple.bin"
    os.link(ple.table_path, table)
    (tmp_path / "ple.bin.json").write_text(
        f'{{"rows": {ple.rows * 2}, "dim": {ple.dim // 2}, "dtype": "BF16"}}'
    )
    with pytest.raises(ValueError, match=r"holds \d+ x \d+ BF16 rows \(per .*ple.bin.json\)"):
        _ngram_embedding(_config(ple, mmap_path=str(table)))


# ---------------------------------------------------------------- page-aligned layout

PAGE = 4096


@pytest.fixture(scope="module")
def ple320(tmp_path_factory: pytest.TempPathFactory) -> PleTable:
    """The tiny model with the real table's rows: 160 BF16 = 320 bytes (12 per page + 256)."""
    table = write_ple_table(tmp_path_factory.mktemp("ple320"), ple_embed_dim=160 * 16, seed=3)
    assert (table.dim, table.heads) == (160, 16)
    return table


def _write_aligned(ple: PleTable, path: Path, *, drop_pages: int = 0) -> int:
    """The page-aligned file of the tiny table, by hand: whole rows per page, zeros after.

    Returns rows per page. The manifest beside it names the layout, as
    `flashnext table prepare --layout page-aligned` writes it.
    """
    import torch

    flat = torch.cat(ple.shards).view(torch.uint8).numpy().tobytes()
    row_bytes = ple.dim * 2
    per = PAGE // row_bytes
    pages = []
    for start in range(0, len(flat), per * row_bytes):
        body = flat[start : start + per * row_bytes]
        pages.append(body + bytes(PAGE - len(body)))
    path.write_bytes(b"".join(pages[: len(pages) - drop_pages]))
    manifest = {"rows": ple.rows, "dim": ple.dim, "dtype": "BF16", "layout": "page-aligned"}
    path.with_name(path.name + ".json").write_text(json.dumps(manifest))
    return per


@pytest.mark.proves(PATCH)
def test_page_aligned_table_gathers_the_checkpoint_rows(
    ple320: PleTable, dist, tmp_path: Path
) -> None:
    import torch

    table_path = tmp_path / "aligned.bin"
    per = _write_aligned(ple320, table_path)
    assert per == 12 and ple320.dim * 2 == 320  # the real table's geometry
    module = _ngram_embedding(_config(ple320, mmap_path=str(table_path)))
    table = module.ngram_embedding
    pages = table_path.stat().st_size // PAGE
    # A strided view of the mapping: [pages, 12, dim], page stride 4096 bytes.
    assert tuple(table.weight.shape) == (pages, per, ple320.dim)
    assert table.weight.stride() == (PAGE // 2, ple320.dim, 1)
    mapping_addr = ctypes.addressof(ctypes.c_char.from_buffer(table._mapping))
    assert table.weight.data_ptr() == mapping_addr
    flat = torch.cat(ple320.shards)
    gen = torch.Generator().manual_seed(2)
    # 1 token, a decode batch, and a prefill chunk past the parallel threshold.
    for tokens in (1, 7, 80):
        ids = torch.randint(0, ple320.rows, (tokens, ple320.heads), generator=gen)
        edges = [0, per - 1, per, ple320.shards[0].shape[0], ple320.rows - 1]
        ids.view(-1)[: len(edges)] = torch.tensor(edges)[: ids.numel()]
        table.gather_rows(ids)
        got = table.prepared_rows(tokens)
        want = flat[ids.view(-1)].view(tokens, -1)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.proves(PATCH)
def test_page_aligned_forward_matches_the_packed_one(ple320: PleTable, dist, tmp_path) -> None:
    import torch

    table_path = tmp_path / "aligned.bin"
    _write_aligned(ple320, table_path)
    packed = _ngram_embedding(_config(ple320, mmap_path=str(ple320.table_path)))
    aligned = _ngram_embedding(_config(ple320, mmap_path=str(table_path)))
    for seed in range(2):
        input_ids, qsl, context = _batch(seed)
        hidden = torch.zeros(input_ids.shape[0], 8, dtype=torch.bfloat16)
        for module in (packed, aligned):
            module.prepare_host_rows(input_ids, qsl, context)
        want = packed(hidden, input_ids, qsl, context)
        got = aligned(hidden, input_ids, qsl, context)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.proves(PATCH)
def test_wrong_size_page_aligned_table_is_refused(ple320: PleTable, dist, tmp_path: Path) -> None:
    table_path = tmp_path / "aligned.bin"
    per = _write_aligned(ple320, table_path, drop_pages=1)
    pages = -(-ple320.rows // per)
    expected = pages * PAGE
    message = (
        f"PLE table file {table_path} is {expected - PAGE} bytes, but this model's n-gram "
        f"table is {ple320.rows} rows x {ple320.dim} x torch.bfloat16 in the page-aligned layout "
        f"(per {table_path}.json) = {pages} pages of 4096 = {expected} bytes. "
        f"Write it from this checkpoint with `flashnext table prepare --model "
        f"<checkpoint dir> --out {table_path}` (then `flashnext table verify`). "
        f"(In the packed layout it would be {ple320.rows * ple320.dim * 2} bytes.)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _ngram_embedding(_config(ple320, mmap_path=str(table_path)))


@pytest.mark.proves(PATCH)
def test_packed_size_with_a_page_aligned_manifest_is_refused(
    ple320: PleTable, dist, tmp_path: Path
) -> None:
    """The manifest decides the layout: a packed file under an aligned manifest is refused."""
    table = tmp_path / "ple.bin"
    os.link(ple320.table_path, table)
    manifest = {"rows": ple320.rows, "dim": ple320.dim, "dtype": "BF16", "layout": "page-aligned"}
    (tmp_path / "ple.bin.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"in the page-aligned layout \(per .*ple.bin.json\)"):
        _ngram_embedding(_config(ple320, mmap_path=str(table)))


@pytest.mark.proves(PATCH)
def test_unknown_layout_in_the_manifest_is_refused(ple320: PleTable, dist, tmp_path: Path) -> None:
    table = tmp_path / "ple.bin"
    os.link(ple320.table_path, table)
    manifest = {"rows": ple320.rows, "dim": ple320.dim, "dtype": "BF16", "layout": "striped"}
    (tmp_path / "ple.bin.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"names layout 'striped'; this vLLM reads 'packed' and"):
        _ngram_embedding(_config(ple320, mmap_path=str(table)))


class _CountingSafeOpen:
    """safetensors.safe_open, recording which tensors are materialized (get_tensor)."""

    def __init__(self, real, reads: list[str]) -> None:
        self._real, self._reads = real, reads

    def __call__(self, *args, **kwargs):
        handle = self._real(*args, **kwargs)
        reads = self._reads

        class Handle:
            def __enter__(self):
                self._f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def metadata(self):
                return self._f.metadata()

            def get_tensor(self, name):
                reads.append(name)
                return self._f.get_tensor(name)

        return Handle()


@pytest.mark.proves(PATCH)
def test_loader_reads_no_ple_shard_bytes(
    tmp_path_factory: pytest.TempPathFactory, dist, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real DefaultModelLoader over a real file: no shard is read, the table counts as loaded.

    128 MiB of shards share a file with a weight that is loaded, as in the
    export: the shards must be skipped tensor by tensor. Reads are counted at
    safetensors' get_tensor, and in the page cache (mincore): only the
    readahead around the loaded weight may touch the shards' pages.
    """
    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import default_loader, weight_utils
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration

    big = write_ple_table(tmp_path_factory.mktemp("big"), ngram_vocab_size_base=500_000)
    config = _config(big, mmap_path=str(big.table_path))
    with set_current_vllm_config(config), torch.device("cpu"):
        model = Qwen4ExpForConditionalGeneration(vllm_config=config, prefix="")
    raw = big.shard_file.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    spans = [header[SHARD_NAME.format(i)]["data_offsets"] for i in range(len(big.shards))]
    start = 8 + header_len + min(s for s, _ in spans)
    length = max(e for _, e in spans) - min(s for s, _ in spans)
    del raw
    assert length >= 120 << 20

    _drop_page_cache(big.shard_file)
    if _resident_pages(big.shard_file, start, length):
        pytest.skip(f"the page cache of {big.shard_file} cannot be dropped here (tmpfs?)")
    reads: list[str] = []
    monkeypatch.setattr(weight_utils, "safe_open", _CountingSafeOpen(weight_utils.safe_open, reads))
    loader = default_loader.DefaultModelLoader(LoadConfig(load_format="safetensors"))
    seen = {}
    for name, tensor in loader.get_all_weights(config.model_config, model):
        seen[name] = tensor.clone()  # the copy a weight_loader makes
    resident = _resident_pages(big.shard_file, start, length)

    assert reads == [OTHER_NAME], f"tensors read: {reads}"
    assert set(seen) == {OTHER_NAME}
    pages = length // mmap.PAGESIZE
    assert resident < pages // 4, f"{resident} of {pages} PLE shard pages were read"
    # The table counts as loaded without its shards (the loader's check of
    # weights "not initialized from checkpoint" passes for it).
    loaded = model.load_weights(seen.items())
    table_param = "language_model.model.layers.1.ple.ple_embedding.ngram_embedding.weight"
    assert table_param in dict(model.named_parameters())
    assert table_param in loaded


@pytest.mark.proves(PATCH_LOADER, raises=AssertionError)
def test_loader_skips_unused_tensors_one_by_one(
    ple: PleTable, dist, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any model: tensors its is_unused_checkpoint_weight names are not read, even
    in a file it needs. Stock drops only whole files of unused tensors."""
    import torch
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import default_loader, weight_utils

    class Model(torch.nn.Module):
        def is_unused_checkpoint_weight(self, name: str) -> bool:
            return ".ngram_embedding.shard_" in name

    reads: list[str] = []
    monkeypatch.setattr(weight_utils, "safe_open", _CountingSafeOpen(weight_utils.safe_open, reads))
    loader = default_loader.DefaultModelLoader(LoadConfig(load_format="safetensors"))
    config = _config(ple)
    names = [name for name, _ in loader.get_all_weights(config.model_config, Model())]

    assert names == [OTHER_NAME]
    assert reads == [OTHER_NAME], f"tensors read: {reads}"


@pytest.mark.proves(PATCH_DUMMY, raises=AssertionError)
def test_dummy_fill_leaves_a_read_only_mapping_alone(tmp_path: Path) -> None:
    """load_format=dummy's per-tensor fill, on a tensor that views a mapped file."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    path = tmp_path / "table.bin"
    path.write_bytes(bytes(4096))
    with path.open("rb") as f:
        mapping = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE)
    try:
        mapped = torch.frombuffer(mapping, dtype=torch.bfloat16)
        plain = torch.zeros(2048, dtype=torch.bfloat16)
        mapped.read_only_mapping = True

        initialize_single_dummy_weight(plain)
        initialize_single_dummy_weight(mapped)

        assert plain.any(), "the dummy fill did not run at all"
        assert not mapped.any(), "the dummy fill wrote into the mapping"
        del mapped
    finally:
        mapping.close()


def test_read_counting_sees_the_shards_without_mmap(ple: PleTable, dist, monkeypatch) -> None:
    """The instrument of the proof above works: with the table in memory, shards are read."""
    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import default_loader, weight_utils
    from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration

    config = _config(ple, cpu_offload=False)
    with set_current_vllm_config(config), torch.device("cpu"):
        model = Qwen4ExpForConditionalGeneration(vllm_config=config, prefix="")
    reads: list[str] = []
    monkeypatch.setattr(weight_utils, "safe_open", _CountingSafeOpen(weight_utils.safe_open, reads))
    loader = default_loader.DefaultModelLoader(LoadConfig(load_format="safetensors"))
    names = [name for name, _ in loader.get_all_weights(config.model_config, model)]
    shard_names = {SHARD_NAME.format(i) for i in range(len(ple.shards))}
    assert shard_names <= set(reads) and shard_names <= set(names)


@pytest.mark.proves(PATCH)
def test_rss_does_not_grow_by_the_table_size(tmp_path: Path, dist) -> None:
    """A 512 MiB table (sparse file) is mapped, gathered from and dummy-loaded: RSS stays put."""
    import torch
    from transformers import AutoConfig
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    model_dir = write_tiny_qwen4_exp(
        tmp_path / "big", text_overrides={"ngram_vocab_size_base": 2_000_000}
    )
    rows, dim, heads, _ = table_geometry(AutoConfig.from_pretrained(model_dir).text_config)
    size = rows * dim * 2
    assert size >= 400 << 20
    # A sparse file at full size (rows read as zeros): no 488 MiB of disk needed.
    table = tmp_path / "sparse.bin"
    with table.open("wb") as f:
        f.truncate(size)
    config = engine_args(model_dir, engram_config={"mmap_path": str(table)})
    config = config.create_engine_config()

    rss0 = _rss_bytes()
    module = _ngram_embedding(config)
    input_ids, qsl, context = _batch(0)
    module.prepare_host_rows(input_ids, qsl, context)
    DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(module, config.model_config)
    rss1 = _rss_bytes()

    assert rss1 - rss0 < size // 8, f"RSS grew by {(rss1 - rss0) >> 20} MiB"
    # load_format=dummy did not write into the mapping (it would read as non-zero).
    weight = module.ngram_embedding.weight
    probe = torch.randint(0, rows, (4096,))
    assert not weight[probe].any()
