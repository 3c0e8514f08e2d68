"""The Plan: a pure function of (HostFacts, ModelFacts, Profile, user options).

It answers: which layers each PP rank owns, how many bytes of weights each card
holds, how much VRAM is left for KV (sized for the tightest rank), how large
the pinned host K/V pools are (exact, and as PyTorch's power-of-two pinned
allocator would round them), how much host RAM and memlock that needs, what
the single-stream decode roofline is, and the environment vLLM runs in. The
argv that realises it is rendered from a finished plan by command.py; a Plan
holds no argv.

Every planned value carries its source ("flag", "env", "profile", "derived")
and a one-line reason; user input beats derivation.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from flashnext.facts.config_check import check_text_config
from flashnext.facts.model_context import model_context
from flashnext.facts.model_derived import (
    ConfigValueError,
    config_int,
    ple_layer_ids,
    ple_shard_names,
)
from flashnext.facts.schema import HostFacts, ModelFacts, dumps, to_jsonable
from flashnext.plan import host_pools, qsa_sizing
from flashnext.plan.decode_bytes import DecodeTerm, decode_terms
from flashnext.plan.mtp import (
    MtpFit,
    MtpNeeds,
    drafter_bytes_per_step,
    drafter_host_bytes_per_step,
    fit_mtp,
    lm_head_bytes,
    load_check,
    mtp_needs,
    no_drafter,
)
from flashnext.plan.mtp_projection import StepCost, project_mtp
from flashnext.plan.options import PlanOptions
from flashnext.plan.partition import pp_layer_ranges, rank_of_layer
from flashnext.plan.placement import place_tensor
from flashnext.plan.start_peak import StartPeak, largest_repack, predict, repack_layers
from flashnext.profiles import Profile

Source = Literal["flag", "env", "profile", "derived"]
PLAN_SCHEMA_VERSION = 1


class PlanError(ValueError):
    """The inputs cannot be planned (the message says which and how to fix it)."""


@dataclass(frozen=True)
class Planned:
    value: Any
    source: Source
    reason: str


@dataclass(frozen=True)
class RankPlan:
    rank: int
    layers: tuple[int, int]
    """[start, end) decoder layers."""
    qsa_layers: tuple[int, ...]
    weight_bytes: int
    """Weights resident on this card, from the safetensors headers."""
    workspace_bytes: int
    pp_buffer_bytes: int
    activation_bytes: int
    qsa_workspace_bytes: int
    """Offload prefill buffers and running state (vLLM's profile never counts them);
    part of activation_bytes, not added to it."""
    kv_cache_bytes: int
    vram_total_bytes: int
    vram_usable_bytes: int
    """vram_total x gpu_memory_utilization, as vLLM computes its budget."""
    drafter_weight_bytes: int = 0
    """The MTP drafter's weights resident in VRAM (last rank, when it is placed; its
    experts and embedding are in host memory: plan/mtp.py); not in weight_bytes."""
    start_peak: StartPeak | None = None
    """The most the rank holds while starting (plan/start_peak.py): the load's repack
    transient and the CUDA context, beside the committed bytes."""

    @property
    def committed_bytes(self) -> int:
        return (
            self.weight_bytes
            + self.drafter_weight_bytes
            + self.workspace_bytes
            + self.pp_buffer_bytes
            + self.activation_bytes
            + self.kv_cache_bytes
        )

    @property
    def headroom_bytes(self) -> int:
        return self.vram_usable_bytes - self.committed_bytes


@dataclass(frozen=True)
class DecodeRoofline:
    dense_bytes: int
    """Non-expert weights read once per decoded token (embedding excluded: one row)."""
    routed_expert_bytes: int
    """All routed experts; a token reads experts_per_token / num_experts of them."""
    experts_per_token: int
    num_experts: int
    bandwidth_bytes_per_s: int
    terms: tuple[DecodeTerm, ...] = ()
    """Every tensor of the checkpoint by what a token reads of it (plan/decode_bytes.py):
    the counted terms are the two above; the others say why they are left out."""

    @property
    def bytes_per_token(self) -> int:
        return self.dense_bytes + self.routed_expert_bytes * self.experts_per_token // max(
            self.num_experts, 1
        )

    @property
    def tokens_per_s(self) -> float:
        # PP=1 stream: the token crosses every card in turn, so the cards'
        # bandwidths do not add up; the bound is one card's bandwidth.
        return self.bandwidth_bytes_per_s / self.bytes_per_token if self.bytes_per_token else 0.0


@dataclass(frozen=True)
class Plan:
    profile: str
    profile_reason: str
    pp_ranges: tuple[tuple[int, int], ...]
    ple_layers: tuple[int, ...]
    """Layer indices (0-based) that run the PLE n-gram embedding."""
    ple_ranks: tuple[int, ...]
    ranks: tuple[RankPlan, ...]
    tightest_rank: int
    kv_cache_memory_bytes: Planned
    max_model_len: Planned
    qsa: host_pools.HostPools | None
    host_ram_needed_bytes: int
    pinned_bytes_needed: int
    decode: DecodeRoofline
    env: dict[str, str]
    """The environment `vllm serve` runs with: the profile's, the topology's, ours."""
    notes: tuple[str, ...] = field(default=())
    env_reasons: dict[str, str] = field(default_factory=dict)
    """Why each variable derived from the facts (not the profile's) is set."""
    mtp: MtpFit | None = None
    """The MTP drafter on the last rank, when the profile asks for it."""
    kv_capacity: qsa_sizing.RequestCapacity | None = None
    """Requests of max_model_len tokens the pool holds, as vLLM counts its blocks
    (None: QSA offload off)."""

    def to_json(self) -> dict[str, Any]:
        """The plan's own JSON (no argv); `plan --json` is command.plan_json's."""
        doc = to_jsonable(self)
        doc.pop("mtp")
        if self.mtp is not None:  # absent otherwise: plans without MTP keep their hash
            doc["mtp"] = self.mtp.to_json()
        doc.pop("kv_capacity")
        if self.kv_capacity is not None:  # absent without QSA offload: no pool to count
            doc["kv_capacity"] = capacity_json(self.kv_capacity)
        doc["schema_version"] = PLAN_SCHEMA_VERSION
        for rank, derived in zip(doc["ranks"], self.ranks, strict=True):
            if not derived.drafter_weight_bytes:  # plans without MTP keep their hash
                rank.pop("drafter_weight_bytes")
            rank["committed_bytes"] = derived.committed_bytes
            if derived.start_peak is not None:
                rank["start_peak"] = derived.start_peak.to_json()
            rank["headroom_bytes"] = derived.headroom_bytes
        doc["decode"]["bytes_per_token"] = self.decode.bytes_per_token
        doc["decode"]["tokens_per_s"] = round(self.decode.tokens_per_s, 2)
        doc["plan_hash"] = hashlib.sha256(dumps(doc).encode()).hexdigest()
        return doc


def capacity_json(cap: qsa_sizing.RequestCapacity) -> dict[str, Any]:
    """A RequestCapacity with the figures vLLM reports (its fields and properties)."""
    doc = to_jsonable(cap)
    for name in ("blocks_per_request", "usable_blocks", "full_length_requests", "starts",
                 "kv_cache_tokens", "longest_request_tokens"):  # fmt: skip
        doc[name] = getattr(cap, name)
    doc["max_concurrency"] = round(cap.max_concurrency, 4)
    return doc


# ---------------------------------------------------------------- derivations


def qsa_layer_indices(text_config: dict[str, Any]) -> tuple[int, ...]:
    """Full-attention (QSA) layers: every `full_attention_interval`-th layer."""
    layer_types = text_config.get("layer_types")
    if layer_types:
        return tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    interval = config_int(text_config, "full_attention_interval", 4)
    n = config_int(text_config, "num_hidden_layers")
    return tuple(i for i in range(n) if (i + 1) % interval == 0)


def weights_per_rank(
    model: ModelFacts, ranges: list[tuple[int, int]]
) -> tuple[list[int], int, int]:
    """Bytes per rank, plus the dense and routed-expert bytes read by decode.

    Placed per tensor class (facts.schema.tensor_class: the expert number folded),
    which places exactly as each of its tensors would: a few thousand names, not 225k.
    """
    ple_table = frozenset(ple_shard_names(model.text_config))
    rank_of = {i: r for r, (start, end) in enumerate(ranges) for i in range(start, end)}
    last = len(ranges) - 1
    per_rank = [0] * len(ranges)
    dense = routed = 0
    for name, nbytes in model.tensor_bytes_by_class().items():
        spot = place_tensor(name, ple_table)
        where = spot.where
        if where == "layer":
            if spot.layer not in rank_of:
                raise PlanError(
                    f"{name}: layer {spot.layer} is beyond num_hidden_layers "
                    f"({len(rank_of)}); the checkpoint does not match its config.json"
                )
            per_rank[rank_of[spot.layer]] += nbytes
        elif where == "first":
            per_rank[0] += nbytes
        elif where == "last":
            per_rank[last] += nbytes
        else:  # on disk (PLE table) or not loaded (vision, MTP)
            continue
        if spot.routed_expert:
            routed += nbytes
        elif not spot.embedding:
            dense += nbytes
    return per_rank, dense, routed


def _qsa_workspace_bytes(text: dict[str, Any], profile: Profile) -> int:
    if not profile.qsa_offload.enabled:
        return 0
    return qsa_sizing.offload_workspace_bytes(
        host_pools.shape_from_text(text),
        max_num_batched_tokens=profile.scheduler.max_num_batched_tokens,
        max_num_seqs=profile.scheduler.max_num_seqs,
        chunk_tokens=profile.qsa_offload.chunk_tokens,
    )


def nccl_env(facts: HostFacts, profile: Profile) -> tuple[dict[str, str], dict[str, str]]:
    """(variables, why) for NCCL from the GPU topology in the facts.

    RTX 3090s (GeForce) have no PCIe P2P: NVML reports chipset_not_supported for
    every pair, and NCCL then moves PP activations through host shared memory.
    NCCL_P2P_DISABLE=1 says so up front, so NCCL never probes a P2P path NVML says
    is absent. Nothing is set when every pair has P2P, when the topology is not
    known, or for a single GPU; a variable the profile sets is left to it.
    """
    used = {d.index for d in facts.gpu.devices if profile.gpu.matches(d)}
    if len(used) < 2 or "NCCL_P2P_DISABLE" in profile.env:
        return {}, {}
    absent: dict[tuple[int, int], str] = {}
    for link in facts.gpu.p2p:
        if {link.gpu_a, link.gpu_b} <= used and link.status not in ("ok", "unknown"):
            absent[tuple(sorted((link.gpu_a, link.gpu_b)))] = link.status
    if not absent:
        return {}, {}
    pairs = ", ".join(f"{a}-{b} ({why})" for (a, b), why in sorted(absent.items()))
    return {"NCCL_P2P_DISABLE": "1"}, {
        "NCCL_P2P_DISABLE": f"NVML reports no PCIe P2P between GPUs {pairs}: PP activations "
        "go through host memory (NCCL's shared-memory transport); disabling P2P keeps NCCL "
        "from probing a path the GPUs do not have"
    }


# Knobs our patch series adds to vLLM (patches/vllm-0.33.0/): registered in
# vllm/envs.py, never read ad hoc.
ENV_QSA_OFFLOAD = "VLLM_QSA_KV_OFFLOAD"  # 0020: host K/V arenas on
ENV_QSA_OFFLOAD_MAX_HOST_BYTES = "VLLM_QSA_KV_OFFLOAD_MAX_HOST_BYTES"  # 0020: cap per rank
ENV_QSA_OFFLOAD_CHUNK_TOKENS = "VLLM_QSA_KV_OFFLOAD_CHUNK_TOKENS"  # 0020: prefill chunk


def serve_env(
    profile: Profile,
    options: PlanOptions,
    qsa: host_pools.HostPools | None,
    topology_env: dict[str, str],
) -> dict[str, str]:
    """The environment of `vllm serve`: the profile's, then what the GPU topology calls
    for (nccl_env), the user's layer partition, and the QSA offload knobs."""
    env = dict(profile.env)
    env.update(topology_env)
    if options.pp_layer_partition:
        env["VLLM_PP_LAYER_PARTITION"] = options.pp_layer_partition
    if qsa is not None:
        env[ENV_QSA_OFFLOAD] = "1"
        env[ENV_QSA_OFFLOAD_MAX_HOST_BYTES] = str(profile.qsa_offload.max_host_bytes)
        env[ENV_QSA_OFFLOAD_CHUNK_TOKENS] = str(profile.qsa_offload.chunk_tokens)
    return env


def pp_buffer_for_rank(rank: int, pp_size: int, profile: Profile) -> int:
    """Middle ranks both receive and send hidden states: the measured extra peak."""
    return profile.memory.pp_buffer_bytes if 0 < rank < pp_size - 1 else 0


def _vram_total(facts: HostFacts, profile: Profile) -> tuple[int, str | None]:
    matching = [d for d in facts.gpu.devices if profile.gpu.matches(d)]
    if len(matching) >= profile.gpu.count:
        return min(d.memory_total_bytes for d in matching), None
    return profile.gpu.memory_bytes, (
        f"no {profile.gpu.count}x {profile.gpu.label} in the facts: VRAM per card taken "
        f"from the profile ({profile.gpu.memory_bytes} bytes)"
    )


def _bandwidth(facts: HostFacts, profile: Profile) -> int:
    """The cards' memory bandwidth for the roofline: the slowest of the profile's cards
    the facts show (a profile may name several), else the profile's own card's."""
    cards = [profile.gpu.card(d) for d in facts.gpu.devices]
    figures = [c.bandwidth_bytes_per_s for c in cards if c is not None]
    return min(figures) if figures else profile.gpu.bandwidth_bytes_per_s


def plan(
    facts: HostFacts,
    model: ModelFacts,
    profile: Profile,
    options: PlanOptions,
    profile_reason: str = "",
) -> Plan:
    """Raises PlanError naming config.json and the key when its values cannot be planned."""
    try:
        return _plan(facts, model, profile, options, profile_reason)
    except ConfigValueError as exc:
        raise PlanError(
            f"{Path(model.path) / 'config.json'}: {exc}; restore config.json from the "
            "published checkpoint"
        ) from exc


def _max_model_len(model: ModelFacts, profile: Profile, options: PlanOptions) -> Planned:
    """--max-model-len, else the profile's, bounded by the context vLLM derives from
    config.json: it refuses a longer one at start, after loading. Every length a fix
    line suggests is below this one, so within the bound too."""
    context = model_context(model.text_config)
    if options.max_model_len:
        if context is not None and options.max_model_len > context.tokens:
            raise PlanError(
                f"--max-model-len {options.max_model_len} is longer than the model's context "
                f"({Path(model.path) / 'config.json'}: {context.describe()}), which vLLM "
                f"refuses at start: pass --max-model-len {context.tokens} or less"
            )
        return Planned(options.max_model_len, "flag", "--max-model-len given")
    wanted = profile.scheduler.max_model_len
    if context is not None and wanted > context.tokens:
        return Planned(
            context.tokens,
            "derived",
            f"the model's context ({context.describe()}), shorter than profile "
            f"{profile.name}'s {wanted}",
        )
    return Planned(wanted, "profile", f"profile {profile.name}")


def _plan(
    facts: HostFacts,
    model: ModelFacts,
    profile: Profile,
    options: PlanOptions,
    profile_reason: str,
) -> Plan:
    text = check_text_config(model)  # types, bounds, tensors: before anything is sized
    pp = profile.parallel.pipeline_parallel_size
    num_layers = config_int(text, "num_hidden_layers")
    ranges = pp_layer_ranges(num_layers, pp, options.pp_layer_partition)
    ple_layers = ple_layer_ids(text)
    beyond = [i + 1 for i in ple_layers if i >= num_layers]
    if beyond:
        raise ConfigValueError(
            f"ple_layer_ids {beyond} name layer(s) beyond num_hidden_layers {num_layers}"
        )
    ple_ranks = tuple(sorted({rank_of_layer(i, ranges) for i in ple_layers}))
    qsa_layers = qsa_layer_indices(text)
    notes: list[str] = []

    weights, dense, routed = weights_per_rank(model, ranges)
    vram_total, vram_note = _vram_total(facts, profile)
    if vram_note:
        notes.append(vram_note)
    usable = int(vram_total * profile.memory.gpu_memory_utilization)
    # The profile's activation reserve is what the seed's cards held beyond
    # weights and KV, its own offload buffers included; ours must fit in it.
    qsa_workspace = _qsa_workspace_bytes(text, profile)
    activation = max(profile.memory.activation_reserve_bytes, qsa_workspace)
    fixed = [
        weights[r]
        + profile.memory.workspace_margin_bytes
        + pp_buffer_for_rank(r, pp, profile)
        + activation
        for r in range(pp)
    ]
    max_len = _max_model_len(model, profile, options)
    decode = DecodeRoofline(
        dense_bytes=dense,
        routed_expert_bytes=routed,
        experts_per_token=config_int(text, "num_experts_per_tok", 0, minimum=0),
        num_experts=config_int(text, "num_experts", 0, minimum=0),
        bandwidth_bytes_per_s=_bandwidth(facts, profile),
        terms=decode_terms(model.tensor_bytes_by_class(), text, frozenset(ple_shard_names(text))),
    )
    budget = _Budget(text, ranges, profile, options, vram_total, usable, fixed, max_len.value)
    sized = _size(budget, None)
    mtp = None
    if profile.mtp.enabled:
        mtp, with_drafter = _mtp_fit(model, budget, weights, decode, sized)
        if mtp.fits:  # otherwise the plan is the one without MTP, and mtp says why
            sized = with_drafter

    kv, qsa = sized.kv, sized.qsa
    rank_plans = tuple(
        RankPlan(
            rank=r,
            layers=ranges[r],
            qsa_layers=tuple(i for i in qsa_layers if ranges[r][0] <= i < ranges[r][1]),
            weight_bytes=weights[r],
            workspace_bytes=profile.memory.workspace_margin_bytes,
            pp_buffer_bytes=pp_buffer_for_rank(r, pp, profile),
            activation_bytes=activation,
            qsa_workspace_bytes=qsa_workspace,
            kv_cache_bytes=kv.value,
            vram_total_bytes=vram_total,
            vram_usable_bytes=usable,
            drafter_weight_bytes=sized.drafter_bytes[r],
        )
        for r in range(pp)
    )
    rank_plans = _with_start_peaks(model, text, profile, rank_plans, mtp)
    # The QSA pools hold the drafter's K/V arena when it is placed; its offloaded
    # weights are pinned by the offloader, beside them.
    pinned = (qsa.pinned_total_bytes if qsa else 0) + (
        mtp.pinned_weight_bytes if mtp is not None and mtp.fits else 0
    )
    host_needed = pinned + profile.memory.host_overhead_bytes
    topology_env, env_reasons = nccl_env(facts, profile)
    env = serve_env(profile, options, qsa, topology_env)
    return Plan(
        profile=profile.name,
        profile_reason=profile_reason,
        pp_ranges=tuple(ranges),
        ple_layers=ple_layers,
        ple_ranks=ple_ranks,
        ranks=rank_plans,
        tightest_rank=sized.tightest,
        kv_cache_memory_bytes=kv,
        max_model_len=max_len,
        qsa=qsa,
        host_ram_needed_bytes=host_needed,
        pinned_bytes_needed=pinned,
        decode=decode,
        env=env,
        notes=tuple(notes),
        env_reasons=env_reasons,
        mtp=mtp,
        kv_capacity=sized.capacity,
    )


def _with_start_peaks(
    model: ModelFacts,
    text: dict[str, Any],
    profile: Profile,
    ranks: tuple[RankPlan, ...],
    mtp: MtpFit | None,
) -> tuple[RankPlan, ...]:
    """Each rank with its predicted start peak (plan/start_peak.py)."""
    layers = repack_layers(
        model.tensor_bytes_by_class(),
        frozenset(ple_shard_names(model.text_config)),
        config_int(text, "num_experts", 0, minimum=0),
    )
    memory = profile.memory
    source = memory.cuda_context_source or f"not in profile {profile.name}: counted as 0"
    last = len(ranks) - 1
    out = []
    for r in ranks:
        placed = mtp is not None and mtp.fits and r.rank == last and mtp.load is not None
        peak = predict(
            weight_bytes=r.weight_bytes,
            workspace_bytes=r.workspace_bytes,
            pp_buffer_bytes=r.pp_buffer_bytes,
            committed_bytes=r.committed_bytes,
            context_bytes=memory.cuda_context_bytes,
            context_source=source,
            repack=largest_repack(layers, *r.layers),
            mtp_transient_bytes=mtp.load.transient_bytes if placed else None,
        )
        out.append(dataclasses.replace(r, start_peak=peak))
    return tuple(out)


@dataclass(frozen=True)
class _Budget:
    """What the KV sizing starts from: the ranks' usable VRAM and fixed bytes."""

    text: dict[str, Any]
    ranges: list[tuple[int, int]]
    profile: Profile
    options: PlanOptions
    vram_total: int
    usable: int
    fixed: list[int]
    """Per rank: target weights, workspace, PP buffers, activations."""
    max_model_len: int


@dataclass(frozen=True)
class _Sized:
    tightest: int
    kv: Planned
    qsa: host_pools.HostPools | None
    drafter_bytes: tuple[int, ...]
    """Per rank: the MTP drafter's resident weights (all 0 without it)."""
    capacity: qsa_sizing.RequestCapacity | None


def _size(budget: _Budget, drafter: MtpNeeds | None) -> _Sized:
    """--kv-cache-memory-bytes and the QSA pools; with the drafter placed, its resident
    weights count on the last rank and its QSA layer among that rank's (QsaShape)."""
    pp = len(budget.ranges)
    extra = [0] * pp
    k = drafter_layers = 0
    if drafter is not None:
        extra[-1] = drafter.resident_bytes
        k, drafter_layers = budget.profile.mtp.num_speculative_tokens, drafter.num_layers
    shape = host_pools.shape_from_text(budget.text, k, drafter_layers)
    left = [budget.usable - budget.fixed[r] - extra[r] for r in range(pp)]
    # One --kv-cache-memory-bytes applies to every rank: size it for the
    # rank with the least VRAM left after weights and buffers.
    tightest = min(range(pp), key=lambda r: left[r])
    kv, qsa = _kv_cache_bytes(shape, budget.ranges, budget.profile, budget.options, left[tightest])
    capacity = (
        qsa_sizing.request_capacity(
            shape,
            qsa.num_blocks,
            qsa.block_tokens,
            budget.max_model_len,
            prefix_caching=budget.profile.scheduler.enable_prefix_caching,
        )
        if qsa is not None
        else None
    )
    return _Sized(tightest, kv, qsa, tuple(extra), capacity)


def _mtp_fit(
    model: ModelFacts,
    budget: _Budget,
    weights: list[int],
    decode: DecodeRoofline,
    without: _Sized,
) -> tuple[MtpFit, _Sized | None]:
    """The drafter on the last rank, sized in (plan/mtp.py), and what it would gain under
    the decode roofline at the profile's cited acceptance rate; with the sizing that
    holds it (None: no MTP tensors)."""
    profile, last = budget.profile, len(budget.ranges) - 1
    by_class = model.tensor_bytes_by_class()
    needs = mtp_needs(by_class, model.text_config)
    if needs is None:
        return no_drafter(last, "the checkpoint has no MTP tensors (mtp.*)"), None
    sized = _size(budget, needs)
    # The start peaks were measured on the profile's card with its own partition:
    # what the start held beyond the target's weights there (its context, the
    # target's repack transient) is room the drafter's load has been seen to get.
    peaks = profile.memory.measured_start_peak_bytes
    measured = (
        peaks[last] - weights[last]
        if peaks
        and len(peaks) == len(budget.ranges)
        and not budget.options.pp_layer_partition
        and budget.vram_total == profile.gpu.memory_bytes
        else None
    )
    load = load_check(
        needs, budget_room_bytes=budget.usable - weights[last], measured_room_bytes=measured
    )
    fit = fit_mtp(
        needs,
        rank=last,
        load=load,
        kv_cache_bytes=sized.kv.value,
        pools=sized.qsa,
        requests=sized.capacity,
        requests_without=without.capacity,
        vram_kv_bytes_per_token=qsa_sizing.offload_vram_bytes_per_token(
            host_pools.shape_from_text(budget.text)
        ),
    )
    cost = StepCost(
        target_dense_bytes=decode.dense_bytes,
        target_routed_bytes_per_token=decode.bytes_per_token - decode.dense_bytes,
        drafter_bytes=drafter_bytes_per_step(needs, head_bytes=lm_head_bytes(by_class)),
        bandwidth_bytes_per_s=decode.bandwidth_bytes_per_s,
        drafter_host_bytes=drafter_host_bytes_per_step(
            needs, experts_per_token=decode.experts_per_token, num_experts=decode.num_experts
        ),
        host_link_bytes_per_s=profile.gpu.host_link_bytes_per_s,
    )
    spec = profile.mtp
    projection = project_mtp(
        cost,
        acceptance_rate=spec.acceptance_rate,
        acceptance_source=spec.acceptance_source,
        num_speculative_tokens=spec.num_speculative_tokens,
    )
    return dataclasses.replace(fit, projection=projection), sized


def _kv_cache_bytes(
    shape: qsa_sizing.QsaShape,
    ranges: list[tuple[int, int]],
    profile: Profile,
    options: PlanOptions,
    vram_left: int,
) -> tuple[Planned, host_pools.HostPools | None]:
    offload = profile.qsa_offload
    pp = len(ranges)
    counts = [end - start for start, end in ranges]

    def pools(kv: int) -> host_pools.HostPools | None:
        if not offload.enabled:
            return None
        return host_pools.host_pools(shape, pp, counts, kv, offload.host_pinning)

    if options.kv_cache_memory_bytes is not None:
        kv = options.kv_cache_memory_bytes
        return Planned(kv, "flag", "--kv-cache-memory-bytes given"), pools(kv)

    cap = profile.memory.kv_cache_memory_bytes_max
    if vram_left < cap:
        kv, why = vram_left, "VRAM left on the tightest rank"
    else:
        kv, why = cap, f"profile cap (VRAM left on the tightest rank: {vram_left} bytes)"
    if kv <= 0:
        # Nothing fits: plan zero KV and let preflight show which rank overflows.
        return Planned(0, "derived", f"no VRAM left: short by {-kv} bytes"), pools(0)
    if offload.enabled:
        fitted = host_pools.largest_kv_within_host_cap(
            shape, pp, counts, kv, offload.max_host_bytes, offload.host_pinning
        )
        if fitted < kv:
            why += f"; lowered to keep each rank's pinned pools within {offload.max_host_bytes}"
            kv = fitted
        if offload.host_pinning == "pow2":
            fitted = host_pools.largest_kv_below_pow2(shape, pp, counts, kv)
            if fitted < kv:
                why += "; lowered so no pinned pool crosses a power of two"
                kv = fitted
    return Planned(kv, "derived", why), pools(kv)
