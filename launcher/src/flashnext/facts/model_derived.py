"""Pure values derived from a Qwen4Exp config, computed exactly as vLLM 0.33.0 does.

For the planner and preflight; nothing here touches the disk. Sources (paths
under the `vllm/` package of the 0.33.0 wheel):
- PLE table rows: `models/qwen4_exp/nvidia/ngram_embedding.py`
  (`_make_vocab_layout`, `round_up(total, make_ngram_vocab_size_divisible_by)`);
  head h of the PLE layer with dense id d has as many rows as the
  (d*heads + h + 1)-th prime >= ngram_vocab_size_base.
- PLE shard names and rows: same file, `load_weights` (`ngram_embedding.shard_<i>.weight`,
  shard rows = ceil(rows / split_ngram_parts), the last shard may be shorter).
- Sampling keys: `config/model.py` `ModelConfig.get_diff_sampling_param`.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Keys vLLM 0.33.0 takes from generation_config.json as default sampling
# parameters. With none of them present it falls back to its neutral defaults
# (temperature 1, top_p 1, top_k 0: sampling over the whole 248k vocabulary).
VLLM_SAMPLING_KEYS: tuple[str, ...] = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
    "skip_special_tokens",
)

# Where the published (Qwen4ExpForConditionalGeneration) checkpoint keeps the
# text model; vLLM maps it to `language_model.model.` when loading.
TEXT_PREFIX = "model.language_model."


# PLE layers: each adds split_ngram_parts shard names (the shipped config has one).
MAX_PLE_LAYERS = 64


class ConfigValueError(ValueError):
    """A config.json value no Qwen4Exp model has; the message names the key and the value.

    Callers that know the file prefix its path (plan, preflight, table prepare).
    """


# The largest value of each integer key the launcher reads: every one sizes work or
# memory (a list per layer, primes per n-gram head, a name per table shard), so a
# value past these is refused before anything is sized by it. Each is far above
# any Qwen4Exp config (the shipped one's in brackets).
CONFIG_MAX: dict[str, int] = {
    "num_hidden_layers": 1024,  # [48]
    "full_attention_interval": 1024,  # [4]
    "mtp_num_hidden_layers": 16,  # [1]
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "linear_num_key_heads": 4096,
    "linear_num_value_heads": 4096,
    "indexer_n_heads": 4096,
    "head_dim": 65536,
    "linear_key_head_dim": 65536,
    "linear_value_head_dim": 65536,
    "indexer_head_dim": 65536,
    "linear_conv_kernel_dim": 1024,
    "indexer_compress_ratio": 1 << 20,
    "indexer_budget": 1 << 24,
    "hidden_size": 1 << 20,
    "ple_embed_dim": 1 << 20,
    "moe_intermediate_size": 1 << 24,
    "shared_expert_intermediate_size": 1 << 24,
    "num_experts": 1 << 16,  # [512]
    "num_experts_per_tok": 1 << 16,
    "vocab_size": 1 << 24,
    "ngram_size": 16,  # [3]
    "heads_per_ngram": 64,  # [8]
    "ngram_vocab_size_base": 1 << 40,
    "make_ngram_vocab_size_divisible_by": 1 << 20,
    "split_ngram_parts": 8192,  # [512]
}


def config_int(
    config: dict[str, Any], key: str, default: int | None = None, *, minimum: int = 1
) -> int:
    """`config[key]` as an integer in [minimum, CONFIG_MAX[key]]; `default` when the key
    is absent, ConfigValueError when it is required or wrong. A float (48.0, NaN) is
    refused like a string: vLLM's range() and shapes take integers only."""
    value = config.get(key, default)
    if value is None and key not in config:
        raise ConfigValueError(f"{key} is missing")
    if type(value) is not int or value < minimum:
        raise ConfigValueError(f"{key} is {value!r}, not an integer >= {minimum}")
    most = CONFIG_MAX.get(key)
    if most is not None and value > most:
        raise ConfigValueError(
            f"{key} is {value}, more than {most}: no Qwen4Exp model has that many"
        )
    return value


