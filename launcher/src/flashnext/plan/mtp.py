"""Where the MTP drafter goes on the last PP rank, and whether it fits (issue 16).

Under PP the drafter runs on the last rank only (patch 0030). Patch 0031 hands
its embedding and its MTP layer to vLLM's weight offloader under their full
names, so `--cpu-offload-gb G --cpu-offload-params SEG ...` with
drafter_offload_params' segments moves its routed experts and its own
embedding to pinned host memory that the GPU reads in place (UVA). What that
leaves where:

- VRAM while serving: its decoder layer without the routed experts
  (attention, shared expert, router, HC) and fc_embedding, fc_hidden, its
  norms and HC mixer ("resident"); and its QSA layer's share of the KV pool:
  under VLLM_QSA_KV_OFFLOAD (patch 0022) its K/V goes to a host arena like the
  target's QSA layers, and VRAM keeps the 2 B slot number and the pooled
  indexer key per token. The planner counts its layer as one more QSA layer of
  the last rank (QsaShape.drafter_qsa_layers) and sizes
  --kv-cache-memory-bytes with the resident bytes on that rank.
- pinned host memory: the routed experts and the embedding (a copy of the
  target's tensors as stored, INT8 in the shipped checkpoint, patch 0033:
  under PP>1 vLLM does not share the target's, which sits on rank 0;
  `spec_decode/eagle/utils.py maybe_share_target_embed`), each parameter
  rounded up to a power of two by PyTorch's pinned allocator (`pin_memory()`
  in the offloader), and its layer's K/V arena (with the QSA pools).
- VRAM while loading: the offloader moves parameters out only after vLLM has
  built the module on the GPU (model_executor/offloader/uva.py
  `_maybe_offload_to_cpu`), and the Marlin repack after loading rebuilds the
  experts on the GPU before they go back to the host
  (model_loader/utils.py `device_loading_context`). The resident part plus
  the largest offloaded module pass through VRAM once, after the target's
  weights are in and before the KV cache exists.

As shipped the routed experts are BF16 (4.69 GiB): their load transient does
not fit, and `flashnext checkpoint mtp-int4` rewrites them INT4 g128 (about
1.2 GiB). What the drafter would gain is plan/mtp_projection.py's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from flashnext.facts.model_derived import config_int
from flashnext.plan.host_pools import HostPools, pow2_ceil
from flashnext.plan.mtp_projection import MtpProjection
from flashnext.plan.qsa_sizing import RequestCapacity
from flashnext.units import GIB, gib

MTP_PREFIX = "mtp."
ROUTED = ".mlp.experts."
LM_HEAD_PREFIX = "lm_head."
GROUP = 128  # INT4 g128, the scheme the target's experts use
BF16_BYTES = 2
TARGET_EMBED = "model.language_model.embed_tokens."
"""The checkpoint's embedding tensors: the drafter loads these (it has none of its own)."""
EMBED_PREFIX = "mtp.embed_tokens."
"""The drafter's copy, as the offloader names it; patch 0033 gives it the scheme of the
tensors it loads (INT8 g128 packed in the shipped checkpoint: weight_packed, weight_scale,
weight_shape)."""
INT4_FIX = "flashnext checkpoint mtp-int4"
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.*)$")
# A routed expert tensor as stored: gate/up fuse into vLLM's w13, down is w2.
_EXPERT = re.compile(r"^mlp\.experts\.(?:\*|\d+)\.(gate|up|down)_proj\.(\w+)$")


def drafter_offload_params(num_hidden_layers: int, num_mtp_layers: int) -> tuple[str, ...]:
    """vLLM `--cpu-offload-params` segments that put the drafter's embedding and
    routed experts in pinned host memory (patch 0031 hands them to the offloader
    under these names; the drafter's layers are numbered after the target's)."""
    experts = tuple(
        f"{MTP_PREFIX}layers.{num_hidden_layers + i}{ROUTED.rstrip('.')}"
        for i in range(num_mtp_layers)
    )
    return (f"{MTP_PREFIX}embed_tokens", *experts)


def offload_selects(segments: tuple[str, ...], name: str) -> bool:
    """vLLM's own rule (offloader/uva.py `_maybe_offload_to_cpu`): a parameter is
    offloaded when `.SEG.` is a substring of `.PREFIX+NAME.`."""
    return any(f".{seg}." in f".{name}." for seg in segments)


