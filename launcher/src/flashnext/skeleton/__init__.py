"""Checkpoint skeletons of Qwen3.8-Flash-Next INT4-mixed: real headers, (mostly) no data.

`write_skeleton(dir, "full")` writes the true tensor inventory (~160 GB apparent,
only headers on disk) so planning and preflight run on the real shapes;
`write_skeleton(dir, "tiny")` writes a 4-layer toy of the same architecture with
real bytes, which vLLM 0.33.0's config path accepts (for patch proofs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from flashnext.facts.schema import ModelFacts, TensorInfo
from flashnext.skeleton.configs import (
    QSA_OFF,
    full_config,
    full_text_config,
    generation_config,
    quantization_config,
    tiny_config,
    tiny_text_config,
)
from flashnext.skeleton.inventory import Entry, Inventory, build_inventory
from flashnext.skeleton.writer import SkeletonError, write_checkpoint_dir

__all__ = [
    "QSA_OFF",
    "reference_model_facts",
    "repaired_quantization_config",
    "Entry",
    "Inventory",
    "SkeletonError",
    "SkeletonSummary",
    "build_inventory",
    "full_text_config",
    "skeleton_config",
    "tiny_config",
    "tiny_text_config",
    "write_skeleton",
]

Variant = Literal["full", "tiny"]

# Shard size limits: 5 GB as the published exports use; the tiny variant is
# split at 1 MiB so that it, too, exercises a multi-file index.
MAX_SHARD_BYTES: dict[str, int] = {"full": 5_000_000_000, "tiny": 1 << 20}


@dataclass(frozen=True)
class SkeletonSummary:
    path: str
    variant: str
    fixed_metadata: bool
    files: int
    tensors: int
    data_bytes: int
    """Sum of all tensors' bytes (the index's total_size)."""
    header_bytes: int
    """Sum of the shards' headers, length prefixes included: the full variant's disk cost."""


def skeleton_config(
    variant: Variant, *, fixed_metadata: bool = False, quantized: bool = True, **text_overrides: Any
) -> dict[str, Any]:
    """config.json of a variant, with its quantization_config unless `quantized=False`."""
    if variant == "full":
        if text_overrides:
            raise SkeletonError("text_config overrides are for the tiny variant only")
        config = full_config()
    elif variant == "tiny":
        config = tiny_config(**text_overrides)
    else:
        raise SkeletonError(f"unknown skeleton variant {variant!r}; use 'full' or 'tiny'")
    if quantized:
        inventory = build_inventory(config)
        config["quantization_config"] = quantization_config(inventory.ignore)
        if fixed_metadata:
            config["quantization_config"] = repaired_quantization_config(config, inventory)
    return config


def _inventory_facts(
    config: dict[str, Any],
    inventory: Inventory,
    path: str,
    generation: dict[str, Any] | None = None,
) -> ModelFacts:
    """A checkpoint of `config` holding `inventory`, as facts (no files, no offsets)."""
    from flashnext.facts.safetensors import tensor_nbytes

    tensors = tuple(
        TensorInfo(e.name, e.dtype, e.shape, tensor_nbytes(e.dtype, e.shape), "")
        for e in inventory.entries
    )
    return ModelFacts(
        path=path,
        config=config,
        quantization_config=config.get("quantization_config"),
        generation_config=generation,
        index_files=(),
        shards=(),
        tensors=tensors,
    )


def repaired_quantization_config(
    config: dict[str, Any], inventory: Inventory | None = None
) -> dict[str, Any]:
    """The quantization_config `checkpoint fix` writes for a checkpoint of `config`.

    Computed by fix's own code (`flashnext.checkpoint.fix.fixed_quantization_config`), on
    `config`'s quantization_config (as exported) and the tensors of `inventory` (default:
    `config`'s), so `--fixed-metadata` is exactly what `checkpoint fix` leaves.
    """
    from flashnext.checkpoint.fix import fixed_quantization_config

    inventory = inventory or build_inventory(config)
    facts = _inventory_facts(config, inventory, "<the skeleton's inventory>")
    known = {e.name: e.values for e in inventory.entries if e.values is not None}
    qcfg, _notes = fixed_quantization_config(facts, known)
    return qcfg


def write_skeleton(
    out_dir: str | Path,
    variant: Variant = "full",
    *,
    fixed_metadata: bool = False,
    quantized: bool = True,
    max_shard_bytes: int | None = None,
    **text_overrides: Any,
) -> SkeletonSummary:
    """Write a checkpoint skeleton to `out_dir` (which must not exist, or be empty).

    `fixed_metadata=False` reproduces both export defects of the shipped
    checkpoint (config_groups all targeting "Linear", generation_config without
    sampling keys); True writes them as `checkpoint fix` leaves them (its
    quantization_config computed by fix's code: `repaired_quantization_config`).
    `quantized=False` writes BF16 weights and no quantization_config.
    `text_overrides` (tiny only) replace keys of `tiny_text_config()`; a key set
    to None is removed (e.g. `indexer_n_heads=None` turns QSA off, as on CPU
    where it cannot run).
    """
    config = skeleton_config(
        variant, fixed_metadata=fixed_metadata, quantized=quantized, **text_overrides
    )
    inventory = build_inventory(config, quantized=quantized)
    plans = write_checkpoint_dir(
        Path(out_dir),
        config=config,
        generation_config=generation_config(config["text_config"], fixed_metadata=fixed_metadata),
        entries=inventory.entries,
        max_shard_bytes=max_shard_bytes or MAX_SHARD_BYTES[variant],
        real_data=variant == "tiny",
    )
    return SkeletonSummary(
        path=str(out_dir),
        variant=variant,
        fixed_metadata=fixed_metadata,
        files=len(plans),
        tensors=sum(len(p.entries) for p in plans),
        data_bytes=sum(p.data_bytes for p in plans),
        header_bytes=sum(len(p.header) for p in plans),
    )


@functools.lru_cache(maxsize=2)
def reference_model_facts(variant: Variant) -> ModelFacts:
    """The variant's checkpoint as facts, without files: its config and the exact tensor
    inventory (what `read_model_facts` reads from a skeleton written without
    --fixed-metadata, shards aside). Preflight sizes host memory from it when no
    checkpoint could be read. The metadata is as exported: planning reads neither
    the targets nor the sampling keys, and deriving the fixed targets costs seconds."""
    config = skeleton_config(variant)
    return _inventory_facts(
        config,
        build_inventory(config),
        f"<the {variant} skeleton's inventory>",
        generation_config(config["text_config"], fixed_metadata=False),
    )
