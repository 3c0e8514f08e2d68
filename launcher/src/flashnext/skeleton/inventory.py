"""The tensor inventory of a Qwen3.8-Flash-Next INT4-mixed checkpoint, from its config.

Names are the published checkpoint's (transformers' Qwen4ExpForConditionalGeneration
layout), which vLLM 0.33.0 maps when loading:
- `model.language_model.` -> `language_model.model.`, `lm_head.` ->
  `language_model.lm_head.`, `model.visual.` -> `visual.`, `mtp.` dropped by the
  main model (`model_executor/models/qwen3_vl.py` and `qwen3_5.py` mappers);
- `in_proj_qkv`/`in_proj_z` -> `in_proj_qkvz`, `in_proj_b`/`in_proj_a` ->
  `in_proj_ba`, `q_proj`/`k_proj`/`v_proj`/`indexer.index_qk_proj` -> `qkv_proj`,
  `ple.key_proj`/`ple.value_proj` -> `ple.kv_proj`, HC `input_mix_weight_down` +
  `block_inject_weight` -> `input_mix_weight_down_block_inject`
  (`models/qwen4_exp/nvidia/model.py` `_EXTRA_WEIGHTS_MAPPER`,
  `packed_modules_mapping`);
- routed experts one module per expert, `mlp.experts.<e>.{gate,up,down}_proj`;
- PLE table shards `layers.1.ple.ple_embedding.ngram_embedding.shard_<i>.weight`
  plus its three hash buffers (`nvidia/ngram_embedding.py` `load_weights`);
- MTP `mtp.{fc_embedding,fc_hidden,pre_fc_norm_*,layers.0.*,hyper_connection_mixer.*}`
  (`nvidia/mtp.py` `_remap_mtp_weight_name`).

A quantized Linear is compressed-tensors pack-quantized: `weight_packed` I32
[out, ceil(in x bits / 32)], `weight_scale` BF16 [out, in / group], `weight_shape`
I64 [2] (`compressed_tensors/schemes/compressed_tensors_wNa16.py`); INT6 packs
bit-continuously (pack factor 32/6), as vLLM reads it.

checks/launcher/test_skeleton.py feeds every name of a BF16, QSA-off tiny
variant to vLLM 0.33.0's own `load_weights` (main model and MTP drafter): an
unknown name raises there and no parameter may stay unloaded. Quantized
suffixes and the QSA indexer names come from reading the sources (vLLM has no
CPU kernels for INT6 / WNA16 MoE, and QSA needs FlashAttention).

Choices not determinable from the sources here (see the report): dt_bias BF16
and A_log F32 (mamba_ssm_dtype float32); the MTP layer and the vision tower
unquantized BF16; the final HC mixer without block_inject_weight (the HF module
has none); in_proj_a/b and shared_expert_gate unquantized (1- and 48-row
outputs; vLLM builds shared_expert_gate with quant_config=None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashnext.facts.model_derived import (
    TEXT_PREFIX,
    ple_head_vocab_sizes,
    ple_layer_ids,
    ple_shard_rows,
    ple_table_shape,
)
from flashnext.skeleton.configs import SCHEMES


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    group: str
    """Which files it goes to: "body", "ple" (table shards, own files), "visual", "mtp"."""
    values: tuple[int, ...] | None = None
    """Real I64 values (weight_shape, PLE hash buffers); None = zeros / sparse."""


@dataclass
class Inventory:
    entries: list[Entry]
    ignore: list[str]
    """Unquantized Linear modules, for quantization_config.ignore."""


class _Builder:
    def __init__(self, quantize: bool) -> None:
        self.entries: list[Entry] = []
        self.ignore: list[str] = []
        self.quantize = quantize

    def tensor(self, name: str, dtype: str, shape: tuple[int, ...], group: str) -> None:
        self.entries.append(Entry(name, dtype, tuple(shape), group))

    def values(self, name: str, values: list[int], group: str) -> None:
        self.entries.append(Entry(name, "I64", (len(values),), group, tuple(values)))

    def linear(self, module: str, out: int, inp: int, scheme: str | None, group: str) -> None:
        """A Linear [out, inp]: quantized with `scheme`, or BF16 `weight` (and listed in ignore)."""
        if scheme is None or not self.quantize:
            self.tensor(f"{module}.weight", "BF16", (out, inp), group)
            if scheme is None and group == "body":
                self.ignore.append(module)
            return
        bits, gsize = SCHEMES[scheme]
        if inp % gsize:
            raise ValueError(f"{module}: in_features {inp} is not a multiple of group {gsize}")
        self.tensor(f"{module}.weight_packed", "I32", (out, -(-inp * bits // 32)), group)
        self.tensor(f"{module}.weight_scale", "BF16", (out, inp // gsize), group)
        self.values(f"{module}.weight_shape", [out, inp], group)

    def norm(self, name: str, size: int, group: str) -> None:
        self.tensor(f"{name}.weight", "BF16", (size,), group)


def _hyper_connection(b: _Builder, p: str, t: dict[str, Any], group: str, *, inject: bool) -> None:
    wide = int(t["hc_count"]) * int(t["hidden_size"])
    rank = int(t["hc_lowrank"])
    quant = group != "mtp"
    b.norm(f"{p}.hc_norm", wide, group)
    b.linear(f"{p}.input_mix_weight_down", rank, wide, "int8_g128" if quant else None, group)
    b.linear(f"{p}.input_mix_weight_up", wide, rank, "int8_g64" if quant else None, group)
    if inject:
        b.linear(f"{p}.block_inject_weight", int(t["hc_count"]), wide, None, group)


def _gated_delta_net(b: _Builder, p: str, t: dict[str, Any], dense: str | None, group: str) -> None:
    hidden = int(t["hidden_size"])
    key_dim = int(t["linear_num_key_heads"]) * int(t["linear_key_head_dim"])
    value_dim = int(t["linear_num_value_heads"]) * int(t["linear_value_head_dim"])
    v_heads = int(t["linear_num_value_heads"])
    conv_dim = 2 * key_dim + value_dim
    b.linear(f"{p}.in_proj_qkv", conv_dim, hidden, dense, group)
    b.linear(f"{p}.in_proj_z", value_dim, hidden, dense, group)
    b.linear(f"{p}.in_proj_b", v_heads, hidden, None, group)
    b.linear(f"{p}.in_proj_a", v_heads, hidden, None, group)
    b.tensor(f"{p}.conv1d.weight", "BF16", (conv_dim, 1, int(t["linear_conv_kernel_dim"])), group)
    b.tensor(f"{p}.dt_bias", "BF16", (v_heads,), group)
    b.tensor(f"{p}.A_log", "F32", (v_heads,), group)
    b.norm(f"{p}.norm", int(t["linear_value_head_dim"]), group)
    b.linear(f"{p}.out_proj", hidden, value_dim, dense, group)


def _qsa_attention(b: _Builder, p: str, t: dict[str, Any], dense: str | None, group: str) -> None:
    hidden = int(t["hidden_size"])
    heads, kv_heads, head_dim = (
        int(t["num_attention_heads"]),
        int(t["num_key_value_heads"]),
        int(t["head_dim"]),
    )
    # q_proj carries the sigmoid output gate next to Q: 2 x heads x head_dim rows.
    b.linear(f"{p}.q_proj", 2 * heads * head_dim, hidden, dense, group)
    b.linear(f"{p}.k_proj", kv_heads * head_dim, hidden, dense, group)
    b.linear(f"{p}.v_proj", kv_heads * head_dim, hidden, dense, group)
    b.linear(f"{p}.o_proj", hidden, heads * head_dim, dense, group)
    b.norm(f"{p}.q_norm", head_dim, group)
    b.norm(f"{p}.k_norm", head_dim, group)
    if t.get("indexer_n_heads") is None:
        return  # plain gated attention: vLLM builds Qwen3NextAttention, no indexer
    idx_rows = (int(t["indexer_n_heads"]) + int(t["indexer_kv_heads"])) * int(t["indexer_head_dim"])
    b.linear(f"{p}.indexer.index_qk_proj", idx_rows, hidden, dense, group)
    b.norm(f"{p}.indexer.q_layernorm", int(t["indexer_head_dim"]), group)
    b.norm(f"{p}.indexer.k_layernorm", int(t["indexer_head_dim"]), group)


def _moe(b: _Builder, p: str, t: dict[str, Any], quantized: bool, group: str) -> None:
    hidden = int(t["hidden_size"])
    inter = int(t["moe_intermediate_size"])
    shared = int(t["shared_expert_intermediate_size"])
    expert = "int4_g128" if quantized else None
    dense = "int6_g128" if quantized else None
    # The router is a bare Parameter in the HF model (not a Linear): never quantized.
    b.tensor(f"{p}.gate.weight", "BF16", (int(t["num_experts"]), hidden), group)
    for e in range(int(t["num_experts"])):
        b.linear(f"{p}.experts.{e}.gate_proj", inter, hidden, expert, group)
        b.linear(f"{p}.experts.{e}.up_proj", inter, hidden, expert, group)
        b.linear(f"{p}.experts.{e}.down_proj", hidden, inter, expert, group)
    b.linear(f"{p}.shared_expert.gate_proj", shared, hidden, dense, group)
    b.linear(f"{p}.shared_expert.up_proj", shared, hidden, dense, group)
    b.linear(f"{p}.shared_expert.down_proj", hidden, shared, dense, group)
    b.linear(f"{p}.shared_expert_gate", 1, hidden, None, group)


def _ple(b: _Builder, p: str, t: dict[str, Any], ple_index: int) -> None:
    hidden = int(t["hidden_size"])
    wide = int(t["hc_count"]) * hidden
    ple_dim = int(t.get("ple_embed_dim") or hidden)
    sizes = list(ple_head_vocab_sizes(t, ple_index))
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    b.values(f"{p}.ple_embedding.layer_multipliers", ple_layer_multipliers(t, ple_index), "body")
    b.values(f"{p}.ple_embedding.ngram_heads_vocab_sizes", sizes, "body")
    b.values(f"{p}.ple_embedding.ngram_heads_offsets", offsets, "body")
    _, cols = ple_table_shape(t, ple_index)
    for i, rows in enumerate(ple_shard_rows(t, ple_index)):
        b.tensor(f"{p}.ple_embedding.ngram_embedding.shard_{i}.weight", "BF16", (rows, cols), "ple")
    b.linear(f"{p}.key_proj", wide, ple_dim, "int6_g128", "body")
    b.linear(f"{p}.value_proj", hidden, ple_dim, "int6_g128", "body")
    for norm in ("norm_key", "norm_query", "norm_conv"):
        b.norm(f"{p}.{norm}", wide, "body")
    b.tensor(f"{p}.conv1d.weight", "BF16", (wide, 1, int(t["ple_conv_kernel_size"])), "body")


def _decoder_layer(
    b: _Builder, p: str, t: dict[str, Any], layer_type: str, group: str, ple_index: int | None
) -> None:
    quantized = group == "body"
    dense = "int6_g128" if quantized else None
    if ple_index is not None:
        _ple(b, f"{p}.ple", t, ple_index)
    if layer_type == "linear_attention":
        _gated_delta_net(b, f"{p}.linear_attn", t, dense, group)
    else:
        _qsa_attention(b, f"{p}.self_attn", t, dense, group)
    _moe(b, f"{p}.mlp", t, quantized, group)
    _hyper_connection(b, f"{p}.attn_hyper_connection", t, group, inject=True)
    _hyper_connection(b, f"{p}.mlp_hyper_connection", t, group, inject=True)


def _vocab(b: _Builder, module: str, t: dict[str, Any]) -> None:
    """embed_tokens / lm_head: INT8 g128 (vLLM 0.33.0 has a compressed-tensors
    embedding method for pack-quantized INT embeddings)."""
    b.linear(module, int(t["vocab_size"]), int(t["hidden_size"]), "int8_g128", "body")


def _vision(b: _Builder, v: dict[str, Any]) -> None:
    p = "model.visual"
    h, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    patch, tpatch = int(v["patch_size"]), int(v["temporal_patch_size"])
    merged = h * int(v["spatial_merge_size"]) ** 2

    def linear_bias(name: str, out: int, inp: int) -> None:
        b.tensor(f"{name}.weight", "BF16", (out, inp), "visual")
        b.tensor(f"{name}.bias", "BF16", (out,), "visual")

    b.tensor(
        f"{p}.patch_embed.proj.weight",
        "BF16",
        (h, int(v["in_channels"]), tpatch, patch, patch),
        "visual",
    )
    b.tensor(f"{p}.patch_embed.proj.bias", "BF16", (h,), "visual")
    b.tensor(f"{p}.pos_embed.weight", "BF16", (int(v["num_position_embeddings"]), h), "visual")
    for i in range(int(v["depth"])):
        q = f"{p}.blocks.{i}"
        for norm in ("norm1", "norm2"):
            b.tensor(f"{q}.{norm}.weight", "BF16", (h,), "visual")
            b.tensor(f"{q}.{norm}.bias", "BF16", (h,), "visual")
        linear_bias(f"{q}.attn.qkv", 3 * h, h)
        linear_bias(f"{q}.attn.proj", h, h)
        linear_bias(f"{q}.mlp.linear_fc1", inter, h)
        linear_bias(f"{q}.mlp.linear_fc2", h, inter)
    b.tensor(f"{p}.merger.norm.weight", "BF16", (h,), "visual")
    b.tensor(f"{p}.merger.norm.bias", "BF16", (h,), "visual")
    linear_bias(f"{p}.merger.linear_fc1", merged, merged)
    linear_bias(f"{p}.merger.linear_fc2", int(v["out_hidden_size"]), merged)


def _mtp(b: _Builder, t: dict[str, Any]) -> None:
    hidden = int(t["hidden_size"])
    wide = int(t["hc_count"]) * hidden
    b.linear("mtp.fc_embedding", hidden, hidden, None, "mtp")
    b.linear("mtp.fc_hidden", hidden, hidden, None, "mtp")
    b.norm("mtp.pre_fc_norm_embedding", hidden, "mtp")
    b.norm("mtp.pre_fc_norm_hidden", wide, "mtp")
    for i in range(int(t.get("mtp_num_hidden_layers", 0))):
        # Every MTP layer is a QSA layer (nvidia/mtp.py builds "qwen_sparse_attention").
        _decoder_layer(b, f"mtp.layers.{i}", t, "full_attention", "mtp", None)
    _hyper_connection(b, "mtp.hyper_connection_mixer", t, "mtp", inject=False)


def build_inventory(config: dict[str, Any], *, quantized: bool = True) -> Inventory:
    """Every tensor of the checkpoint described by config.json, in checkpoint order.

    `quantized=False` gives the same names with plain BF16 `weight`s (a model
    exported without quantization)."""
    t = config["text_config"]
    b = _Builder(quantized)
    lm = TEXT_PREFIX.rstrip(".")
    _vocab(b, f"{lm}.embed_tokens", t)
    ple_ids = ple_layer_ids(t)
    for i, layer_type in enumerate(t["layer_types"]):
        ple_index = ple_ids.index(i) if i in ple_ids else None
        _decoder_layer(b, f"{lm}.layers.{i}", t, layer_type, "body", ple_index)
    _hyper_connection(b, f"{lm}.hyper_connection_mixer", t, "body", inject=False)
    _vocab(b, "lm_head", t)
    if config.get("vision_config"):
        _vision(b, config["vision_config"])
    _mtp(b, t)
    # The vision tower and MTP stay BF16: ignored by pattern, not one by one.
    ignore = b.ignore + [r"re:^model\.visual\..*", r"re:^mtp\..*"]
    return Inventory(b.entries, ignore)


# ---------------------------------------------------------------- PLE hash multipliers

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64 finalizer (Steele, Lea, Flood 2014), the mixer Qwen4Exp uses.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def ple_layer_multipliers(t: dict[str, Any], ple_index: int) -> list[int]:
    """The persistent `layer_multipliers` buffer of a PLE layer: odd hash multipliers,
    one per n-gram order, bounded so token_id x multiplier fits in int64."""
    vocab = int(t["vocab_size"])
    half = max(1, (((1 << 63) - 1) // vocab) // 2)
    base = int(t.get("seed", 1234)) + 10007 * ple_index
    return [
        2 * (_splitmix64(base + 0x9E3779B97F4A7C15 * (k + 1)) % half) + 1
        for k in range(int(t.get("ngram_size", 3)))
    ]