def offloader_name(name: str, num_hidden_layers: int) -> str | None:
    """The full name under which vLLM's offloader sees the drafter's copy of the
    checkpoint tensor `name`: `mtp.layers.I.X` as `mtp.layers.(N+I).X`. None for the
    rest: the target's layers are wrapped under "" (layer-relative names), and the
    drafter's fc/norms/mixer are never handed to the offloader."""
    m = _MTP_LAYER.match(name)
    return f"{MTP_PREFIX}layers.{num_hidden_layers + int(m[1])}.{m[2]}" if m else None


def cpu_offload_gib(nbytes: int) -> str:
    """`--cpu-offload-gb` for `nbytes`: GiB rounded up to 0.01, so that vLLM's
    int(G * 1024**3) byte budget covers every selected parameter (it stops
    offloading once the budget is reached, checked before each parameter)."""
    hundredths = -(-nbytes * 100 // GIB)
    while int(float(f"{hundredths / 100:.2f}") * GIB) < nbytes:  # float rounding
        hundredths += 1
    return f"{hundredths // 100}.{hundredths % 100:02d}"


@dataclass(frozen=True)
class MtpNeeds:
    layer_bytes: int
    """The MTP decoder layer(s) as stored, routed experts included."""
    routed_expert_bytes: int
    """Of layer_bytes: the routed experts, as stored."""
    experts_bf16: bool
    """The routed experts are stored as plain BF16 `weight`s (as shipped), not INT4."""
    other_bytes: int
    """fc_embedding, fc_hidden, norms, the HC mixer."""
    embed_bytes: int
    """The drafter's own embed_tokens under PP>1: the target's embedding tensors as stored."""
    num_layers: int = 1
    """MTP decoder layers (text_config mtp_num_hidden_layers): QSA layers, all of them."""
    offload_params: tuple[str, ...] = ()
    """The `--cpu-offload-params` segments (drafter_offload_params)."""
    offloaded_params: dict[str, int] = field(default_factory=dict)
    """Bytes per vLLM parameter the segments move to host memory, by its full name
    (the experts fused as vLLM holds them: gate+up into w13, down into w2)."""

    @property
    def resident_bytes(self) -> int:
        """What stays in VRAM: the layer without its routed experts, fc/norms/mixer."""
        return self.layer_bytes - self.routed_expert_bytes + self.other_bytes

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.offloaded_params.values())

    @property
    def pinned_weight_bytes(self) -> int:
        """The offloaded parameters as PyTorch's pinned allocator holds them (each
        rounded up to a power of two)."""
        return sum(pow2_ceil(n) for n in self.offloaded_params.values())

    def module_bytes(self) -> dict[str, int]:
        """Offloaded bytes per module the segments name."""
        return {
            seg: sum(n for p, n in self.offloaded_params.items() if offload_selects((seg,), p))
            for seg in self.offload_params
        }


@dataclass(frozen=True)
class MtpLoad:
    """The drafter's pass through VRAM while it loads (the module doc says why)."""

    transient_bytes: int
    """Resident bytes plus the largest offloaded module, on the GPU at once."""
    budget_room_bytes: int
    """The rank's budget (vram_usable) minus the target's weights: no KV yet."""
    measured_room_bytes: int | None
    """The rank's measured start peak minus the target's weights: what its start was
    seen to hold beyond them on the profile's card (context, the target's repack
    transient); a drafter load within it stays within the measured peak. None: not
    measured for this card and partition."""

    @property
    def room_bytes(self) -> int:
        rooms = [self.budget_room_bytes]
        if self.measured_room_bytes is not None:
            rooms.append(self.measured_room_bytes)
        return min(rooms)

    @property
    def binds(self) -> str:
        measured = self.measured_room_bytes
        if measured is not None and measured < self.budget_room_bytes:
            return "measured start peak"
        return "plan budget"

    @property
    def fits(self) -> bool:
        return self.transient_bytes <= self.room_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "transient_bytes": self.transient_bytes,
            "room_bytes": self.room_bytes,
            "budget_room_bytes": self.budget_room_bytes,
            "measured_room_bytes": self.measured_room_bytes,
            "binds": self.binds,
            "fits": self.fits,
        }


