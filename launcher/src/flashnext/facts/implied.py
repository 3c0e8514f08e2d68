"""The tensors a checkpoint's config implies, checked by name against its index.

Numbered shard names (-00007-of-00039) let a missing shard be counted; other names do
not, and a shard deleted together with its index entries leaves an index that is
whole in itself. The config still says what must be there: every decoder layer,
each of its routed experts, the embedding, the head (unless tied),
every PLE table shard and, when configured, the MTP layer. A name check only: the
shapes are the headers' to judge.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from flashnext.facts.model_derived import TEXT_PREFIX, config_int, ple_shard_names

_LAYER = re.compile(re.escape(TEXT_PREFIX) + r"layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?")


def missing_tensors(config: dict[str, Any], names: Iterable[str]) -> list[str]:
    """What the config implies and `names` lacks, as short phrases (empty: all there).
    Raises ConfigValueError (from config_int) when the config itself is unusable."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    layers = config_int(text, "num_hidden_layers")
    experts = config_int(text, "num_experts", 0, minimum=0)
    present = set(names)
    seen_layers: set[int] = set()
    seen_experts: dict[int, set[int]] = defaultdict(set)
    for name in present:
        m = _LAYER.match(name)
        if m:
            seen_layers.add(int(m[1]))
            if m[2] is not None:
                seen_experts[int(m[1])].add(int(m[2]))
    missing = []
    gone = [i for i in range(layers) if i not in seen_layers]
    if gone:
        missing.append(f"decoder layer(s) {_ranges(gone)} of {layers}")
    for i in sorted(seen_layers & set(range(layers))):
        lost = [e for e in range(experts) if e not in seen_experts[i]] if experts else []
        if lost:
            missing.append(f"layer {i}'s routed expert(s) {_ranges(lost)} of {experts}")
            break  # one layer named is enough to act on
    for what, prefix in (("the token embedding", f"{TEXT_PREFIX}embed_tokens."),
                         ("the LM head", "lm_head.")):  # fmt: skip
        tied = what == "the LM head" and (config.get("tie_word_embeddings")
                                          or text.get("tie_word_embeddings"))  # fmt: skip
        if not tied and not any(n.startswith(prefix) for n in present):
            missing.append(what)
    shards = [n for n in ple_shard_names(text) if n not in present]
    if shards:
        missing.append(f"{len(shards)} PLE table shard(s) ({shards[0]}, ...)")
    mtp = text.get("mtp_num_hidden_layers")
    if type(mtp) is int and mtp > 0 and not any(n.startswith("mtp.") for n in present):
        missing.append("the MTP layer (mtp_num_hidden_layers is set)")
    return missing


def _ranges(values: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
