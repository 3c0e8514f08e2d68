#!/usr/bin/env python3
"""A tiny, real qwen4_exp checkpoint for A/B runs inside vLLM 0.33.0 on a GPU.

    python checks/gpu/tiny/tiny_model.py OUT_DIR [--seed N]

Stock and patched vLLM load it the same way, so one prompt can be served
stock vs patched, QSA K/V in VRAM vs in host RAM, the PLE table in memory vs
memory-mapped from `flashnext table prepare`'s file, and the outputs compared.
It is the shipped architecture at toy size: 8 decoder layers ([linear x3,
QSA] x2, QSA at layers 3 and 7, indexer on), PLE at decoder layer 1, MoE,
hyper-connections, one MTP layer and the tiny vision tower; BF16, no
quantization_config. Tensor names, shapes and dtypes come from the launcher's
skeleton inventory (`flashnext.skeleton`, quantized=False), so they are the
ones vLLM's loader reads (checks/patches/test_tiny_gpu_checkpoint.py loads
them into vLLM's own model classes).

Every tensor is seeded random (numpy, one generator per tensor name), with
an init that keeps activations near unit scale, so attention, PLE and the
experts all move the output; the LM head is scaled so logits have a standard
deviation of about 8 (see `LOGIT_STD`): greedy tokens then do not flip on
bf16 noise and a difference between two runs means something. A byte-level
BPE tokenizer trained on generated text, padded to `vocab_size` with filler
tokens, lets `vllm serve` take text. Two calls with the same seed write
byte-identical files.

Imports: the standard library, numpy, torch (bf16), safetensors, tokenizers
and the launcher package (launcher/src).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.facts.model import (  # noqa: E402
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    INDEX_FILE,
    tensor_nbytes,
)
from flashnext.skeleton import build_inventory, tiny_config  # noqa: E402
from flashnext.skeleton.configs import generation_config  # noqa: E402
from flashnext.skeleton.inventory import Entry  # noqa: E402
from flashnext.skeleton.writer import plan_shards  # noqa: E402

VOCAB_SIZE = 32768
HIDDEN = 128

# Overrides of the skeleton's tiny text_config (flashnext.skeleton.configs).
TEXT_OVERRIDES: dict[str, Any] = {
    # [linear x3, full] x2: QSA on decoder layers 3 and 7; PLE (one-based id 2)
    # on decoder layer 1, a linear-attention layer as transformers requires.
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "ple_layer_ids": [2],
    # hc_count x hidden = 512 < 2048: the fused HC down+SiLU GEMM takes its FMA
    # path for every batch size (its MMA path is tuned for SM100).
    "hidden_size": HIDDEN,
    # QSA: 4 query heads over 2 KV heads (GQA, as the real 24/2), head_dim 64
    # (the sparse attention kernel asserts a power of two >= 16); rotary dim
    # 64 x 0.25 = 16 = 2 x sum(mrope_section [3, 3, 2]) from the tiny config.
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    # Gated delta net: 2 key heads, 4 value heads of 64 (GQA like the real 16/48).
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    # The indexer as shipped except the head size: budget 2048 over groups of 4
    # keys = top-512 blocks, one of the k that flashinfer's cooperative_topk
    # takes on Hopper (512, 1024, 2048); head_dim 64, a power of two >= 16 as
    # the indexer kernels' tiles want (128 would select the fused pre-indexer,
    # which also needs rotary dim 64).
    "indexer_n_heads": 4,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 64,
    "indexer_budget": 2048,
    "indexer_compress_ratio": 4,
    # PLE: 16 n-gram heads (8 per order, as shipped) of 40 BF16 = 80-byte rows:
    # like the real 320-byte rows they do not divide 4096, so the page-aligned
    # table layout pads every page (51 rows + 16 bytes). Heads of ~5000 rows
    # give 81,024 rows (6.2 MiB, 4 shards), enough pages to make a wrong row
    # or page show.
    "heads_per_ngram": 8,
    "ple_embed_dim": 640,
    "ngram_vocab_size_base": 5000,
    "split_ngram_parts": 4,
    "mtp_num_hidden_layers": 1,
    # 32768 ids: prompts of 20,000 distinct token ids fit, below the 8 specials.
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 32768,
    # <|endoftext|>, the tokenizer's last id; PLE needs an eos (it resets the
    # n-gram history), transformers refuses PLE without one.
    "bos_token_id": VOCAB_SIZE - 1,
    "eos_token_id": VOCAB_SIZE - 1,
    # The tiny config's "silu" (CPU_TESTING.md: the model class instantiates on
    # CPU with it; the shipped config says "sigmoid"). It is the GDN output
    # gate's activation; QSA always gates with a sigmoid.
    "output_gate_type": "silu",
}

# Special tokens, the last 8 ids. tiny_config puts the vision ids at
# vocab-8 (start), vocab-7 (end), vocab-5 (image), vocab-4 (video), as Qwen3-VL
# numbers them (248053..248057); eos/bos is vocab-1.
SPECIAL_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
)
EOS_TOKEN = "<|endoftext|>"
# Qwen2/3/3.5's pre-tokenizer split (transformers' qwen3_5 tokenization module).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BPE_TARGET = 4096  # merges stop earlier when the corpus runs out of frequent pairs
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Logit scale. The LM head reads the final hyper-connection mixer's output:
# each HC stream RMS-normalized (Gemma norm, weight ~0 -> scale ~1), then a
# gated mean over the 4 streams with gates sigmoid(~0) = 0.5, so the hidden
# state that reaches lm_head has an RMS of ~0.5, not the ~1 of a plain final
# norm. lm_head ~ N(0, (LOGIT_STD / HC_GATE / sqrt(hidden))^2) then gives
# logits with a standard deviation of ~LOGIT_STD = 8 (a random model's logits
# are otherwise flat, top logprob ~ -ln(vocab), and greedy tokens flip on bf16
# noise). checks/patches/test_tiny_gpu_checkpoint.py measures it through
# vLLM's reference mixer.
LOGIT_STD = 8.0
HC_GATE = 0.5

# 1-D weights of Gemma-style RMSNorms, x * (1 + w): near 0 for a scale of ~1
# (GemmaRMSNorm, GroupedGemmaRMSNorm in the HC, Qwen4ExpPLEGroupedNorm).
GEMMA_NORMS = (
    ".hc_norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    ".q_layernorm.weight",
    ".k_layernorm.weight",
    ".norm_key.weight",
    ".norm_query.weight",
    ".norm_conv.weight",
    ".pre_fc_norm_embedding.weight",
    ".pre_fc_norm_hidden.weight",
)
# The gated delta net's output norm is RMSNormGated, x * w: near 1.
PLAIN_NORMS = (".linear_attn.norm.weight",)
NORM_NOISE = 0.02

MAX_SHARD_BYTES = 16 << 20


def tiny_gpu_config(layers: int = 8) -> dict[str, Any]:
    """config.json: the skeleton's tiny qwen4_exp with TEXT_OVERRIDES, no quantization_config."""
    # `layers` > 8 (the PP harness's 12: [linear x3, QSA] x3, one QSA layer per
    # rank of PP=3) keeps the pattern: QSA every 4th layer, PLE on layer 1.
    config = tiny_config(**(TEXT_OVERRIDES | {"num_hidden_layers": layers}))
    # No deepstack: the tiny tower has one block, and vLLM reads the key when it
    # builds the tower (runs without --language-model-only).
    config["vision_config"]["deepstack_visual_indexes"] = []
    return config