@dataclass(frozen=True)
class MtpFit:
    fits: bool
    rank: int
    placed_bytes: dict[str, dict[str, int]]
    """What the drafter puts on `rank`, by place ("vram", "host") and part. vram.kv is
    its layer's share of the KV pool, inside --kv-cache-memory-bytes; host.kv its
    K/V arena (counted with the QSA pools)."""
    reason: str
    pinned_bytes: int = 0
    """Host memory pinned for it: pinned_weight_bytes plus its K/V arena as the QSA
    pools pin it."""
    pinned_weight_bytes: int = 0
    """Its offloaded weights as PyTorch's pinned allocator holds them (each parameter
    rounded up to a power of two)."""
    load: MtpLoad | None = None
    requests: RequestCapacity | None = None
    """Requests the pool holds with the drafter in it, as vLLM counts its blocks (None:
    QSA offload off)."""
    requests_without: RequestCapacity | None = None
    """The same without MTP."""
    kv_cache_bytes: int = 0
    """--kv-cache-memory-bytes with the drafter's weights on its rank (the plan's own
    when it fits)."""
    offload_params: tuple[str, ...] = ()
    cpu_offload_gb: str = ""
    """`--cpu-offload-gb`: the offloaded bytes in GiB, rounded up to 0.01."""
    experts_bf16: bool = False
    projection: MtpProjection | None = None
    """What it would gain in single-stream decode, on paper (None: no MTP tensors)."""

    def to_json(self) -> dict[str, Any]:
        doc = {
            "fits": self.fits,
            "rank": self.rank,
            "placed_bytes": {k: dict(v) for k, v in self.placed_bytes.items()},
            "vram_bytes": sum(self.placed_bytes.get("vram", {}).values()),
            "host_bytes": sum(self.placed_bytes.get("host", {}).values()),
            "pinned_bytes": self.pinned_bytes,
            "pinned_weight_bytes": self.pinned_weight_bytes,
            "load": None if self.load is None else self.load.to_json(),
            "kv_tokens": self.kv_tokens,
            "kv_tokens_without_mtp": _kv_tokens(self.requests_without),
            "full_length_requests": _full_length(self.requests),
            "full_length_requests_without_mtp": _full_length(self.requests_without),
            "longest_request_tokens": (
                None if self.requests is None else self.requests.longest_request_tokens
            ),
            # The pool as vLLM counts it: what one request at max_model_len takes, of
            # what it hands out (a K whose state alone outgrows it fits at no length).
            "blocks_per_request": (
                None if self.requests is None else self.requests.blocks_per_request
            ),
            "pool_blocks": None if self.requests is None else self.requests.usable_blocks,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "cpu_offload_gb": self.cpu_offload_gb,
            "cpu_offload_params": list(self.offload_params),
            "experts_bf16": self.experts_bf16,
            "reason": self.reason,
        }
        if self.projection is not None:
            doc["projection"] = self.projection.to_json()
        return doc

    @property
    def kv_tokens(self) -> int | None:
        """vLLM's "KV cache size" with the drafter (None: QSA offload off)."""
        return _kv_tokens(self.requests)


def _kv_tokens(cap: RequestCapacity | None) -> int | None:
    return None if cap is None else cap.kv_cache_tokens


def _full_length(cap: RequestCapacity | None) -> int | None:
    return None if cap is None else cap.full_length_requests


def int4_bytes(bf16_bytes: int) -> int:
    """Bytes of BF16 weights requantized to INT4 with one BF16 scale per GROUP."""
    weights = bf16_bytes // BF16_BYTES
    return weights // 2 + weights // GROUP * BF16_BYTES


def _vllm_param(name: str) -> str:
    """A drafter expert tensor's vLLM parameter: `...mlp.experts.E.gate_proj.S` is
    `...mlp.experts.w13_S` (gate and up fused), down_proj's `w2_S`."""
    layer, _, rest = name.partition(".mlp.")
    m = _EXPERT.match(f"mlp.{rest}")
    if m is None:
        return name
    fused = "w2" if m[1] == "down" else "w13"
    return f"{layer}.mlp.experts.{fused}_{m[2]}"


