"""Patch 0022: the QSA layer keeps slot pages in VRAM and binds a host arena.

Real path on CPU: a tiny qwen4_exp with a real QSA layer (indexer on, layer
3) is built on `meta` with VLLM_QSA_KV_OFFLOAD=1 (the FlashAttention
availability probe is answered yes: no kernel runs here), its real specs go
through 0020's block alignment and vLLM's own planner (BLNHC, as QSA
selects), `allocate_kv_cache(device="cpu")` allocates the pool and
`bind_kv_cache_to_layers` binds it. The arena class is replaced by a CPU
stand-in with the same interface (cudaHostRegister needs a GPU; the real one
is proven in checks/gpu). The planner's block count and block size must
equal flashnext.plan.qsa_sizing's for the same shapes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from qsa_offload_cpu import CpuArena, offload_on_cpu
from tiny_qwen4_exp import build_model, engine_args, write_tiny_qwen4_exp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.plan import qsa_sizing  # noqa: E402

PATCH = "0022-qsa-offload-layer.patch"
KV_MEMORY_BYTES = 2 << 20
QSA = "language_model.model.layers.3.self_attn.attn"
COMPRESSED = "language_model.model.layers.3.self_attn.indexer.compressed_key_cache"
INDEXER = {
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 32,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
    "partial_rotary_factor": 0.25,
}
# The same model in the planner's arithmetic (tiny_qwen4_exp.TEXT_CONFIG + INDEXER).
TINY = qsa_sizing.QsaShape(
    num_hidden_layers=7,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    indexer_head_dim=32,
)


@pytest.fixture(scope="module")
def offloaded(tmp_path_factory: pytest.TempPathFactory):
    """(config, specs, kv cache config, bound caches, the QSA layer)."""
    import torch

    mp = pytest.MonkeyPatch()
    offload_on_cpu(mp)
    import vllm.models.qwen4_exp.nvidia.qsa as qsa
    from vllm.platforms.interface import Platform
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache_to_layers

    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("tiny-qwen4-exp-qsa"), text_overrides=INDEXER
    )
    config = engine_args(model_dir, engram_config={"cpu_offload": False}).create_engine_config()
    config.cache_config.block_size = 16  # CUDA's default before hybrid alignment
    config.cache_config.mamba_page_size_padded = None
    Platform._align_hybrid_block_size(config, qsa.Qwen4ExpQSAFlashAttentionBackend)
    build_model(config)
    specs = get_kv_cache_spec(config)
    config.cache_config.kv_cache_layout = "BLNHC"
    groups = get_global_kv_cache_groups(config, [specs])
    (kv_config,) = get_kv_cache_configs(config, [specs], [KV_MEMORY_BYTES], groups)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    context = config.compilation_config.static_forward_context
    bind_kv_cache_to_layers(caches, context, 1, kv_cache_groups=kv_config.kv_cache_groups)
    yield config, specs, kv_config, caches, context[QSA]
    mp.undo()


@pytest.mark.proves(PATCH)
def test_main_spec_reserves_only_slot_pages(offloaded):
    config, specs, _, _, _ = offloaded
    block = config.cache_config.block_size
    assert block == qsa_sizing.offload_block_size(TINY, 1) == 992
    assert specs[QSA].page_size_bytes == qsa_sizing.SLOT_BYTES_PER_TOKEN * block
    assert specs[QSA].head_size == 32  # the metadata builder still sees real heads
    per_token = qsa_sizing.offload_vram_bytes_per_token(TINY)
    group_page = specs[QSA].page_size_bytes + specs[COMPRESSED].page_size_bytes
    assert group_page == per_token * block <= qsa_sizing.mamba_page_bytes(TINY)


@pytest.mark.proves(PATCH)
def test_planner_block_count_matches_the_launcher(offloaded):
    _, _, kv_config, _, _ = offloaded
    sizing = qsa_sizing.size_offload(KV_MEMORY_BYTES, pp_size=1, shape=TINY)
    assert kv_config.num_blocks == sizing.num_blocks
    assert sizing.pool_block_bytes == qsa_sizing.mamba_page_bytes(TINY)


@pytest.mark.proves(PATCH)
def test_layer_binds_a_host_arena_shaped_like_the_vram_cache(offloaded):
    _, _, kv_config, caches, layer = offloaded
    block, heads, dim = 992, 2, 32
    assert layer.kv_slot_page is caches[QSA]
    assert tuple(caches[QSA].shape) == (kv_config.num_blocks, 1, block, 1)
    view = layer.kv_cache
    assert tuple(view.shape) == (kv_config.num_blocks, heads, block, 2 * dim)
    # The stock view's strides: head 2*dim, token heads*2*dim, dense blocks.
    assert view.stride()[1:] == (2 * dim, heads * 2 * dim, 1)
    assert view.stride(0) == block * heads * 2 * dim
    assert view.data_ptr() == layer.host_arena.host.data_ptr()
    sizing = qsa_sizing.size_offload(KV_MEMORY_BYTES, pp_size=1, shape=TINY)
    assert layer.host_arena.nbytes == sizing.host_bytes_per_layer
    key, value = view.transpose(1, 2).split(dim, dim=-1)  # what forward_qsa does
    assert key.shape == value.shape == (kv_config.num_blocks, block, heads, dim)
    assert layer.offload_workspace is not None


@pytest.mark.proves(PATCH)
def test_rebind_releases_the_old_arena_and_the_cap_refuses(offloaded, monkeypatch):
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    _, _, _, caches, layer = offloaded
    old = layer.host_arena
    layer.bind_kv_cache(caches[QSA])
    assert old.released and layer.host_arena is not old
    held = qsa._offload_host_bytes[caches[QSA].device]
    assert held == layer.host_arena.nbytes
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES", str(held - 1))
    with pytest.raises(RuntimeError, match="VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES"):
        layer.bind_kv_cache(caches[QSA])
    assert layer.host_arena is None  # released, nothing half-bound


@pytest.mark.proves(PATCH)
def test_clearing_the_layer_caches_unpins_the_arena(offloaded):
    """vLLM's teardown (and its post-profiling cleanup) detach KV through
    clear_layer_kv_caches; the model outlives the runner, so the arena must be
    unpinned there, not when the layer is garbage collected."""
    import vllm.models.qwen4_exp.nvidia.qsa as qsa
    from vllm.v1.worker.utils import clear_layer_kv_caches

    _, _, _, caches, layer = offloaded
    if layer.host_arena is None:  # the cap test left it unbound
        layer.bind_kv_cache(caches[QSA])
    arena = layer.host_arena
    clear_layer_kv_caches([layer, layer])  # a layer can be listed twice (context + modules)
    assert arena.released and layer.host_arena is None
    assert layer.kv_cache.numel() == 0 and layer.kv_slot_page is None
    assert qsa._offload_host_bytes[caches[QSA].device] == 0
    layer.bind_kv_cache(caches[QSA])  # and it binds again afterwards
    assert layer.host_arena is not None and not layer.host_arena.released


@pytest.mark.proves(PATCH)
def test_jit_warmup_compiles_the_offload_decode_not_the_paged_kernels(offloaded, monkeypatch):
    """vLLM's QSA JIT warmup (before CUDA graph capture) on an offloaded layer
    launches the offload decode once per reachable split-K width, on the
    layer's arena, block table and workspace; the paged kernels never run."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.warmup import qwen4_exp_qsa_warmup
    from vllm.models.qwen4_exp.nvidia.ops import qsa, qsa_indexer, qsa_offload

    _, _, kv_config, caches, layer = offloaded
    if layer.host_arena is None:  # the cap test left it unbound
        layer.bind_kv_cache(caches[QSA])
    launches = []

    class Recorder:  # a Triton kernel's launch syntax; CPU tensors cannot run it
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, args, kw))

    monkeypatch.setattr(qsa_offload, "_attend_kernel", Recorder())
    monkeypatch.setattr(qsa_offload, "_finalize_kernel", Recorder())
    monkeypatch.setattr(qsa_indexer, "warmup_qsa_mqa_paged_decode", lambda *a, **k: ())
    paged = []
    monkeypatch.setattr(
        qsa, "warmup_qsa_sparse_paged_attention", lambda *a, **k: paged.append(a) or ()
    )
    groups = kv_config.kv_cache_groups
    tables = [torch.zeros(4, 8, dtype=torch.int32) for _ in groups]
    runner = SimpleNamespace(
        kv_cache_config=kv_config,
        block_tables=SimpleNamespace(input_block_tables=tables),
        decode_query_len=1,
        max_num_reqs=4,
        max_num_tokens=64,
    )
    worker = SimpleNamespace(
        use_v2_model_runner=True,
        model_runner=runner,
        get_model=lambda: torch.nn.ModuleList([layer]),
    )
    qwen4_exp_qsa_warmup.qwen4_exp_qsa_triton_warmup(worker)
    assert not paged
    attends = [(args, kw) for _grid, args, kw in launches if "MODE" in kw]
    capacity = layer.offload_workspace.row_sum.numel() // layer.num_heads
    width = layer.indexer.packed_output_width - 1
    assert sorted(kw["NUM_SPLITS"] for _, kw in attends) == list(
        qsa_offload.decode_split_variants(capacity, 16, selection_width=width)
    )
    assert len(attends) > 1  # this tiny model still reaches several widths
    group = next(i for i, g in enumerate(groups) if QSA in g.layer_names)
    for args, kw in attends:
        assert kw["MODE"] == qsa_offload.MODE_PAGED
        assert args[1].data_ptr() == layer.host_arena.host.data_ptr()  # K: the arena
        assert args[4] is tables[group]
        assert args[6].data_ptr() == layer.offload_workspace.acc.data_ptr()


