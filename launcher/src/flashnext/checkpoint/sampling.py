"""The sampling keys `checkpoint fix` restores, only from a source the user names:
`--sampling KEY=VALUE` or `--generation-config-from DIR`, each value held to what
vLLM accepts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashnext.checkpoint.errors import CheckpointError
from flashnext.facts.model import GENERATION_CONFIG_FILE
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
    sampling_value_error,
)

# Keys restored into generation_config.json: what vLLM reads, plus do_sample which
# tells transformers to sample with them.
RESTORABLE_KEYS = (*VLLM_SAMPLING_KEYS, "do_sample")


def parse_sampling(pairs: Sequence[str]) -> dict[str, Any]:
    """`--sampling key=value` pairs; keys must be ones vLLM reads, values numbers/booleans."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or key not in RESTORABLE_KEYS:
            raise CheckpointError(
                f"--sampling {pair!r}: expected KEY=VALUE, KEY one of {', '.join(RESTORABLE_KEYS)}"
            )
        try:
            value = json.loads(
                raw.strip().lower() if raw.strip().lower() in ("true", "false") else raw
            )
        except (ValueError, RecursionError):  # not JSON, nested deep, thousands of digits
            raise CheckpointError(
                f"--sampling {pair!r}: {raw!r} is not a number or true/false"
            ) from None
        if not isinstance(value, int | float | bool):
            raise CheckpointError(f"--sampling {pair!r}: {raw!r} is not a number or true/false")
        why = sampling_value_error(key, value)
        if why:
            raise CheckpointError(f"--sampling {pair!r}: {why} (vLLM refuses other values)")
        out[key] = value
    return out


def sampling_from_dir(source: Path) -> dict[str, Any]:
    path = source / GENERATION_CONFIG_FILE if source.is_dir() else source
    from flashnext.facts.jsonfile import JsonFileError, read_json_object

    try:
        doc = read_json_object(path, "generation config")
    except JsonFileError as exc:
        raise CheckpointError(
            f"--generation-config-from: {exc}; name the published model's directory (or its "
            "generation_config.json)"
        ) from None
    keys = {k: doc[k] for k in RESTORABLE_KEYS if k in doc}
    for key, value in keys.items():
        why = None if value is None else sampling_value_error(key, value)
        if why:
            raise CheckpointError(
                f"--generation-config-from: {path}: {why}; vLLM refuses it, nothing was changed"
            )
    if not sampling_keys_present(keys):
        neutral = sampling_keys_restoring_nothing(keys)
        has = (f"sets only {neutral}, which restore nothing" if neutral
               else f"has none of {', '.join(VLLM_SAMPLING_KEYS)} either")  # fmt: skip
        raise CheckpointError(
            f"--generation-config-from: {path} {has}; name the published model's "
            "generation_config.json"
        )
    return keys
