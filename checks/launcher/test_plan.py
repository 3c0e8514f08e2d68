"""The plan at full model scale, cross-checked by hand against shared/SPEC.md."""

from __future__ import annotations

import dataclasses
import time

import pytest
from flashnext.plan.command import plan_json, serve_command
from flashnext.plan.partition import PartitionError, pp_layer_counts, pp_layer_ranges
from flashnext.plan.planner import PlanOptions, plan
from flashnext.profiles import available_profiles, select_profile
from lead_fixtures import GIB, base_facts

PROFILE = available_profiles()["3x3090"]
TABLE = "/nvme/flashnext/ple-table.bin"


def make_plan(model, **options):
    return plan(base_facts(), model, PROFILE, _options(**options))


def _options(**options):
    return PlanOptions(model_dir="/models/Qwen3.8-Flash-Next", table_path=TABLE, **options)


def make_argv(model, **options):
    """The plan's `vllm serve` argv (a Plan holds none: command.py renders it)."""
    return serve_command(make_plan(model, **options), PROFILE, _options(**options)).argv


def make_plan_json(model, **options):
    """`plan --json`'s document."""
    p = make_plan(model, **options)
    return plan_json(p, serve_command(p, PROFILE, _options(**options)))


# ---------------------------------------------------------------- partition


def test_default_partition_is_even_for_48_layers():
    assert pp_layer_ranges(48, 3) == [(0, 16), (16, 32), (32, 48)]


