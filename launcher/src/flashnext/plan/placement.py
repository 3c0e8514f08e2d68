"""Where each checkpoint tensor lives at serve time: which PP rank, or off the GPUs.

Pure over tensor names and the text config. The rules follow how vLLM 0.33.0
(with our patch series) builds Qwen4Exp under pipeline parallelism:
- `layers.N.*` lives on the rank that owns layer N;
- the token embedding only on the first rank, the LM head and final norm only
  on the last (our patch for SPEC row A makes them PPMissingLayer elsewhere);
- the PLE n-gram table (`layers.1.ple.*` shards) stays on disk (mmap backend);
- the vision tower is not loaded (`--language-model-only`); the MTP layer is
  not loaded unless speculative decoding is on (the profiles leave it off).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

Where = Literal["layer", "first", "last", "disk", "unused"]

_UNUSED_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "mtp.", "model.mtp.")


def _layer_index(name: str) -> int | None:
    """N of the first `layers.N.` component (string ops: this runs 225k times per plan)."""
    at = name.find("layers.")
    while at >= 0:
        if at == 0 or name[at - 1] == ".":
            end = name.find(".", at + 7)
            digits = name[at + 7 : end]
            if digits.isdigit():
                return int(digits)
        at = name.find("layers.", at + 1)
    return None


@dataclass(frozen=True)
class Placement:
    where: Where
    layer: int | None = None
    routed_expert: bool = False
    """One of the num_experts routed experts (read top-k of them per token)."""
    embedding: bool = False
    """Read one row per token, not whole, during decode."""


@functools.cache
def _in_layer(layer: int, routed_expert: bool) -> Placement:
    # A few hundred distinct values for 225k tensors: share the instances.
    return Placement("layer", layer=layer, routed_expert=routed_expert)


def place_tensor(name: str, ple_table_names: frozenset[str]) -> Placement:
    """`ple_table_names`: the checkpoint names of the PLE table shards."""
    if name.startswith(_UNUSED_PREFIXES) or ".visual." in name or ".mtp." in name:
        return Placement("unused")
    if name in ple_table_names:
        return Placement("disk")
    layer = _layer_index(name)
    if layer is not None:
        return _in_layer(layer, ".experts." in name)
    if "embed_tokens" in name:
        return Placement("first", embedding=True)
    # lm_head, the final norm and the hyper-connection head that folds the
    # residual streams before it run after the last layer.
    return Placement("last")
