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

import re
from dataclasses import dataclass
from typing import Literal

Where = Literal["layer", "first", "last", "disk", "unused"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class Placement:
    where: Where
    layer: int | None = None
    routed_expert: bool = False
    """One of the num_experts routed experts (read top-k of them per token)."""
    embedding: bool = False
    """Read one row per token, not whole, during decode."""


def place_tensor(name: str, ple_table_names: frozenset[str]) -> Placement:
    """`ple_table_names`: the checkpoint names of the PLE table shards."""
    if name.startswith(("visual.", "model.visual.", "vision_tower.")) or ".visual." in name:
        return Placement("unused")
    if name.startswith(("mtp.", "model.mtp.")) or ".mtp." in name:
        return Placement("unused")
    if name in ple_table_names:
        return Placement("disk")
    match = _LAYER.search(name)
    if match:
        return Placement(
            "layer", layer=int(match.group(1)), routed_expert=bool(_ROUTED_EXPERT.search(name))
        )
    if "embed_tokens" in name:
        return Placement("first", embedding=True)
    # lm_head, the final norm and the hyper-connection head that folds the
    # residual streams before it run after the last layer.
    return Placement("last")
