"""What each Linear's tensors store, and what a config group declares it stores.

A pack-quantized Linear stores `weight_packed` I32 [out, ceil(in x bits / 32)],
`weight_scale` [out, in / group] and `weight_shape` I64 [2] = (out, in). From
those (headers plus the 16 bytes of weight_shape) each module's stored scheme is
exact: the ground truth `checkpoint check` and `checkpoint fix` hold the
quantization_config to.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashnext.facts.schema import ModelFacts, TensorInfo

PLE_SHARD_MARK = ".ngram_embedding.shard_"
PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point")


class StoredSchemeError(Exception):
    """A module's packed, scale and shape tensors contradict each other (the message says how)."""


# ---------------------------------------------------------------- schemes


@dataclass(frozen=True)
class Scheme:
    """Weight quantization of one Linear, as stored or as a config group declares it."""

    num_bits: int
    group_size: int | None
    """None: one scale per output channel (strategy "channel")."""
    symmetric: bool = True

    def label(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        return f"INT{self.num_bits} {group}" + ("" if self.symmetric else " asym")


def scheme_of_group(group: Mapping[str, Any]) -> Scheme | None:
    """The Scheme a config group declares (None for anything but int weight-only)."""
    w = group.get("weights") or {}
    if w.get("type", "int") != "int" or w.get("num_bits") is None:
        return None
    size = w.get("group_size")
    group_size = int(size) if w.get("strategy") == "group" and size and size > 0 else None
    return Scheme(int(w["num_bits"]), group_size, bool(w.get("symmetric", True)))


def derive_scheme(
    packed: tuple[int, ...], scale: tuple[int, ...], in_features: int | None, symmetric: bool
) -> Scheme:
    """Bits and group size from packed/scale widths and the stored in_features.

    Raises StoredSchemeError when the shapes contradict each other.
    """
    if len(packed) != 2 or len(scale) != 2 or packed[0] != scale[0]:
        raise StoredSchemeError(f"packed {list(packed)} and scale {list(scale)} do not pair up")
    if not in_features:
        raise StoredSchemeError("weight_shape is missing or zero, so in_features is unknown")
    bits = [b for b in range(2, 9) if -(-in_features * b // 32) == packed[1]]
    if len(bits) != 1:
        raise StoredSchemeError(
            f"packed width {packed[1]} fits no single bit width for in_features {in_features}"
        )
    if in_features % scale[1]:
        raise StoredSchemeError(f"{scale[1]} scale columns do not divide in_features {in_features}")
    # One scale column is also what a per-channel scheme stores; `declares` accepts both.
    return Scheme(bits[0], in_features // scale[1], symmetric)


def group_schemes(qcfg: Mapping[str, Any]) -> dict[str, Scheme | None]:
    """The Scheme each config group declares, by group name."""
    return {g: scheme_of_group(v) for g, v in (qcfg.get("config_groups") or {}).items()}


# ---------------------------------------------------------------- stored modules


@dataclass(frozen=True)
class StoredModule:
    name: str
    """Checkpoint module name (tensor name without .weight / .weight_packed ...)."""
    scheme: Scheme | None
    """What the tensors hold; None = unquantized (a plain 2-D weight)."""
    in_features: int | None = None


def declares(declared: Scheme | None, module: StoredModule) -> bool:
    """Whether a group's declared scheme is what `module` stores."""
    if declared is None or module.scheme is None:
        return declared is None and module.scheme is None
    if declared.group_size is None:  # per-channel: one scale per row
        return (declared.num_bits, declared.symmetric) == (
            module.scheme.num_bits,
            module.scheme.symmetric,
        ) and module.scheme.group_size == module.in_features
    return declared == module.scheme


def _read_i64_pair(
    model_dir: Path, tensor: TensorInfo, handles: dict[Path, Any]
) -> tuple[int, int] | None:
    """The two int64s a 16-byte tensor stores, at the offset its header gave (TensorInfo);
    None for another size, or for an inventory not read from files."""
    if tensor.nbytes != 16 or tensor.offset_bytes < 0:
        return None
    path, offset = model_dir / tensor.file, tensor.offset_bytes
    fh = handles.get(path)
    if fh is None:
        fh = handles[path] = open(path, "rb")  # noqa: SIM115 (closed by the caller)
    fh.seek(offset)
    data = fh.read(16)
    return struct.unpack("<qq", data) if len(data) == 16 else None


def stored_modules(
    model: ModelFacts, known_values: Mapping[str, Sequence[int]] | None = None
) -> tuple[list[StoredModule], list[str]]:
    """Every Linear-like module with its stored scheme, and the problems found on the way.

    `known_values` (tensor name -> values) gives weight_shape values without reading
    files: an inventory not read from disk (the skeleton's) has no offsets to read them at.
    """
    known = known_values or {}
    tensors = {t.name: t for t in model.tensors}
    problems: list[str] = []
    modules: list[StoredModule] = []
    packed_modules = sorted(
        n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed")
    )
    handles: dict[Path, Any] = {}
    try:
        for name in packed_modules:
            packed = tensors[f"{name}.weight_packed"]
            scale = tensors.get(f"{name}.weight_scale")
            shape_t = tensors.get(f"{name}.weight_shape")
            values = known.get(shape_t.name) if shape_t else None
            if values is not None:
                pair = (values[0], values[1]) if len(values) == 2 else None
            else:
                pair = _read_i64_pair(Path(model.path), shape_t, handles) if shape_t else None
            if scale is None:
                problems.append(f"{name}: weight_packed without weight_scale")
                continue
            in_features = pair[1] if pair and pair[0] == packed.shape[0] else None
            try:
                scheme = derive_scheme(
                    packed.shape,
                    scale.shape,
                    in_features,
                    symmetric=f"{name}.weight_zero_point" not in tensors,
                )
            except StoredSchemeError as exc:
                problems.append(f"{name}: {exc}")
                continue
            modules.append(StoredModule(name, scheme, in_features))
    finally:
        for fh in handles.values():
            fh.close()
    for t in model.tensors:
        if t.name.endswith(".weight") and len(t.shape) == 2:
            modules.append(StoredModule(t.name[: -len(".weight")], None))
    return modules, problems


def ple_table_modules(model: ModelFacts) -> list[str]:
    """Module names of the PLE n-gram tables (the part before `.shard_<i>.weight`)."""
    names = {t.name.split(PLE_SHARD_MARK)[0] + ".ngram_embedding" for t in model.tensors
             if PLE_SHARD_MARK in t.name}  # fmt: skip
    return sorted(names)
