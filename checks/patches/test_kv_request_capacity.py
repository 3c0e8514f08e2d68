"""What the shipped 3x3090 plan's KV pool holds, counted by vLLM 0.33.0 on CPU.

The planner (flashnext.plan, in-process) plans the full skeleton on the
replayed 3x3090 facts with the shipped profile: MTP off, and MTP on with one
draft token and INT4 experts (as `checkpoint mtp-int4` leaves them). The
plan's argv goes through `vllm serve`'s own parser; the target (and the
drafter) are built on `meta` with the shipped text shapes and the parsed
scheduler settings, split over PP=3 with get_pp_indices, and planned the way
the engine core does (get_global_kv_cache_groups, get_kv_cache_configs with
the plan's --kv-cache-memory-bytes on every rank,
generate_scheduler_kv_cache_config, get_kv_cache_capacity). vLLM's
KVCacheManager then admits requests of --max-model-len tokens until it
refuses one.

The planner's RequestCapacity (qsa_sizing) must give vLLM's groups, blocks,
concurrency, token figure and admissions. vLLM groups the 36 GDN layers
model-wide in 18 groups of 2, each split across two ranks, and a request
holds a block in each of them: 42 blocks for 262,144 tokens without MTP (22
of K/V), 66 with it, where the pool has 104 and 53.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
from qsa_offload_cpu import offload_on_cpu
from test_qsa_block_size import REAL_SHAPES
from test_qsa_block_size_mtp import specs_for_pp, split_per_rank
from tiny_qwen4_exp import engine_args, write_tiny_qwen4_exp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.checkpoint.mtp_int4 import int4_byte_classes  # noqa: E402
from flashnext.facts.model import read_model_facts  # noqa: E402
from flashnext.facts.schema import host_facts_from_json  # noqa: E402
from flashnext.plan import host_pools, qsa_sizing  # noqa: E402
from flashnext.plan.command import serve_command  # noqa: E402
from flashnext.plan.planner import PlanOptions, plan  # noqa: E402
from flashnext.profiles import available_profiles, with_mtp  # noqa: E402
from flashnext.skeleton import write_skeleton  # noqa: E402
from flashnext.skeleton.configs import full_text_config, tiny_text_config  # noqa: E402

FACTS = REPO / "checks" / "fixtures" / "facts" / "3x3090-nvme.json"
PROFILE = available_profiles()["3x3090"]
# The shipped context length, and the drafter's layer (mtp_num_hidden_layers).
SHAPES = REAL_SHAPES | {
    key: full_text_config()[key] for key in ("max_position_embeddings", "mtp_num_hidden_layers")
}
ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")


# ---------------------------------------------------------------- the planner's side


@dataclasses.dataclass(frozen=True)
class Planned:
    argv: tuple[str, ...]
    capacity: qsa_sizing.RequestCapacity


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Planned]:
    """The plans under test, by name; "mtp_at_262144" is the MTP plan's argv at the
    profile's length, which the planner declines (what `serve --mtp 1` would run)."""
    skeleton = tmp_path_factory.mktemp("full") / "Qwen3.8-Flash-Next"
    write_skeleton(skeleton, "full", fixed_metadata=True)
    model = read_model_facts(skeleton)
    int4 = dataclasses.replace(
        model,
        byte_classes=int4_byte_classes(
            model.tensor_bytes_by_class(), model.text_config["num_experts"]
        ),
    )
    facts = host_facts_from_json(FACTS.read_text(), source=str(FACTS))
    options = PlanOptions(model_dir=str(skeleton), table_path="/nvme/flashnext/ple-table.bin")
    out = {}
    off = plan(facts, model, PROFILE, options)
    out["mtp_off"] = Planned(serve_command(off, PROFILE, options).argv, off.kv_capacity)
    mtp = with_mtp(PROFILE, 1)
    declined = plan(facts, int4, mtp, options).mtp
    assert declined is not None and declined.load.fits and not declined.fits, declined.reason
    # The longest length the planner says MTP starts at: its own plan there.
    at = dataclasses.replace(options, max_model_len=declined.requests.longest_request_tokens)
    fitted = plan(facts, int4, mtp, at)
    assert fitted.mtp.fits, fitted.mtp.reason
    argv = serve_command(fitted, mtp, at).argv
    out["mtp_longest"] = Planned(argv, fitted.kv_capacity)
    # The same KV bytes: the length does not change what the drafter leaves for KV.
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(declined.kv_cache_bytes)
    full = list(argv)
    full[full.index("--max-model-len") + 1] = str(PROFILE.scheduler.max_model_len)
    out["mtp_at_262144"] = Planned(tuple(full), declined.requests)
    return out


# ---------------------------------------------------------------- vLLM's side


@dataclasses.dataclass
class Pool:
    config: object
    per_rank: list[dict]
    groups: list
    configs: list | None
    refusal: str | None