def mtp_needs(bytes_by_class: dict[str, int], text_config: dict[str, Any]) -> MtpNeeds | None:
    """From the checkpoint's tensor bytes (by class) and its text_config; None
    when the checkpoint has no MTP tensors."""
    layer = routed = other = 0
    bf16 = False
    for name, nbytes in bytes_by_class.items():
        if not name.startswith(MTP_PREFIX):
            continue
        if name.startswith(f"{MTP_PREFIX}layers."):
            layer += nbytes
            if ROUTED in name:
                routed += nbytes
                bf16 = bf16 or name.endswith(".weight")
        else:
            other += nbytes
    if layer + other == 0:
        return None
    num_hidden = config_int(text_config, "num_hidden_layers")
    num_mtp = config_int(text_config, "mtp_num_hidden_layers", 1)
    segments = drafter_offload_params(num_hidden, num_mtp)
    # The drafter's embedding is the target's tensors as stored (patch 0033); BF16
    # vocab x hidden when the checkpoint has none under the usual name.
    offloaded = {
        EMBED_PREFIX + name.removeprefix(TARGET_EMBED): nbytes
        for name, nbytes in bytes_by_class.items()
        if name.startswith(TARGET_EMBED)
    } or {
        f"{EMBED_PREFIX}weight": config_int(text_config, "vocab_size")
        * config_int(text_config, "hidden_size")
        * BF16_BYTES
    }
    embed = sum(offloaded.values())
    for name, nbytes in bytes_by_class.items():
        full = offloader_name(name, num_hidden)
        if full is not None and offload_selects(segments, full):
            param = _vllm_param(full)
            offloaded[param] = offloaded.get(param, 0) + nbytes
    return MtpNeeds(
        layer_bytes=layer,
        routed_expert_bytes=routed,
        experts_bf16=bf16,
        other_bytes=other,
        embed_bytes=embed,
        num_layers=num_mtp,
        offload_params=segments,
        offloaded_params=dict(sorted(offloaded.items())),
    )


def drafter_bytes_per_step(needs: MtpNeeds, *, head_bytes: int) -> int:
    """VRAM bytes one drafter step reads: its layer's dense part, fc/norms/mixer and the
    shared LM head. Its routed experts are read from host memory
    (drafter_host_bytes_per_step); its embedding row is left out, as the roofline
    leaves the target's."""
    return needs.resident_bytes + head_bytes


def drafter_host_bytes_per_step(
    needs: MtpNeeds, *, experts_per_token: int, num_experts: int
) -> int:
    """Host bytes one drafter step reads over the host link: one token's routed
    experts, INT4 (as `checkpoint mtp-int4` leaves them when stored BF16)."""
    routed = (
        int4_bytes(needs.routed_expert_bytes) if needs.experts_bf16 else needs.routed_expert_bytes
    )
    return routed * experts_per_token // max(num_experts, 1)


def lm_head_bytes(bytes_by_class: dict[str, int]) -> int:
    """The target's LM head as stored (all its tensors: packed weight, scales)."""
    return sum(n for name, n in bytes_by_class.items() if name.startswith(LM_HEAD_PREFIX))


def load_check(
    needs: MtpNeeds, *, budget_room_bytes: int, measured_room_bytes: int | None
) -> MtpLoad:
    largest = max(needs.module_bytes().values(), default=0)
    return MtpLoad(needs.resident_bytes + largest, budget_room_bytes, measured_room_bytes)


def no_drafter(rank: int, reason: str) -> MtpFit:
    """The fit of a checkpoint without MTP tensors."""
    return MtpFit(False, rank, {}, reason)