def _rng(seed: int, name: str) -> np.random.Generator:
    # One generator per tensor: a tensor's values depend only on (seed, name).
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _init(e: Entry, rng: np.random.Generator, hidden: int) -> np.ndarray:
    """Initial values (float32 or int64) of one checkpoint tensor."""
    name, shape = e.name, e.shape
    if e.values is not None:  # PLE hash buffers: the values vLLM computes itself
        return np.asarray(e.values, dtype=np.int64)
    if name.endswith(".A_log"):
        # Qwen3-Next: A ~ U(1, 16), decay exp(-A * softplus(a + dt_bias)) per step.
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith(".dt_bias"):
        # Mamba: dt ~ log-uniform(1e-3, 1e-1), stored as softplus^-1(dt).
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return dt + np.log(-np.expm1(-dt))
    if ".ngram_embedding.shard_" in name or name.endswith(".embed_tokens.weight"):
        return rng.standard_normal(shape)
    if name == "lm_head.weight":
        return rng.normal(0.0, LOGIT_STD / HC_GATE / math.sqrt(hidden), shape)
    if name.endswith(".conv1d.weight"):
        # Depthwise causal conv [channels, 1, kernel]: torch Conv1d's U(+-1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(shape[-1])
        return rng.uniform(-bound, bound, shape)
    if name.startswith("model.visual."):
        # LayerNorms at 1, biases and weights N(0, initializer_range) as HF does.
        if len(shape) == 1 and ".norm" in name and name.endswith(".weight"):
            return 1.0 + rng.normal(0.0, NORM_NOISE, shape)
        return rng.normal(0.0, 0.02, shape)
    if name.endswith(GEMMA_NORMS):
        return rng.normal(0.0, NORM_NOISE, shape)
    if name.endswith(PLAIN_NORMS):
        return 1.0 + rng.normal(0.0, NORM_NOISE, shape)
    if len(shape) == 2:
        # Linear [out, in] (router, projections, experts, HC mixes): 1/sqrt(fan_in)
        # keeps each block's output near unit RMS, so no branch is negligible.
        return rng.normal(0.0, 1.0 / math.sqrt(shape[1]), shape)
    raise ValueError(f"no init rule for {name} {e.dtype} {shape}: extend _init")


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


