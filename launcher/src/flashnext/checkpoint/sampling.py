"""The sampling keys `checkpoint fix` restores, only from a source the user names:
`--sampling KEY=VALUE` or `--generation-config-from DIR`, each value held to what
vLLM accepts."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashnext.checkpoint.errors import CheckpointError
from flashnext.facts.model import GENERATION_CONFIG_FILE
from flashnext.facts.model_derived import (
    VLLM_SAMPLING_KEYS,
    sampling_keys_present,
    sampling_keys_restoring_nothing,
)

# Keys restored into generation_config.json: what vLLM reads, plus do_sample which
# tells transformers to sample with them.
RESTORABLE_KEYS = (*VLLM_SAMPLING_KEYS, "do_sample")


# What vLLM 0.33.0 accepts for each key (vllm/sampling_params.py
# SamplingParams._verify_args; max_new_tokens becomes max_tokens, config/model.py):
# a default outside these ranges makes every request that relies on it fail.
_BOOLEAN_KEYS = ("skip_special_tokens", "do_sample")
_NUMBER_RANGES: dict[str, tuple[str, Any]] = {
    "temperature": ("in [0, 2]", lambda v: 0 <= v <= 2),
    "top_p": ("in (0, 1]", lambda v: 0 < v <= 1),
    "min_p": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "presence_penalty": ("in [-2, 2]", lambda v: -2 <= v <= 2),
    "frequency_penalty": ("in [-2, 2]", lambda v: -2 <= v <= 2),
    "repetition_penalty": ("greater than 0", lambda v: v > 0),
}


def sampling_value_error(key: str, value: Any) -> str | None:
    """Why vLLM would refuse `value` as the default for `key`, or None when it is fine."""
    if key in _BOOLEAN_KEYS:
        return None if isinstance(value, bool) else f"{key} must be true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{key} must be a number, got {json.dumps(value)}"
    if not math.isfinite(value):
        return f"{key} must be a finite number, got {value!r}"
    if key == "top_k":
        if not isinstance(value, int):
            return f"top_k must be an integer, got {value!r}"
        return None if value >= -1 else f"top_k must be -1 or 0 (off) or at least 1, got {value}"
    if key == "max_new_tokens":
        ok = isinstance(value, int) and value >= 1
        return None if ok else f"max_new_tokens must be an integer >= 1, got {value!r}"
    rule = _NUMBER_RANGES.get(key)
    if rule and not rule[1](value):
        return f"{key} must be {rule[0]}, got {value!r}"
    return None


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