def _step_metadata():
    """A reordered batch: 2 decode requests (1 row each), then 2 prefills (3 + 4 rows)."""
    from types import SimpleNamespace

    import torch

    main = SimpleNamespace(
        num_actual_tokens=9,
        block_table=torch.tensor([[5, 6], [7, 8], [1, 2], [3, 4]], dtype=torch.int32),
        seq_lens=torch.tensor([50, 60, 3, 700], dtype=torch.int32),
    )
    side = SimpleNamespace(num_decodes=2, num_decode_tokens=2, num_prefills=2, max_seq_len=700)
    return main, side


def _offloaded_forward(layer, main, side, monkeypatch, *, flat_gate=False):
    """Run forward_qsa on the offloaded layer with the kernels recorded, not run.

    `flat_gate` hands the gate over as the owner does in the engine,
    [tokens, heads * head_dim] (seen on an H200: q (4, 4, 32), gate (4, 128)).
    """
    import torch
    from vllm.models.qwen4_exp.nvidia.ops import qsa_offload

    calls = {}
    monkeypatch.setattr(
        qsa_offload, "qsa_offload_decode", lambda *a, **k: calls.setdefault("decode", (a, k))
    )
    monkeypatch.setattr(
        qsa_offload, "qsa_offload_prefill", lambda *a, **k: calls.setdefault("prefill", (a, k))
    )
    rows, heads, dim = main.num_actual_tokens, 4, 32
    query = torch.randn(rows, heads, dim).to(torch.bfloat16)
    gate = torch.randn(rows, heads, dim).to(torch.bfloat16)
    if flat_gate:
        gate = gate.view(rows, heads * dim)
    output = torch.full_like(query, 7.0)
    layer.topk_indices_buffer.zero_()
    token_to_req = torch.tensor([0, 1, 2, 2, 2, 3, 3, 3, 3], dtype=torch.int32)
    layer.impl.forward_qsa(
        layer,
        query,
        None,
        None,
        layer.kv_cache,
        main,
        output,
        token_to_req,
        True,
        gate,
        side_metadata=side,
    )
    return calls, output


