"""What one decoded token reads of the checkpoint's tensors, term by term.

Pure over the safetensors headers (bytes per tensor class) and config.json.
Every tensor lands in exactly one term, so the terms add up to the checkpoint;
the roofline (planner.DecodeRoofline) counts the terms marked `counted`: the
weights a single-stream decode step streams from VRAM. The others say why they
are left out and what a token reads of them all the same.

Issue 40 item 3: the field report's "5.83 GB/token (dense 4.62 + experts 1.22)"
is this count plus the vision tower (0.90 GB), which `--language-model-only`
never loads and text decode never runs (checks/gpu/perf/bytes_per_token.py
holds the reconciliation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from flashnext.facts.model_derived import config_int, ple_ngram_heads, ple_table_shape
from flashnext.plan.placement import place_tensor

_NUMBER = re.compile(r"\.\d+(?=\.)")
_SHARD = re.compile(r"shard_\d+")

# name: (counted in the roofline, where the tensors are, why)
TERMS: dict[str, tuple[bool, str, str]] = {
    "layer_dense": (True, "VRAM, layer's rank", "attention, GDN, router, shared expert, "
                    "hyper-connections, norms: read whole"),
    "head": (True, "VRAM, last rank", "lm_head, final norm and mixer: read whole"),
    "routed_experts": (True, "VRAM, layer's rank", "top-k of each MoE layer's experts"),
    "embedding": (False, "VRAM, first rank", "one row a token: below the rounding"),
    "ple_table": (False, "host (mmap'd file)", "one row per n-gram head, gathered on the host"),
    "vision_tower": (False, "not loaded", "--language-model-only; text decode never runs it"),
    "mtp_layer": (False, "not loaded without MTP", "with MTP the MTP projection counts it"),
}  # fmt: skip


@dataclass(frozen=True)
class DecodeTerm:
    name: str
    counted: bool
    """In the roofline's bytes_per_token."""
    stored_bytes: int
    """The term's tensors in the checkpoint (safetensors headers)."""
    bytes_per_token: int
    """What a single-stream decode step reads of them, wherever they are."""
    where: str
    why: str
    tensors: tuple[str, ...]
    """The tensors, layer, block, expert and shard numbers folded to `*`."""


def fold(name: str) -> str:
    """A tensor class with its numbers folded (`layers.*.mlp.experts.*.down_proj...`)."""
    return _SHARD.sub("shard_*", _NUMBER.sub(".*", name))


def term_of(name: str, ple_table_names: frozenset[str]) -> str:
    spot = place_tensor(name, ple_table_names)
    if spot.where == "unused":
        return "vision_tower" if "visual" in name or "vision" in name else "mtp_layer"
    if spot.where == "disk":
        return "ple_table"
    if spot.routed_expert:
        return "routed_experts"
    if spot.embedding:
        return "embedding"
    return "head" if spot.where == "last" else "layer_dense"


def _per_token(name: str, stored: int, text: dict[str, Any]) -> int:
    if name in ("layer_dense", "head"):
        return stored
    if name == "routed_experts":
        experts = config_int(text, "num_experts", 0, minimum=0)
        top_k = config_int(text, "num_experts_per_tok", 0, minimum=0)
        return stored * top_k // experts if experts else 0
    if name == "embedding":
        vocab = config_int(text, "vocab_size", 0, minimum=0)
        return stored // vocab if vocab else 0
    if name == "ple_table" and stored:
        # A row's bytes from the headers (every PLE layer's table has this shape), one
        # row per n-gram head and PLE layer a token: stored x heads / rows.
        rows, _ = ple_table_shape(text)
        return stored * ple_ngram_heads(text) // rows
    return 0


def decode_terms(
    byte_classes: dict[str, int], text: dict[str, Any], ple_table_names: frozenset[str]
) -> tuple[DecodeTerm, ...]:
    """Every tensor class in one term (TERMS' order); terms with no tensors left out."""
    stored = dict.fromkeys(TERMS, 0)
    names: dict[str, set[str]] = {t: set() for t in TERMS}
    for name, nbytes in byte_classes.items():
        term = term_of(name, ple_table_names)
        stored[term] += nbytes
        names[term].add(fold(name))
    return tuple(
        DecodeTerm(
            t,
            counted,
            stored[t],
            _per_token(t, stored[t], text),
            where,
            why,
            tuple(sorted(names[t])),
        )  # fmt: skip
        for t, (counted, where, why) in TERMS.items()
        if names[t]
    )
