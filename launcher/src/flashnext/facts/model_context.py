"""The longest --max-model-len vLLM 0.33.0 accepts for a checkpoint, from config.json.

vLLM derives it at start (`config/model.py` `_get_and_verify_max_len`, with
`ModelArchConfigConvertorBase.derive_max_model_len_and_key`) and refuses a longer
one only then, after minutes of loading: the smallest of the length keys below,
`model_max_length` when set, times the RoPE `factor` of the scaling types that do
not already fold it into max_position_embeddings. Pure; nothing here reads a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flashnext.facts.model_derived import ConfigValueError

# vLLM's possible_keys, in its order: the smallest present wins.
LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose `factor` vLLM does not apply (their max_position_embeddings is
# already the scaled length, or they scale otherwise).
UNSCALED_ROPE_TYPES = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


@dataclass(frozen=True)
class ModelContext:
    tokens: int
    """The longest context vLLM accepts for this config."""
    key: str
    length: int
    factor: float

    def describe(self) -> str:
        scaled = f" x RoPE factor {self.factor:g}" if self.factor != 1 else ""
        return f"{self.key} {self.length}{scaled} = {self.tokens} tokens"


# Far beyond any released model (the largest are ~10M tokens); a product past it is a
# corrupt config, and 1e300 would overflow every int() downstream.
MAX_CONTEXT_TOKENS = 2**40


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigValueError(f"{key} is {value!r}, not a number")
    if value <= 0:
        raise ConfigValueError(f"{key} is {value!r}, not a positive number")
    return value


def _rope_parameters(text_config: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per layer type (nested) or one; the legacy `rope_scaling` too."""
    for name in ("rope_parameters", "rope_scaling"):
        params = text_config.get(name)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigValueError(f"{name} is {params!r}, not an object")
        nested = [p for p in params.values() if isinstance(p, dict)]
        if nested and len(nested) == len(params):
            return [p for p in nested if p]
        return [params] if params else []
    return []


def _rope_factor(text_config: dict[str, Any]) -> float:
    factor: Any = 1.0
    for params in _rope_parameters(text_config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in UNSCALED_ROPE_TYPES:
            factor = params.get("factor", factor)
    return 1.0 if factor is None else _number(factor, "rope factor")


def model_context(text_config: dict[str, Any]) -> ModelContext | None:
    """The context vLLM derives from the text config; None when it sets no length
    (vLLM then takes --max-model-len as given). Raises ConfigValueError naming the key."""
    found: list[tuple[float, str]] = []
    for key in LENGTH_KEYS:
        if text_config.get(key) is not None:
            value = _number(text_config[key], key)
            if value != int(value):  # 0.5 would become a context of 0 tokens
                raise ConfigValueError(
                    f"{key} is {text_config[key]!r}, not a whole number of tokens"
                )
            found.append((value, key))
    if not found:
        return None
    length, key = min(found)
    if text_config.get("model_max_length"):  # vLLM: it overrides the others (Cohere)
        length, key = text_config["model_max_length"], "model_max_length"
    factor = _rope_factor(text_config)
    tokens = length * factor
    if not math.isfinite(tokens) or tokens > MAX_CONTEXT_TOKENS or tokens < 1:
        raise ConfigValueError(
            f"{key} {length:g} x RoPE factor {factor:g} = {tokens:g} tokens, not a context "
            f"any model has (1 to {MAX_CONTEXT_TOKENS:,} tokens)"
        )
    return ModelContext(int(tokens), key, int(length), factor)