@pytest.mark.proves(PATCH)
def test_forward_sends_decode_rows_to_uva_decode_and_prefill_rows_to_streaming(
    offloaded, monkeypatch
):
    """forward_qsa's wiring: which rows, requests and host ints reach the kernels."""
    import torch

    _, _, _, caches, layer = offloaded
    if layer.host_arena is None:  # the cap test left it unbound
        layer.bind_kv_cache(caches[QSA])
    main, side = _step_metadata()
    calls, output = _offloaded_forward(layer, main, side, monkeypatch)
    rows, dim = main.num_actual_tokens, 32
    (d_args, d_kw), (p_args, p_kw) = calls["decode"], calls["prefill"]
    assert d_args[0].shape[0] == 2 and d_args[5].tolist() == [0, 1]
    assert d_args[1].shape[-1] == d_args[2].shape[-1] == dim  # K and V halves of the arena
    assert d_args[1].data_ptr() == layer.host_arena.host.data_ptr()
    assert d_args[8] is layer.offload_workspace and d_kw["splits"] >= 1
    assert p_kw["row_begin"] == 2 and p_kw["row_end"] == rows
    assert list(p_kw["requests"]) == [2, 3] and p_kw["max_context"] == 700
    assert p_args[1].shape == (caches[QSA].shape[0], 992, 2, 2 * dim)  # the arena view
    assert p_args[5] is main.seq_lens
    assert torch.count_nonzero(output) == 0  # zeroed first, then the kernels write
    # Outside graph capture the chunks go by DMA from the arena's host pages:
    # the prefill requests' lengths and the block columns 700 tokens reach.
    assert p_kw["host_kv"] is layer.host_arena.host
    assert p_kw["host_rows"].lengths == {2: 3, 3: 700}
    assert p_kw["host_rows"].blocks == {2: [1], 3: [3]}