def _tensor(e: Entry, seed: int, hidden: int) -> torch.Tensor:
    values = _init(e, _rng(seed, e.name), hidden)
    dtype = _TORCH_DTYPES[e.dtype]
    if dtype == torch.int64:
        return torch.from_numpy(values.astype(np.int64))
    # float32 first, then round-to-nearest-even to BF16 (deterministic).
    tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)
    assert tuple(tensor.shape) == e.shape, e.name
    return tensor


# ---------------------------------------------------------------- tokenizer

_PROSE = (
    "the model reads each token and writes the next one from its cache while the "
    "scheduler keeps a batch of requests moving through every layer of the network "
    "attention selects a few blocks of keys by score and the expert router sends "
    "each row to two of eight experts a table of hashed n grams adds what the "
    "previous tokens said and a short convolution mixes it in time memory on the "
    "host holds the keys and values that do not fit beside the weights on the card "
    "pages are mapped from a file on disk and read when a row is needed prompt "
    "answer question system user assistant river mountain garden window light "
    "paper number letter word sentence story morning evening winter summer "
    "small large quick slow red green blue yellow bright dark open closed "
    "first second third last every some many few all none more less "
    "run read write copy load store send wait start stop fill check compare "
    "because although while when where which who what how why if then else"
)
_WORDS = _PROSE.split()
_CODE = (
    "def {f}({a}, {b}):\n    return {a} * {n} + {b}\n",
    "for {a} in range({n}):\n    {b} = {f}({a})\n",
    "if {a} > {n}:\n    {b} += 1\nelse:\n    {b} -= 1\n",
    '{{"{a}": {n}, "{b}": [{n}, {m}], "ok": true}}\n',
    "{a}[{n}] = {b}.get('{f}', {m})  # {f}\n",
)