def parse(argv: tuple[str, ...]):
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = list(argv[2:])
    # The PLE table's path (patch 0010's engram field) sets no KV figure; the stock
    # parser refuses it.
    at = args.index("--engram-config")
    del args[at : at + 2]
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(args)


def vllm_pool(model_dir: Path, argv: tuple[str, ...]) -> Pool:
    """vLLM's KV cache plan for the argv's scheduler settings and KV bytes, every rank."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    ns = parse(argv)
    spec = ns.speculative_config
    config = engine_args(
        model_dir,
        engram_config={"cpu_offload": False},
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=ns.enable_prefix_caching,
        speculative_config=spec,
    ).create_engine_config()
    pp = ns.pipeline_parallel_size
    per_rank = split_per_rank(specs_for_pp(config, pp), SHAPES["num_hidden_layers"], pp)
    groups = get_global_kv_cache_groups(config, per_rank)
    try:
        configs = get_kv_cache_configs(config, per_rank, [ns.kv_cache_memory_bytes] * pp, groups)
    except ValueError as err:  # vLLM's refusal to start
        return Pool(config, per_rank, groups, None, str(err))
    return Pool(config, per_rank, groups, configs, None)


def admitted(pool: Pool, length: int | None = None) -> list[int]:
    """Free blocks after each request of `length` tokens (max_model_len) vLLM's
    KVCacheManager admits, as the engine core sets it up, until it refuses one."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.engine.core import resolve_kv_cache_block_sizes
    from vllm.v1.request import Request

    config = pool.config
    scheduler = generate_scheduler_kv_cache_config(pool.configs)
    participating = [
        g.kv_cache_spec.block_size
        for g in scheduler.kv_cache_groups
        if g.kv_cache_spec.prefix_cacheable
    ]
    config.cache_config.block_size = min(participating)
    block, hash_block = resolve_kv_cache_block_sizes(scheduler, config)
    length = length or config.model_config.max_model_len
    manager = KVCacheManager(
        kv_cache_config=scheduler,
        max_model_len=length,
        max_in_flight_tokens=config.max_in_flight_tokens,
        enable_caching=config.cache_config.enable_prefix_caching,
        scheduler_block_size=block,
        hash_block_size=hash_block,
    )
    free = []
    while True:
        request = Request(f"r{len(free)}", [1] * length, SamplingParams(max_tokens=1), None)
        if manager.allocate_slots(request, length) is None:
            return free
        free.append(manager.block_pool.get_num_free_blocks())


@pytest.fixture(scope="module")
def pools(plans, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Pool]:
    mp = pytest.MonkeyPatch()
    offload_on_cpu(mp)
    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("qwen4_exp_kv_capacity"), text_overrides=SHAPES
    )
    try:
        yield {name: vllm_pool(model_dir, p.argv) for name, p in plans.items()}
    finally:
        mp.undo()


def _kind(name: str) -> str:
    for suffix, kind in ((".linear_attn", "gdn"), (".ple", "ple"), (".raw_key_cache", "ring"),
                         (".self_attn.attn", "qsa")):  # fmt: skip
        if name.endswith(suffix):
            return kind
    return "other"


def _groups_by_kind(groups) -> dict[str, list[list[str]]]:
    found: dict[str, list[list[str]]] = {}
    for group in groups:
        kinds = {_kind(n) for n in group.layer_names} - {"other"}
        assert len(kinds) == 1, group.layer_names
        found.setdefault(kinds.pop(), []).append(group.layer_names)
    return found


# ---------------------------------------------------------------- the comparison

# On stock vLLM the pool is another one (no offload block size, 0020; none for the
# drafter's layer, 0032): the planner's figures are the patched tree's.
OFFLOAD = "0020-qsa-offload-block-size.patch"
OFFLOAD_MTP = "0032-qsa-offload-block-size-mtp.patch"
STARTS = [
    pytest.param("mtp_off", marks=pytest.mark.proves(OFFLOAD, raises=AssertionError)),
    pytest.param("mtp_longest", marks=pytest.mark.proves(OFFLOAD_MTP, raises=AssertionError)),
]


@pytest.mark.parametrize("name", STARTS)
def test_vllm_groups_are_the_planners(plans, pools, name):
    cap, pool = plans[name].capacity, pools[name]
    found = _groups_by_kind(pool.groups)
    g = cap.groups
    assert [len(found[k]) for k in ("qsa", "ring", "gdn", "ple")] == [g.qsa, g.ring, g.gdn, g.ple]
    assert max(len(names) for names in found["gdn"]) == g.gdn_layers_per_group
    # Model-wide, 18 groups of 2, not 12 of 3: the whole model's QSA page is the
    # anchor, 3 x (4 layers x 66 B x block) with each rank's page just under a GDN
    # state, so it holds 2 states. Each group's 2 layers sit on different ranks.
    assert (g.gdn, g.gdn_layers_per_group) == (18, 2)
    for rank_specs in pool.per_rank:
        assert all(sum(n in rank_specs for n in names) <= 1 for names in found["gdn"])