@pytest.mark.proves(PATCH)
def test_forward_takes_the_owners_flat_gate(offloaded, monkeypatch):
    """The engine's QSA owner passes the gate flat; both offload kernels get it
    in q's shape, and their own argument check (the one that refused it on
    the H200) accepts what they receive."""
    from vllm.models.qwen4_exp.nvidia.ops import qsa_offload

    _, _, _, caches, layer = offloaded
    if layer.host_arena is None:
        layer.bind_kv_cache(caches[QSA])
    main, side = _step_metadata()
    calls, _ = _offloaded_forward(layer, main, side, monkeypatch, flat_gate=True)
    (d_args, _), (p_args, _) = calls["decode"], calls["prefill"]
    q, k, v, indices, _table, token_to_req, gate, out = d_args[:8]
    assert gate.shape == q.shape == (2, 4, 32)
    qsa_offload._check_common(q, k, v, indices, token_to_req, gate, out)
    query, arena, indices, _table, token_to_req, _lens, gate, out = p_args[:8]
    assert gate.shape == query.shape == (main.num_actual_tokens, 4, 32)
    half = arena.shape[-1] // 2
    qsa_offload._check_common(
        query, arena[..., :half], arena[..., half:], indices, token_to_req, gate, out
    )


def _arena_count():
    return len(CpuArena.created)


@pytest.mark.proves(PATCH)
def test_an_arena_set_larger_than_host_ram_is_refused_before_pinning(offloaded, monkeypatch):
    """No cap set: a pool whose arenas exceed what this host can pin (here the
    real MemAvailable of this machine) is refused with the numbers and the
    fix, before any arena is allocated (seen on an H200: a 303,769,939,968-byte
    cudaHostRegister from a VRAM budget of 0.15 x 141 GB, with no bound)."""
    import torch

    _, _, _, caches, layer = offloaded
    monkeypatch.delenv("VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES", raising=False)
    slot_page = caches[QSA]
    # 10M blocks of slot pages, as a zero-stride view: only the shape is read
    # before the refusal, so no memory backs it.
    huge = torch.empty(1, 1, slot_page.shape[2], 1, dtype=slot_page.dtype).expand(
        10_000_000, 1, slot_page.shape[2], 1
    )
    before = _arena_count()
    with pytest.raises(RuntimeError) as refused:
        layer.bind_kv_cache(huge)
    message = str(refused.value)
    assert "MemAvailable" in message and "--kv-cache-memory-bytes" in message
    need = 10_000_000 * slot_page.shape[2] * 2 * 2 * 32 * 2  # blocks x B x heads x K,V x dim x bf16
    assert f"need {need} bytes" in message
    assert _arena_count() == before and layer.host_arena is None  # nothing pinned
    layer.bind_kv_cache(caches[QSA])  # the planned pool still binds