def test_remainder_goes_to_the_ranks_before_the_last():
    # vLLM 0.33.0 get_pp_indices: 7 layers over 3 ranks -> (0,2),(2,5),(5,7).
    assert pp_layer_ranges(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert pp_layer_counts(50, 3) == [17, 17, 16]


def test_partition_variable_is_honoured():
    assert pp_layer_ranges(48, 3, "1,23,24") == [(0, 1), (1, 24), (24, 48)]


@pytest.mark.parametrize(
    ("text", "words"),
    [("16,16", "2 entries for 3"), ("16,16,15", "sums to 47"), ("a,b,c", "not a comma")],
)
def test_bad_partition_variable_is_refused(text, words):
    with pytest.raises(PartitionError, match=words):
        pp_layer_counts(48, 3, text)


# ---------------------------------------------------------------- full scale


def test_full_scale_plan_runs_in_under_a_second(full_model):
    start = time.process_time()
    make_plan(full_model)
    assert time.process_time() - start < 1.0


def test_weights_per_rank_match_the_seed(full_model):
    p = make_plan(full_model)
    weights = [r.weight_bytes for r in p.ranks]
    # SPEC: 62.14 GiB of weights for the GPUs in all; the PLE table (95.37 GiB),
    # the vision tower and the MTP layer are not among them.
    assert sum(weights) == pytest.approx(62.14 * GIB, rel=0.01)
    # SPEC measured 21.71 / 21.67 / 21.67 GiB resident per card, "~1 GiB per card
    # of kernel workspace" included: 20.7 GiB of weights + 1 GiB margin each.
    # With the embedding only on rank 0 and the LM head only on rank 2 (0.6 GiB
    # each, INT8), the middle rank is ~0.6 GiB lighter than the seed's.
    for r in p.ranks:
        resident = r.weight_bytes + r.workspace_bytes
        assert 21.0 * GIB < resident < 22.2 * GIB, (r.rank, resident / GIB)
    assert weights[1] < weights[0] and weights[1] < weights[2]


def test_layers_qsa_and_ple_placement(full_model):
    p = make_plan(full_model)
    assert p.pp_ranges == ((0, 16), (16, 32), (32, 48))
    # 48 layers of [linear x3, full] -> QSA at 3, 7, ..., 47: 12 layers, 4 per rank.
    assert [r.qsa_layers for r in p.ranks] == [
        (3, 7, 11, 15),
        (19, 23, 27, 31),
        (35, 39, 43, 47),
    ]
    assert p.ple_layers == (1,) and p.ple_ranks == (0,)


def test_seed_kv_bytes_give_the_seed_host_pools(full_model):
    p = make_plan(full_model, kv_cache_memory_bytes=550_000_000)
    q = p.qsa
    # maps/QSA.md section 5: mamba page 3,207,168 B; 4 QSA layers x 66 B/token per
    # rank -> 12,148 tokens, aligned down to 16 -> 12,144-token blocks;
    # 550e6 // 3,207,168 = 171 blocks -> 2,076,624 tokens -> x 2048 B
    # = 4,252,925,952 B = 3.961 GiB per layer; x 12 layers = 47.53 GiB.
    assert (q.block_tokens, q.num_blocks, q.tokens) == (12_144, 171, 2_076_624)
    assert q.per_layer_exact_bytes == 4_252_925_952
    assert q.per_layer_pow2_bytes == 4 * GIB
    assert q.total_exact_bytes == 12 * 4_252_925_952
    assert q.total_pow2_bytes == 48 * GIB
    assert p.kv_cache_memory_bytes.source == "flag"


def test_560e6_crosses_a_power_of_two(full_model):
    # SPEC: 560,000,000 -> 4.03 GiB per layer, which PyTorch pins as 8 GiB (96 in all).
    q = make_plan(full_model, kv_cache_memory_bytes=560_000_000).qsa
    assert q.per_layer_exact_bytes / GIB == pytest.approx(4.03, abs=0.005)
    assert q.total_pow2_bytes == 96 * GIB


def test_pow2_pinning_never_crosses_a_power_of_two(full_model):
    roomy = dataclasses.replace(
        PROFILE,
        memory=dataclasses.replace(
            PROFILE.memory, kv_cache_memory_bytes_max=560_000_000, activation_reserve_bytes=0
        ),
        qsa_offload=dataclasses.replace(PROFILE.qsa_offload, host_pinning="pow2"),
    )
    opts = PlanOptions(model_dir="/m", table_path=TABLE)
    p = plan(base_facts(), full_model, roomy, opts)
    q = p.qsa
    assert p.kv_cache_memory_bytes.value < 560_000_000
    assert "power of two" in p.kv_cache_memory_bytes.reason
    assert q.per_layer_exact_bytes <= 4 * GIB == q.per_layer_pow2_bytes
    # One more block would cross 4 GiB.
    assert (q.num_blocks + 1) * q.block_tokens * 2048 > 4 * GIB


def test_kv_is_sized_for_the_tightest_rank(full_model):
    p = make_plan(full_model)
    left = [r.vram_usable_bytes - (r.committed_bytes - r.kv_cache_bytes) for r in p.ranks]
    assert p.tightest_rank == left.index(min(left))
    assert len({r.kv_cache_bytes for r in p.ranks}) == 1
    kv = p.kv_cache_memory_bytes
    assert kv.source == "derived"
    assert kv.value == min(min(left), PROFILE.memory.kv_cache_memory_bytes_max)
    assert all(r.headroom_bytes >= 0 for r in p.ranks)
    # The middle rank holds PP send + receive buffers (SPEC: +40-60 MiB).
    assert p.ranks[1].pp_buffer_bytes > 0 == p.ranks[0].pp_buffer_bytes


def test_host_ram_and_pinned_bytes(full_model):
    p = make_plan(full_model, kv_cache_memory_bytes=550_000_000)
    assert p.pinned_bytes_needed == p.qsa.total_exact_bytes  # profile pins exactly
    assert p.host_ram_needed_bytes == p.pinned_bytes_needed + PROFILE.memory.host_overhead_bytes


def test_decode_roofline_from_the_headers(full_model):
    d = make_plan(full_model).decode
    assert (d.experts_per_token, d.num_experts) == (10, 512)
    assert d.bytes_per_token == d.dense_bytes + d.routed_expert_bytes * 10 // 512
    assert d.tokens_per_s == pytest.approx(936e9 / d.bytes_per_token)
    # SPEC: experts touched per token 1.22 GB (120.8B params at ~4.1 bits, x 10/512).
    assert d.routed_expert_bytes * 10 / 512 / 1e9 == pytest.approx(1.22, abs=0.02)
    # SPEC's dense 4.62 GB is ours plus the vision tower, which is never loaded
    # (test_decode_bytes.py: no other left-out term lands there).
    vision = sum(t.nbytes for t in full_model.tensors if t.name.startswith("model.visual."))
    assert (d.dense_bytes + vision) / 1e9 == pytest.approx(4.62, abs=0.005)


def test_user_values_beat_the_profile(full_model):
    p = make_plan(full_model, max_model_len=131072, kv_cache_memory_bytes=400_000_000)
    assert (p.max_model_len.value, p.max_model_len.source) == (131072, "flag")
    argv = make_argv(full_model, max_model_len=131072, kv_cache_memory_bytes=400_000_000)
    assert "--max-model-len" in argv and "131072" in argv


def test_the_pool_holds_two_full_length_requests_as_vllm_counts_blocks(full_model):
    # checks/patches/test_kv_request_capacity.py holds these to vLLM's own planner and
    # block manager: 105 blocks, 22 for a request's K/V and 20 for its states (18 GDN
    # groups, the PLE state, the ring); one is vLLM's null block.
    doc = make_plan_json(full_model)["kv_capacity"]
    assert doc["groups"] == {"qsa": 1, "ring": 1, "gdn": 18, "gdn_layers_per_group": 2, "ple": 1}
    assert (doc["num_blocks"], doc["usable_blocks"], doc["block_size_tokens"]) == (105, 104, 12_144)
    assert (doc["kv_blocks_per_request"], doc["state_blocks_per_request"]) == (22, 20)
    assert (doc["full_length_requests"], doc["starts"]) == (2, True)
    assert (doc["max_concurrency"], doc["kv_cache_tokens"]) == (2.5, 655_360)
    # Without offload the planner sizes no pool and claims no requests.
    off = dataclasses.replace(
        PROFILE, qsa_offload=dataclasses.replace(PROFILE.qsa_offload, enabled=False)
    )
    p = plan(base_facts(), full_model, off, _options())
    assert p.kv_capacity is None and "kv_capacity" not in p.to_json()


def test_plan_json_is_canonical_and_hashed(full_model):
    a = make_plan_json(full_model)
    b = make_plan_json(full_model)
    assert a == b and len(a["plan_hash"]) == 64
    assert a["schema_version"] == 1
    assert a["kv_cache_memory_bytes"]["source"] == "derived"
    c = make_plan_json(full_model, port=9000)
    assert c["plan_hash"] != a["plan_hash"]


def test_profile_selection():
    facts = base_facts()
    profile, reason = select_profile(facts, None)
    assert profile.name == "3x3090" and "matches" in reason
    empty = dataclasses.replace(facts, gpu=dataclasses.replace(facts.gpu, devices=()))
    profile, reason = select_profile(empty, None)
    assert profile.name == "3x3090" and "default" in reason


def test_a_profile_with_a_typo_is_refused_by_name():
    from importlib import resources

    from flashnext.profiles import ProfileError, parse_profile

    text = (resources.files("flashnext.profiles") / "3x3090.toml").read_text()
    broken = text.replace("count = 3", "count = 3\ncuont = 3").replace("min_pcie_gen = 4\n", "")
    with pytest.raises(ProfileError, match=r"x.toml \[gpu\]: missing min_pcie_gen; unknown cuont"):
        parse_profile(broken, "x.toml")