@pytest.mark.parametrize("name", STARTS)
def test_every_rank_holds_the_planners_blocks_and_concurrency(plans, pools, name):
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_max_concurrency_for_kv_cache_config,
    )

    planned, pool = plans[name], pools[name]
    cap = planned.capacity
    assert pool.refusal is None
    assert pool.config.cache_config.block_size == cap.block_size_tokens
    assert [c.num_blocks for c in pool.configs] == [cap.num_blocks] * 3
    # Every rank keeps every group (emptied where it holds none of its layers).
    assert all(len(c.kv_cache_groups) == len(pool.groups) for c in pool.configs)
    per_rank = [get_max_concurrency_for_kv_cache_config(pool.config, c) for c in pool.configs]
    assert per_rank == [cap.max_concurrency] * 3
    scheduler = generate_scheduler_kv_cache_config(pool.configs)
    # vLLM's log line: "KV cache size: N tokens, Maximum concurrency ...: Cx".
    assert get_kv_cache_capacity(pool.config, scheduler) == (
        cap.kv_cache_tokens,
        cap.max_concurrency,
    )


@pytest.mark.parametrize("name", STARTS)
def test_vllm_admits_the_planners_full_length_requests(plans, pools, name):
    cap = plans[name].capacity
    assert pools[name].refusal is None
    free = admitted(pools[name])
    assert len(free) == cap.full_length_requests >= 1
    per = cap.blocks_per_request
    assert free == [cap.usable_blocks - (i + 1) * per for i in range(len(free))]


@pytest.mark.proves(OFFLOAD, raises=AssertionError)
def test_the_kv_capacity_fix_length_admits_max_num_seqs_requests(plans, pools):
    """Preflight's kv.capacity suggests the longest --max-model-len at which
    --max-num-seqs requests of that length fit at once; one token more, and not."""
    cap, pool = plans["mtp_off"].capacity, pools["mtp_off"]
    seqs = PROFILE.scheduler.max_num_seqs
    length = cap.longest_for(seqs)
    assert pool.refusal is None and 0 < length < cap.max_model_len
    assert len(admitted(pool, length)) >= seqs
    assert len(admitted(pool, length + 1)) < seqs


def test_shipped_figures(plans):
    """The README's figures, as the checks above hold them to vLLM."""
    off, on = plans["mtp_off"].capacity, plans["mtp_longest"].capacity
    assert (off.num_blocks, off.blocks_per_request, off.full_length_requests) == (105, 42, 2)
    assert (off.max_concurrency, off.kv_cache_tokens) == (2.5, 655_360)
    assert (on.max_model_len, on.num_blocks, on.blocks_per_request) == (136_864, 54, 53)
    assert on.full_length_requests == 1


@pytest.mark.proves(OFFLOAD_MTP, raises=AssertionError)
def test_mtp_at_full_length_is_refused_as_the_planner_says(plans, pools):
    """With the drafter's weights on rank 2 the plan's KV bytes make 54 blocks, and a
    262,144-token request takes 66: vLLM refuses to start, and its estimate of the
    longest length that would start is the planner's."""
    cap, pool = plans["mtp_at_262144"].capacity, pools["mtp_at_262144"]
    assert not cap.starts and cap.blocks_per_request == 66 > cap.usable_blocks == 53
    assert pool.refusal is not None and "To serve at least one request" in pool.refusal
    assert int(ESTIMATE.search(pool.refusal).group(1)) == cap.longest_request_tokens
    assert plans["mtp_longest"].capacity.max_model_len == cap.longest_request_tokens


# ---------------------------------------------------------------- a GPU run's own figures

SERVE_TINY = REPO / "checks" / "gpu" / "results" / "serve_tiny-h200-run1"
LOGGED = re.compile(
    r"GPU KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per "
    r"request: ([\d.]+)x"
)


def test_the_h200_runs_logged_capacity_is_the_planners():
    """The h200-tiny serve run (PP=1, checks/gpu/tiny/tiny_model.py's checkpoint, the
    recorded plan's pool) logged vLLM's own figures; the planner's from that plan."""
    sys.path.insert(0, str(REPO / "checks" / "gpu" / "tiny"))
    from tiny_model import TEXT_OVERRIDES

    recorded = json.loads((SERVE_TINY / "plan.json").read_text())
    tokens, length, concurrency = LOGGED.search((SERVE_TINY / "serve.log").read_text()).groups()
    shape = host_pools.shape_from_text(tiny_text_config(**TEXT_OVERRIDES))
    pools = recorded["qsa"]
    cap = qsa_sizing.request_capacity(
        shape, pools["num_blocks"], pools["block_tokens"], recorded["max_model_len"]["value"]
    )
    assert cap.max_model_len == int(length.replace(",", ""))
    assert cap.kv_cache_tokens == int(tokens.replace(",", ""))
    assert f"{cap.max_concurrency:.2f}" == concurrency