@pytest.mark.proves(PATCH)
def test_memlock_and_cap_bound_the_arena_set(offloaded, monkeypatch):
    """RLIMIT_MEMLOCK (for a process without CAP_IPC_LOCK) and the cap each
    refuse a set that exceeds them; every offloaded layer of the process
    counts, not just the one binding."""
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    _, _, _, caches, layer = offloaded
    if layer.host_arena is None:
        layer.bind_kv_cache(caches[QSA])
    per_layer = layer.host_arena.nbytes
    monkeypatch.setattr(
        qsa, "host_pin_limits", lambda: [(per_layer // 2, "RLIMIT_MEMLOCK (ulimit -l)")]
    )
    before = _arena_count()
    with pytest.raises(RuntimeError, match=r"RLIMIT_MEMLOCK \(ulimit -l\) allows"):
        layer.bind_kv_cache(caches[QSA])
    assert _arena_count() == before and layer.host_arena is None
    monkeypatch.setattr(qsa, "host_pin_limits", lambda: [])
    layer.bind_kv_cache(caches[QSA])
    # The layer's own arena is released before the check: an exact fit binds.
    monkeypatch.setattr(qsa, "host_pin_limits", lambda: [(per_layer, "MemAvailable")])
    layer.bind_kv_cache(caches[QSA])
    monkeypatch.setattr(qsa, "host_pin_limits", lambda: [])
    monkeypatch.setattr(layer, "_num_offloaded_layers", lambda: 3)
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES", str(3 * per_layer - 1))
    with pytest.raises(RuntimeError, match=r"3 offloaded layer\(s\) need"):
        layer.bind_kv_cache(caches[QSA])
    monkeypatch.setenv("VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES", str(3 * per_layer))
    layer.bind_kv_cache(caches[QSA])
    assert layer.host_arena is not None


@pytest.mark.proves(PATCH)
def test_host_pin_limits_read_this_host(offloaded):
    """The bounds come from this machine's /proc and rlimits, in bytes."""
    import resource

    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    limits = dict((what, free) for free, what in qsa.host_pin_limits())
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < limits["MemAvailable (/proc/meminfo)"] <= total
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if "RLIMIT_MEMLOCK (ulimit -l)" in limits:  # absent when unlimited or CAP_IPC_LOCK
        assert soft != resource.RLIM_INFINITY
        assert limits["RLIMIT_MEMLOCK (ulimit -l)"] <= soft


@pytest.mark.proves(PATCH)
def test_prefill_reads_the_host_block_rows_once_per_step(offloaded, monkeypatch):
    """Every offloaded layer of a step shares one device-to-host read."""
    from vllm.models.qwen4_exp.nvidia.ops import qsa_offload

    _, _, _, caches, layer = offloaded
    if layer.host_arena is None:
        layer.bind_kv_cache(caches[QSA])
    reads = []
    real = qsa_offload.read_host_block_rows
    monkeypatch.setattr(
        qsa_offload, "read_host_block_rows", lambda *a, **k: reads.append(a) or real(*a, **k)
    )
    main, side = _step_metadata()
    seen = [_offloaded_forward(layer, main, side, monkeypatch)[0] for _layer in range(3)]
    assert len(reads) == 1
    assert len({id(calls["prefill"][1]["host_rows"]) for calls in seen}) == 1
    next_main, next_side = _step_metadata()  # the next step: new metadata, a new read
    _offloaded_forward(layer, next_main, next_side, monkeypatch)
    assert len(reads) == 2