def fit_mtp(
    needs: MtpNeeds,
    *,
    rank: int,
    load: MtpLoad,
    kv_cache_bytes: int,
    pools: HostPools | None,
    requests: RequestCapacity | None,
    requests_without: RequestCapacity | None,
    vram_kv_bytes_per_token: int,
) -> MtpFit:
    """The drafter on `rank`: `load` its pass through VRAM while loading; `pools` the
    QSA pools sized with it in (its layer among the last rank's), `kv_cache_bytes` the
    per-rank KV budget sized with its resident bytes on that rank, `requests` what that
    pool holds as vLLM counts it (vLLM refuses to start without one full-length request)."""
    tokens = pools.tokens if pools is not None else None
    arena = needs.num_layers * pools.per_layer_exact_bytes if pools else 0
    placed = {
        "vram": {
            "layer": needs.layer_bytes - needs.routed_expert_bytes,
            "fc_norms_mixer": needs.other_bytes,
            "kv": needs.num_layers * (tokens or 0) * vram_kv_bytes_per_token,
        },
        "host": {
            "routed_experts": needs.offloaded_bytes - needs.embed_bytes,
            "embed_tokens": needs.embed_bytes,
            "kv": arena,
        },
    }
    pinned = needs.pinned_weight_bytes + (
        needs.num_layers * pools.per_layer_pinned_bytes if pools else 0
    )
    serving = kv_cache_bytes > 0 and (requests is None or requests.starts)
    fits = load.fits and serving
    how = "BF16" if needs.experts_bf16 else "INT4"
    if not load.fits:
        reason = (
            f"loading the drafter puts {gib(load.transient_bytes)} on rank {rank}'s GPU at "
            f"once (its layer with its {how} routed experts "
            f"{gib(needs.routed_expert_bytes)}, before vLLM moves them to host memory), "
            f"more than the {gib(load.room_bytes)} the rank has after the target's weights "
            f"({load.binds})"
        )
        if needs.experts_bf16:
            int4 = needs.resident_bytes + max(int4_bytes(needs.routed_expert_bytes),
                                              needs.embed_bytes)  # fmt: skip
            would = "fit" if int4 <= load.room_bytes else "still not fit"
            reason += (
                f"; `{INT4_FIX}` rewrites the experts INT4 "
                f"({gib(int4_bytes(needs.routed_expert_bytes))}): {gib(int4)} would {would}"
            )
    elif not serving:
        reason = (
            f"with the drafter's {gib(needs.resident_bytes)} of weights in rank {rank}'s VRAM "
            f"and its QSA layer in the KV pool, "
            + ("there is no VRAM left for the KV cache" if requests is None
               else f"{_blocks(requests)}: vLLM refuses to start{_longest(requests)}")
        )  # fmt: skip
    else:
        held = (
            f"{_requests(requests)} ({_requests(requests_without)} without MTP)"
            if requests is not None
            else "QSA offload off"
        )
        reason = (
            f"fits on rank {rank}: {gib(needs.resident_bytes)} of weights in VRAM (its layer "
            f"without the routed experts, fc/norms/mixer) and its QSA layer in the KV pool; "
            f"{how} experts and its embedding ({gib(needs.offloaded_bytes)}) in pinned host "
            f"memory, {gib(pinned)} pinned with its K/V arena; loading puts "
            f"{gib(load.transient_bytes)} on the GPU at once, {gib(load.room_bytes)} free "
            f"then ({load.binds} binds); {held}"
        )
    return MtpFit(
        fits=fits,
        rank=rank,
        placed_bytes=placed,
        reason=reason,
        pinned_bytes=pinned,
        pinned_weight_bytes=needs.pinned_weight_bytes,
        load=load,
        requests=requests,
        requests_without=requests_without,
        kv_cache_bytes=kv_cache_bytes,
        offload_params=needs.offload_params,
        cpu_offload_gb=cpu_offload_gib(needs.offloaded_bytes),
        experts_bf16=needs.experts_bf16,
    )


def _blocks(cap: RequestCapacity) -> str:
    """What one request at max_model_len takes from the pool, and what the pool has."""
    g = cap.groups
    return (
        f"a request of {cap.max_model_len} tokens takes {cap.blocks_per_request} blocks of the "
        f"pool's {cap.usable_blocks} ({cap.kv_blocks_per_request} of K/V, "
        f"{cap.state_blocks_per_request} of state for {g.gdn} GDN, {g.ple} PLE and {g.ring} "
        "ring groups)"
    )


def _longest(cap: RequestCapacity) -> str:
    longest = cap.longest_request_tokens
    return f"; it starts at --max-model-len {longest} at most" if longest else ""


def _requests(cap: RequestCapacity | None) -> str:
    if cap is None:
        return "no KV"
    n = cap.full_length_requests
    return (
        f"{n} request{'' if n == 1 else 's'} of {cap.max_model_len} tokens at once (vLLM: "
        f"{cap.max_concurrency:.2f}x, {cap.kv_cache_tokens} tokens)"
    )