def training_text(seed: int = 0, sentences: int = 4000) -> list[str]:
    """Generated lines (prose, numbers, code, JSON), the same on any Python."""
    rng = np.random.default_rng([seed, 0x70C])
    lines = []
    for _ in range(sentences):
        if rng.random() < 0.15:
            words = rng.choice(_WORDS, size=4)
            lines.append(
                _CODE[int(rng.integers(len(_CODE)))].format(
                    f=f"{words[0]}_{words[1]}",
                    a=str(words[2]),
                    b=str(words[3]),
                    n=int(rng.integers(0, 1000)),
                    m=round(float(rng.normal()), 3),
                )
            )
            continue
        words = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(4, 16)))]
        if rng.random() < 0.4:
            words.insert(int(rng.integers(len(words))), str(int(rng.integers(0, 100_000))))
        sentence = " ".join(words).capitalize() + str(rng.choice([".", ".", "?", "!", ","]))
        lines.append(sentence + ("\n\n" if rng.random() < 0.2 else " "))
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Tokenizer:
    """Byte-level BPE, filler tokens up to vocab_size - 8, then the 8 specials.

    The pipeline is Qwen3.5's (NFC, Qwen's split regex, byte level, no
    prefix space): transformers loads any qwen4_exp tokenizer as
    Qwen3_5Tokenizer, which rebuilds it from vocab and merges with exactly
    this pipeline whatever tokenizer_config.json says, so tokenizer.json and
    AutoTokenizer (what vLLM uses) encode alike.
    """
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TARGET,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer)
    doc = json.loads(tok.to_str())
    vocab: dict[str, int] = doc["model"]["vocab"]
    base = len(vocab)
    regular = vocab_size - len(SPECIAL_TOKENS)
    if base > regular:
        raise ValueError(f"BPE learned {base} tokens, more than {regular}")
    # Unreachable from text (the pre-tokenizer splits '<|', '_', '|>'), they make
    # every id below the specials valid; they decode to their own spelling.
    for i in range(base, regular):
        vocab[f"<|filler_{i}|>"] = i
    tok = Tokenizer.from_str(json.dumps(doc))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError("tokenizer size != vocab_size")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == regular + i, t
    return tok


def tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json (transformers reads the class from config.json's model_type)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }


# ---------------------------------------------------------------- writer


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_tiny_model(out_dir: str | os.PathLike[str], *, seed: int = 0, layers: int = 8) -> Path:
    """Write the checkpoint into out_dir (absent or empty); returns its path.

    Built in a temporary directory beside out_dir and renamed into place, so
    a failure leaves nothing half-written.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")
    if not out.parent.is_dir():
        raise FileNotFoundError(f"{out.parent} does not exist; create it first")
    config = tiny_gpu_config(layers)
    text = config["text_config"]
    hidden = int(text["hidden_size"])
    entries = build_inventory(config, quantized=False).entries
    plans = plan_shards(entries, MAX_SHARD_BYTES)  # PLE shards in files of their own
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        weight_map: dict[str, str] = {}
        for plan in plans:
            tensors = {e.name: _tensor(e, seed, hidden) for e in plan.entries}
            save_file(tensors, str(tmp / plan.file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, plan.file))
        total = sum(tensor_nbytes(e.dtype, e.shape) for e in entries)
        _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        _write_json(tmp / CONFIG_FILE, config)
        gen = generation_config(text, fixed_metadata=True)  # temperature, top_p, top_k, eos
        _write_json(tmp / GENERATION_CONFIG_FILE, gen)
        build_tokenizer(int(text["vocab_size"]), seed).save(str(tmp / "tokenizer.json"))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config())
        for path in tmp.iterdir():
            os.chmod(path, 0o644)
        os.chmod(tmp, 0o755)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out_dir", type=Path, help="new (or empty) directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layers",
        type=int,
        default=8,
        choices=(8, 12),
        help="decoder layers (12: the PP=3 harness)",
    )
    args = parser.parse_args(argv)
    try:
        path = write_tiny_model(args.out_dir, seed=args.seed, layers=args.layers)
    except (FileExistsError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    files = sorted(p for p in path.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    print(f"{path}: {len(files)} files, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