# vLLM's own value for each key that shapes the token distribution: a key set to one
# of these restores nothing (top_k -1 and 0 both mean "off"). max_new_tokens and
# skip_special_tokens shape no distribution, so alone they leave vLLM's fallback
# sampling (temperature 1, top_p 1) as it is.
VLLM_FALLBACKS: dict[str, tuple[float, ...]] = {
    "repetition_penalty": (1,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "temperature": (1,),
    "top_k": (0, -1),
    "top_p": (1,),
    "min_p": (0,),
}


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


def sampling_value_problems(generation_config: dict[str, Any] | None) -> list[str]:
    """Each sampling default vLLM would refuse (`top_p: 7`, `temperature: "hot"`): a
    default every request relies on, so every such request would fail."""
    return [
        why
        for key in (*VLLM_SAMPLING_KEYS, "do_sample")
        if (generation_config or {}).get(key) is not None
        and (why := sampling_value_error(key, generation_config[key]))
    ]


def sampling_keys_present(generation_config: dict[str, Any] | None) -> tuple[str, ...]:
    """The vLLM sampling keys a generation_config sets to a value that restores
    something (not vLLM's own fallback).

    An empty tuple means vLLM serves with its neutral defaults.
    """
    if not generation_config:
        return ()
    return tuple(
        k
        for k in VLLM_SAMPLING_KEYS
        if k in VLLM_FALLBACKS
        and generation_config.get(k) is not None
        and generation_config[k] not in VLLM_FALLBACKS[k]
    )


def sampling_keys_restoring_nothing(generation_config: dict[str, Any] | None) -> str:
    """'top_k=-1, max_new_tokens=128': the keys set that leave vLLM's fallback sampling."""
    if not generation_config:
        return ""
    kept = set(sampling_keys_present(generation_config))
    return ", ".join(
        f"{k}={generation_config[k]!r}".replace("True", "true").replace("False", "false")
        for k in VLLM_SAMPLING_KEYS
        if generation_config.get(k) is not None and k not in kept
    )


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the first 12 primes as witnesses)."""
    if n < 2:
        return False
    witnesses = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in witnesses:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in witnesses:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start."""
    out: list[int] = []
    n = start
    while len(out) < count:
        if _is_prime(n):
            out.append(n)
        n += 1
    return out


def ple_layer_ids(text_config: dict[str, Any]) -> tuple[int, ...]:
    """Zero-based decoder layer indices that hold a PLE module (`ple_layer_ids` is one-based)."""
    ids = text_config.get("ple_layer_ids") or []
    if not isinstance(ids, list) or len(ids) > MAX_PLE_LAYERS:
        raise ConfigValueError(
            f"ple_layer_ids is {ids!r:.80}, not a list of at most {MAX_PLE_LAYERS} layer numbers"
        )
    return tuple(sorted({config_int({"ple_layer_ids": i}, "ple_layer_ids") - 1 for i in ids}))


def ple_ngram_heads(text_config: dict[str, Any]) -> int:
    """Hashed n-gram heads per PLE layer: (ngram_size - 1) orders x heads_per_ngram."""
    orders = config_int(text_config, "ngram_size", 3, minimum=2) - 1
    return orders * config_int(text_config, "heads_per_ngram", 8)


def ple_head_vocab_sizes(text_config: dict[str, Any], ple_index: int = 0) -> tuple[int, ...]:
    """Rows of each n-gram head's hash table for the `ple_index`-th PLE layer (dense id)."""
    heads = ple_ngram_heads(text_config)
    base = config_int(text_config, "ngram_vocab_size_base", 20_000_000)
    primes = _primes_from(base, (ple_index + 1) * heads)
    return tuple(primes[ple_index * heads :])


def ple_table_shape(text_config: dict[str, Any], ple_index: int = 0) -> tuple[int, int]:
    """(rows, cols) of one PLE layer's n-gram table: 320001536 x 160 for the shipped config."""
    heads = ple_ngram_heads(text_config)
    key = "ple_embed_dim" if text_config.get("ple_embed_dim") else "hidden_size"
    embed_dim = config_int(text_config, key)
    if heads <= 0 or embed_dim % heads:
        raise ValueError(f"ple_embed_dim {embed_dim} is not divisible by {heads} n-gram heads")
    total = sum(ple_head_vocab_sizes(text_config, ple_index))
    divisor = config_int(text_config, "make_ngram_vocab_size_divisible_by", 128)
    rows = -(-total // divisor) * divisor
    return rows, embed_dim // heads


def ple_shard_rows(text_config: dict[str, Any], ple_index: int = 0) -> tuple[int, ...]:
    """Rows of each checkpoint shard of a PLE table, in shard order."""
    rows, _ = ple_table_shape(text_config, ple_index)
    parts = config_int(text_config, "split_ngram_parts", 512)
    per = -(-rows // parts)
    return tuple(max(0, min(per, rows - i * per)) for i in range(parts))


def ple_shard_names(text_config: dict[str, Any], prefix: str = TEXT_PREFIX) -> tuple[str, ...]:
    """Checkpoint names of every PLE table shard, all PLE layers, in load order."""
    parts = config_int(text_config, "split_ngram_parts", 512)
    return tuple(
        f"{prefix}layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{i}.weight"
        for layer in ple_layer_ids(text_config)
        for i in range(parts)
    )
