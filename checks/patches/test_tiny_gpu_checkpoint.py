"""The GPU A/B checkpoint (checks/gpu/tiny/tiny_model.py) loads into vLLM 0.33.0's own classes.

No `proves` marker: every test here must pass on the stock and on the patched
tree alike (the A/B compares them on the same checkpoint). On CPU:
- the real Qwen4ExpForConditionalGeneration (vision tower, QSA with the
  indexer on layers 3 and 7, PLE table as a plain tensor) is built on device
  "cpu" from an engine config at the checkpoint's full max_model_len and
  loads the checkpoint through its own load_weights from vLLM's own
  safetensors_weights_iterator: no unknown name, no parameter left unloaded,
  the values those of the files; the MTP drafter (Qwen4ExpMTP) likewise;
- vLLM's tokenizer loader takes the tokenizer; it round-trips text and has
  exactly vocab_size ids, the specials where config.json says;
- two writes with the same seed are byte-identical;
- `flashnext table prepare` (packed and page-aligned) takes its PLE shards.
QSA needs FlashAttention, so its availability probe is answered yes (as in
test_qsa_offload_layer.py); nothing here runs a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_qwen4_exp import build_model, engine_args

REPO = Path(__file__).resolve().parents[2]
# The GPU harnesses whose checkpoint and engines are checked here (checks/gpu).
for harness in ("tiny", "mtp", "ab", "common"):
    sys.path.insert(0, str(REPO / "checks" / "gpu" / harness))
sys.path.insert(0, str(REPO / "launcher" / "src"))

import tiny_model  # noqa: E402

LM = "language_model.model."
CKPT = "model.language_model."
QSA_LAYERS = (3, 7)
PLE_LAYER = 1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model.write_tiny_model(tmp_path_factory.mktemp("tiny-gpu") / "model", seed=0)


def _file_tensor(checkpoint: Path, name: str):
    from safetensors import safe_open

    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    with safe_open(str(checkpoint / index["weight_map"][name]), framework="pt") as f:
        return f.get_tensor(name)


def _weights(checkpoint: Path):
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in checkpoint.glob("*.safetensors"))
    return safetensors_weights_iterator(files, False)


@pytest.fixture(scope="module")
def vllm_config(checkpoint: Path):
    """One engine config for the target and the drafter: MTP on, tokenizer on,
    the checkpoint's own max_model_len, the PLE table a plain tensor."""
    mp = pytest.MonkeyPatch()
    import vllm.models.qwen4_exp.nvidia.model  # noqa: F401  (qsa imports model)
    import vllm.models.qwen4_exp.nvidia.qsa as qsa

    mp.setattr(qsa, "is_flash_attn_varlen_func_available", lambda: True)
    config = engine_args(
        checkpoint,
        dtype="bfloat16",
        max_model_len=32768,
        skip_tokenizer_init=False,
        language_model_only=False,  # the vision tower's tensors load too
        engram_config={"cpu_offload": False},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()
    yield config
    mp.undo()


@pytest.fixture(scope="module")
def loaded_model(vllm_config, checkpoint: Path):
    from vllm.utils.torch_utils import set_default_torch_dtype

    # As vLLM's loader builds it: parameters in the model dtype (BF16).
    with set_default_torch_dtype(vllm_config.model_config.dtype):
        model = build_model(vllm_config, device="cpu")
    loaded = model.load_weights(_weights(checkpoint))
    return model, loaded


def test_engine_config_is_the_tiny_qwen4_exp(vllm_config):
    mc = vllm_config.model_config
    text = mc.hf_text_config
    assert mc.architectures == ["Qwen4ExpForConditionalGeneration"]
    assert mc.quantization is None and mc.max_model_len == 32768
    assert str(mc.dtype) == "torch.bfloat16"
    assert [i for i, t in enumerate(text.layer_types) if t != "linear_attention"] == [3, 7]
    assert list(text.ple_layer_ids) == [PLE_LAYER + 1]
    assert text.indexer_budget // text.indexer_compress_ratio in (512, 1024, 2048)
    assert text.vocab_size == 32768 and text.mtp_num_hidden_layers == 1
    # generation_config.json's sampling keys reach vLLM's default sampling params.
    assert {"temperature", "top_p", "top_k"} <= set(mc.get_diff_sampling_param())


def test_every_parameter_loads_with_the_files_values(loaded_model, checkpoint: Path):
    import torch

    model, loaded = loaded_model
    params = dict(model.named_parameters())
    assert sorted(set(params) - loaded) == []
    assert any(n.startswith("visual.") for n in params)  # the tower was built and loaded
    for layer in QSA_LAYERS:  # QSA with its indexer, not plain gated attention
        attn = model.get_submodule(f"{LM}layers.{layer}.self_attn")
        assert type(attn).__name__ == "Qwen4ExpQSAAttention" and attn.indexer is not None

    def same(param: str, *names: str) -> None:
        want = torch.cat([_file_tensor(checkpoint, n) for n in names])
        got = params[param].detach()
        assert got.dtype == want.dtype and torch.equal(got, want), param

    same("language_model.lm_head.weight", "lm_head.weight")
    same(f"{LM}embed_tokens.weight", f"{CKPT}embed_tokens.weight")
    # q (with its output gate), k, v and the indexer's q/k fused in one projection.
    attn = f"{CKPT}layers.3.self_attn."
    same(
        f"{LM}layers.3.self_attn.qkv_proj.weight",
        *(attn + p for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")),
        attn + "indexer.index_qk_proj.weight",
    )
    same(f"{LM}layers.2.linear_attn.A_log", f"{CKPT}layers.2.linear_attn.A_log")
    same(f"{LM}layers.2.linear_attn.conv1d.weight", f"{CKPT}layers.2.linear_attn.conv1d.weight")
    # The PLE table: its shards back to back, row for row.
    ple = f"{CKPT}layers.{PLE_LAYER}.ple.ple_embedding."
    same(
        f"{LM}layers.{PLE_LAYER}.ple.ple_embedding.ngram_embedding.weight",
        *(f"{ple}ngram_embedding.shard_{i}.weight" for i in range(4)),
    )


def test_ple_hash_buffers_are_vllms_own(loaded_model, checkpoint: Path):
    """The checkpoint's hash buffers equal what vLLM derives from the config."""
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding as NE

    model, _ = loaded_model
    text = model.config.text_config
    emb = model.get_submodule(f"{LM}layers.{PLE_LAYER}.ple.ple_embedding")
    heads = (text.ngram_size - 1) * text.heads_per_ngram
    sizes, offsets, _ = NE._make_vocab_layout(
        ngram_vocab_size_base=text.ngram_vocab_size_base, ngram_heads=heads, ple_dense_layer_id=0
    )
    multipliers = NE._make_layer_multipliers(
        ngram_size=text.ngram_size,
        unigram_vocab_size=text.vocab_size,
        seed=text.seed,
        ple_dense_layer_id=0,
    )
    prefix = f"{CKPT}layers.{PLE_LAYER}.ple.ple_embedding."
    for buffer, want in (
        ("layer_multipliers", multipliers),
        ("ngram_heads_vocab_sizes", sizes),
        ("ngram_heads_offsets", offsets),
    ):
        assert _file_tensor(checkpoint, prefix + buffer).tolist() == want, buffer
        assert getattr(emb, buffer).tolist() == want, buffer


def test_mtp_drafter_loads_the_mtp_tensors(vllm_config, loaded_model, checkpoint: Path):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    dtype = vllm_config.model_config.dtype
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype), torch.device("cpu"):
        mtp = Qwen4ExpMTP(vllm_config=vllm_config, prefix="")
    loaded = mtp.load_weights(_weights(checkpoint))
    params = dict(mtp.named_parameters())
    assert sorted(set(params) - loaded) == [] and len(params) > 20
    assert type(mtp.model.layers[0].self_attn).__name__ == "Qwen4ExpQSAAttention"
    for param, name in (
        ("model.fc_hidden.weight", "mtp.fc_hidden.weight"),
        ("model.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_hidden.weight"),
        ("lm_head.weight", "lm_head.weight"),  # shared with the target's head
    ):
        assert torch.equal(params[param].detach(), _file_tensor(checkpoint, name)), param


def test_logits_are_peaked(checkpoint: Path):
    """lm_head after vLLM's reference final HC mixer (pure torch): logit std ~8.

    Proxy for the hidden state at the head: token embeddings in all 4 HC
    streams (the model's input state), through the checkpoint's final mixer."""
    import torch
    from vllm.models.qwen4_exp.common.hyperconnection import GatedResidual, HyperConnectionConfig

    p = f"{CKPT}hyper_connection_mixer."
    mixer = GatedResidual(
        HyperConnectionConfig(hc_count=4, hidden_size=128, hc_lowrank=64, hc_per_branch_norm=True),
        use_combine=False,
    ).float()
    for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up"):
        module = getattr(mixer, name)
        module.weight.data = _file_tensor(checkpoint, f"{p}{name}.weight").float()
    ids = torch.randint(0, 32760, (256,), generator=torch.Generator().manual_seed(0))
    embed = _file_tensor(checkpoint, f"{CKPT}embed_tokens.weight").float()
    with torch.no_grad():
        hidden, _ = mixer.mix(embed[ids].repeat(1, 4))
        logits = hidden @ _file_tensor(checkpoint, "lm_head.weight").float().T
    std = logits.std(dim=-1).mean().item()
    top_logprob = torch.log_softmax(logits, dim=-1).max(dim=-1).values.mean().item()
    print(f"\nlogit std {std:.2f}, mean top logprob {top_logprob:.2f}")
    assert 6.0 < std < 10.0
    assert top_logprob > -1.5  # a flat model's would be -ln(32768) = -10.4


def test_vllms_tokenizer_takes_it(vllm_config, checkpoint: Path):
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    config = json.loads((checkpoint / "config.json").read_text())
    text = config["text_config"]
    tok = cached_tokenizer_from_config(vllm_config.model_config)
    assert len(tok) == text["vocab_size"] == 32768
    assert tok.max_token_id == text["vocab_size"] - 1
    assert tok.eos_token_id == text["eos_token_id"] == tok.bos_token_id == text["bos_token_id"]
    gen = json.loads((checkpoint / "generation_config.json").read_text())
    for key in ("eos_token_id", "bos_token_id"):
        assert gen[key] == text[key], key
    for key, token in (
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
    ):
        assert tok.convert_tokens_to_ids(token) == config[key], key
    for sample in (
        "Hello, world! The model reads 12345 tokens.\n",
        "  def f(x):\n\treturn {'a': [1, 2.5]}  # unseen words: Zyxwv quokka\n",
        "ünïcödé 漢字 🙂 — <|im_start|>user\nhi<|im_end|>",
    ):
        ids = tok.encode(sample, add_special_tokens=False)
        assert tok.decode(ids) == sample
    # Every id decodes (fillers included): prompts of 20,000 distinct ids are valid.
    assert tok.decode(list(range(5000, 25000, 997)))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_json_and_transformers_agree(checkpoint: Path):
    """tokenizer.json as written and transformers' AutoTokenizer (offline) encode alike."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(checkpoint))
    assert raw.get_vocab_size(with_added_tokens=True) == len(auto) == 32768
    sample = "".join(tiny_model.training_text(seed=5, sentences=40)) + " Zyxwv 42 ünï 漢字"
    assert auto(sample)["input_ids"] == raw.encode(sample).ids
    assert raw.decode(raw.encode(sample).ids) == sample


def test_the_writer_is_deterministic(checkpoint: Path, tmp_path: Path):
    again = tiny_model.write_tiny_model(tmp_path / "again", seed=0)
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    assert "tokenizer.json" in names and len([n for n in names if n.endswith(".safetensors")]) > 1
    for name in names:
        assert (checkpoint / name).read_bytes() == (again / name).read_bytes(), name
    size = sum((checkpoint / n).stat().st_size for n in names)
    print(f"\ncheckpoint: {len(names)} files, {size / 2**20:.1f} MiB")
    assert size < 48 << 20  # small enough to carry to the lent GPU (64 MiB a call)


def _table_prepare(checkpoint: Path, out: Path, *extra: str) -> dict:
    # --force: CI disks (virtio) report rotational and prepare would refuse them.
    argv = [sys.executable, "-m", "flashnext", "table", "prepare", "--model", str(checkpoint),
            "--out", str(out), "--json", "--force", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "launcher" / "src")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("layout", ["packed", "page-aligned"])
def test_flashnext_table_prepare_takes_its_shards(checkpoint: Path, tmp_path: Path, layout: str):
    import torch

    out = tmp_path / "ple.bin"
    doc = _table_prepare(checkpoint, out, "--layout", layout)
    assert doc["status"] == "written" and doc["layout"] == layout
    manifest = json.loads((tmp_path / "ple.bin.json").read_text())
    ple = f"{CKPT}layers.{PLE_LAYER}.ple.ple_embedding.ngram_embedding."
    rows = torch.cat([_file_tensor(checkpoint, f"{ple}shard_{i}.weight") for i in range(4)])
    assert (manifest["rows"], manifest["dim"], manifest["dtype"]) == (rows.shape[0], 40, "BF16")
    data = out.read_bytes()
    flat = rows.view(torch.uint8).numpy().tobytes()
    if layout == "packed":
        assert data == flat
    else:  # 51 whole 80-byte rows per 4096-byte page, the rest padding
        per_page, row_bytes = 4096 // 80, 80
        assert len(data) == -(-rows.shape[0] // per_page) * 4096 == manifest["total_bytes"]
        for r in (0, 50, 51, 52, rows.shape[0] - 1):
            at = (r // per_page) * 4096 + (r % per_page) * row_bytes
            assert data[at : at + row_bytes] == flat[r * row_bytes : (r + 1) * row_bytes], r


@pytest.fixture(scope="module")
def tiny_plans(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """The h200-tiny plans the MTP run's engines take, by K (0: MTP off), as
    checks/gpu/ab/run-in-vllm writes them (checks/gpu/common/tiny_plan.py)."""
    from tiny_plan import write_plan

    root = tmp_path_factory.mktemp("tiny-plans")
    table = checkpoint.parent / "tables" / "ple-packed.bin"
    plans = {}
    with pytest.MonkeyPatch.context() as mp:  # `flashnext` for this python's subprocesses
        mp.setenv("PYTHONPATH", f"{REPO / 'launcher' / 'src'}:{os.environ.get('PYTHONPATH', '')}")
        for k in (0, 1, 2):
            path = write_plan(
                root / f"plan-mtp{k}.json", checkpoint, table, "h200-tiny", mtp=k or None
            )
            plans[k] = json.loads(path.read_text())
    return plans


def test_the_mtp_equality_engines_draft_only_where_asked_and_offload_the_drafter_once(
    checkpoint: Path, tiny_plans: dict[int, dict], vllm_tree
):
    """checks/gpu/mtp/mtp_equality.py's engines, as the worker builds them from the
    h200-tiny plans, through vLLM's own EngineArgs: the mtp-on ones draft K tokens
    with the checkpoint's MTP layer, and the serving-setup one asks vLLM's UVA
    offloader for the plan's drafter segments."""
    from types import SimpleNamespace

    if vllm_tree.kind == "stock":
        pytest.skip("the GPU run's engines are the patched tree's (the PLE table file is 0012's)")

    import mtp_equality
    from in_vllm_worker import engine_kwargs
    from vllm.engine.arg_utils import EngineArgs

    ks = [1, 2]
    args = SimpleNamespace(model=checkpoint, tables=checkpoint.parent / "tables",
                           plan=tiny_plans[0], mtp_plans={k: tiny_plans[k] for k in ks},
                           gpu_memory_utilization=None, speculative_tokens=ks)  # fmt: skip
    built = {}
    for arm in mtp_equality.compared_arms(ks) + mtp_equality.timed_arms(ks):
        kwargs, _ = engine_kwargs(mtp_equality.engine_spec(arm, args, {}, [1] * 10))
        built[arm.name] = (arm, EngineArgs(**kwargs).create_engine_config())
    argv = tiny_plans[0]["argv"]
    for arm, config in built.values():
        sc = config.speculative_config
        if arm.speculative_tokens:
            assert (sc.method, sc.num_speculative_tokens) == ("mtp", arm.speculative_tokens)
            assert sc.draft_model_config.hf_config.architectures == ["Qwen4ExpMTP"]
        else:
            assert sc is None, arm.name
        uva = config.offload_config.uva
        if arm.name == "mtp-on-offload-k2":
            assert uva.cpu_offload_gb > 0
            assert set(uva.cpu_offload_params) == {"mtp.embed_tokens", "mtp.layers.8.mlp.experts"}
        else:
            assert uva.cpu_offload_gb == 0 and not uva.cpu_offload_params, arm.name
        assert config.engram_config.mmap_path == str(args.tables / "ple-packed.bin")
        max_model_len = int(argv[argv.index("--max-model-len") + 1])
        assert config.model_config.max_model_len == max_model_len
