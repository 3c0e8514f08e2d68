"""Each PP rank's start peak: the most device memory its vLLM process holds while starting.

The plan's committed bytes are what a rank holds while serving; the start has its
own peak, in loading (issue 27, item 5). What vLLM 0.33.0 with our series does,
in order (v1/worker/gpu_worker.py, model_loader/base_loader.py):

1. init_device (gpu_worker.py:474): the CUDA context, then the distributed
   groups (:529, NCCL's PP communicators) and the runner's workspaces (:577);
2. load_model: every module is built at full size (weights as the checkpoint
   stores them) and filled, then process_weights_after_loading
   (base_loader.py:109) rebuilds each quantized module for its kernel. For the
   routed experts on sm86 that is Marlin's repack; with patch 0040
   (fused_moe/oracle/int_wna16.py `_marlin_moe_repack_and_release`) each packed
   weight gets a new output (:621 `torch.empty`), filled expert by expert (:627,
   one expert's K-first copy and its repacked slice alive at a time), and the
   original is freed when the output is done (:630 `w.data = out`); w2 after
   w13. So the live extra is the larger packed weight of one layer plus one
   expert's two slices (proved on CPU: checks/patches/test_marlin_moe_repack_memory.py);
3. after loading: the profile run (activations), the KV cache, CUDA graphs.
   By then the repack's transient is gone, and vLLM holds the whole process,
   context included, to gpu_memory_utilization x total: the plan's
   committed bytes are that budget (planner.RankPlan.committed_bytes).

The peak is the larger of the phases ("load", "serving", and "mtp_load" when the
MTP drafter is placed: plan/mtp.py's pass of its layer through VRAM, after the
target's weights). Each term says why it is there.

What this does not hold: the caching allocator keeps freed blocks while the
card has room, and gives them back (and retries) when an allocation fails.
So an NVML peak grows with the room a run is given (checks/gpu/RESULTS.md, r7:
ranks 1 and 2 build the same slice and allocate alike until the repack, yet
rank 1, given 0.55 GiB more room, peaked 0.68 GiB higher). The prediction is
what must be on the card at once, not what an unhindered allocator would
keep; checks/launcher/test_start_peak.py compares it with r7.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from flashnext.plan.placement import place_tensor

# A routed expert's packed INT4 weight, by tensor class (expert number folded to "*").
_PACKED = re.compile(r"\.mlp\.experts\.\*\.(gate|up|down)_proj\.weight_packed$")


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    why: str


@dataclass(frozen=True)
class StartPeak:
    predicted_bytes: int
    phase: str
    """The phase whose sum is the peak: "load", "serving" or "mtp_load"."""
    terms: tuple[Term, ...]
    """The binding phase's terms; they sum to predicted_bytes."""
    phases: dict[str, int]
    """Every phase's sum."""

    def to_json(self) -> dict[str, Any]:
        return {
            "predicted_bytes": self.predicted_bytes,
            "phase": self.phase,
            "terms": [{"name": t.name, "bytes": t.bytes, "why": t.why} for t in self.terms],
            "phases": dict(self.phases),
        }


@dataclass(frozen=True)
class RepackLayer:
    layer: int
    w13_bytes: int
    """gate_proj + up_proj packed weights of all routed experts (vLLM's fused w13)."""
    w2_bytes: int
    """down_proj packed weights of all routed experts."""
    num_experts: int

    @property
    def transient_bytes(self) -> int:
        """Live bytes beyond the layer's weights while 0040 repacks it: the output of
        the larger packed weight (its original not yet freed), plus one expert's
        K-first copy and its repacked slice (int_wna16.py:627)."""
        larger = max(self.w13_bytes, self.w2_bytes)
        return larger + 2 * (larger // max(self.num_experts, 1))


def repack_layers(
    bytes_by_class: dict[str, int], ple_table: frozenset[str], num_experts: int
) -> list[RepackLayer]:
    """The MoE layers whose routed experts are stored packed (INT4: Marlin repacks
    them on sm86), from the checkpoint's tensor bytes by class."""
    w13: dict[int, int] = {}
    w2: dict[int, int] = {}
    for name, nbytes in bytes_by_class.items():
        m = _PACKED.search(name)
        if m is None:
            continue
        spot = place_tensor(name, ple_table)
        if spot.where != "layer":  # the MTP layer is not the target's (plan/mtp.py)
            continue
        into = w2 if m[1] == "down" else w13
        into[spot.layer] = into.get(spot.layer, 0) + nbytes
    return [
        RepackLayer(layer, w13.get(layer, 0), w2.get(layer, 0), num_experts)
        for layer in sorted(set(w13) | set(w2))
    ]


def largest_repack(layers: list[RepackLayer], start: int, end: int) -> RepackLayer | None:
    """The layer in [start, end) with the largest repack transient (None: no MoE layer
    with packed experts there)."""
    mine = [lay for lay in layers if start <= lay.layer < end]
    return max(mine, key=lambda lay: lay.transient_bytes, default=None)


def predict(
    *,
    weight_bytes: int,
    workspace_bytes: int,
    pp_buffer_bytes: int,
    committed_bytes: int,
    context_bytes: int | None,
    context_source: str,
    repack: RepackLayer | None,
    mtp_transient_bytes: int | None = None,
) -> StartPeak:
    """One rank's start peak from the plan's own figures (planner.RankPlan)."""
    context = Term(
        "cuda_context",
        context_bytes or 0,
        f"CUDA context and driver memory outside torch's allocator, there from "
        f"init_device on: {context_source}",
    )
    resident = [
        Term(
            "weights",
            weight_bytes,
            "every module is built at full size before any is repacked "
            "(the plan's weight bytes, from the safetensors headers)",
        ),
        Term(
            "workspace",
            workspace_bytes,
            "workspaces allocated before loading (gpu_worker.py:577) and the plan's "
            "margin for them (profile workspace_margin_bytes)",
        ),
        Term(
            "pp_buffers",
            pp_buffer_bytes,
            "NCCL's PP buffers: the communicators exist from init_device "
            "(gpu_worker.py:529), before loading (profile pp_buffer_bytes)",
        ),
        context,
    ]
    repack_term = Term(
        "marlin_repack",
        repack.transient_bytes if repack else 0,
        (
            f"patch 0040's Marlin repack of layer {repack.layer}, the rank's largest: its "
            f"larger packed weight ({max(repack.w13_bytes, repack.w2_bytes)} B) rebuilt "
            f"while the original lives, plus one expert's two slices "
            f"(int_wna16.py:621-630)"
        )
        if repack
        else "no MoE layer with packed (INT4) routed experts on this rank",
    )
    phases: dict[str, tuple[Term, ...]] = {
        "load": (*resident, repack_term),
        "serving": (
            Term(
                "committed",
                committed_bytes,
                "after loading vLLM holds the process, context included, to "
                "gpu_memory_utilization x total: the plan's committed bytes (weights, "
                "workspace, PP buffers, activation reserve, KV)",
            ),
        ),
    }
    if mtp_transient_bytes is not None:
        phases["mtp_load"] = (
            *resident,
            Term(
                "mtp_load",
                mtp_transient_bytes,
                "the MTP drafter's resident part and its largest offloaded module pass "
                "through VRAM after the target's weights, before the KV cache "
                "(plan/mtp.py load_check)",
            ),
        )
    sums = {name: sum(t.bytes for t in terms) for name, terms in phases.items()}
    binding = max(sums, key=lambda name: sums[name])
    return StartPeak(sums[binding], binding, phases[binding], sums)
