"""`checkpoint fix` proved with vLLM 0.33.0's own code (run with the vLLM env: see `run`).

The full-size skeleton carries the real tensor inventory (225,300 tensors, 73,728
INT4 experts) with the shipped metadata defects. After `plan_fix` + `apply_fix`,
vLLM's CompressedTensorsConfig, configured for Qwen4ExpForConditionalGeneration
exactly as the model loader does (`configure_quant_config`: name mapper and
packed-module mapping), must give every module the scheme its tensors store.
The same harness over the shipped config must find the defect (so it can fail),
and our own emulation (`check`, checks/checkpoint_metadata.py) must agree with
vLLM module by module.
"""

from __future__ import annotations

import copy
import os
import re
import types

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from flashnext.checkpoint.fix import apply_fix, plan_fix  # noqa: E402
from flashnext.checkpoint.sampling import parse_sampling  # noqa: E402
from flashnext.checks.checkpoint_metadata import check  # noqa: E402
from flashnext.facts.model import read_model_facts  # noqa: E402
from flashnext.facts.scheme_map import SchemeMap, vllm_name  # noqa: E402
from flashnext.facts.stored_schemes import (  # noqa: E402
    Scheme,
    ple_table_modules,
    scheme_of_group,
    stored_modules,
)
from flashnext.skeleton import write_skeleton  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from vllm.model_executor.layers.quantization.compressed_tensors.utils import (  # noqa: E402
    should_ignore_layer,
)
from vllm.model_executor.model_loader.utils import configure_quant_config  # noqa: E402
from vllm.models.qwen4_exp.nvidia.model import Qwen4ExpForConditionalGeneration  # noqa: E402

MODEL_CLS = Qwen4ExpForConditionalGeneration


class ColumnParallelLinear(torch.nn.Module):
    """Only the class name matters to vLLM's target matching (the "Linear" substring)."""


class RoutedExperts(torch.nn.Module):
    pass


def vllm_config(qcfg: dict) -> CompressedTensorsConfig:
    cfg = CompressedTensorsConfig.from_config(copy.deepcopy(qcfg))
    configure_quant_config(cfg, MODEL_CLS)
    # What CompressedTensorsMoEMethod.get_moe_method does before the first expert lookup.
    cfg._add_fused_moe_to_target_scheme_map()
    return cfg


def runtime_name(ckpt_module: str) -> str | None:
    """vLLM's own mapper on the module's weight name (None: not in the main model)."""
    mapped = MODEL_CLS.hf_to_vllm_mapper._map_name(ckpt_module + ".weight")
    return None if mapped is None else mapped[: -len(".weight")]


def vllm_weights(cfg: CompressedTensorsConfig, name: str) -> Scheme | None:
    layer = RoutedExperts() if re.search(r"\.experts\.\d+\.", name) else ColumnParallelLinear()
    scheme = cfg.get_scheme_dict(layer, layer_name=name)
    w = scheme["weights"] if scheme else None
    if w is None:
        return None
    assert w.type == "int" and w.strategy == "group", w
    return Scheme(w.num_bits, w.group_size, w.symmetric)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    write_skeleton(root / "ckpt", "full")
    shipped = read_model_facts(root / "ckpt")
    plan = plan_fix(shipped)
    apply_fix(plan)
    fixed = read_model_facts(root / "ckpt")
    modules, problems = stored_modules(fixed)
    assert not problems
    return types.SimpleNamespace(shipped=shipped, fixed=fixed, modules=modules, plan=plan)


def in_main_model(modules):
    """(checkpoint name, vLLM name, stored scheme) of modules the main model builds."""
    out = []
    for m in modules:
        name = runtime_name(m.name)
        if name is not None and not name.startswith("visual."):  # --language-model-only
            out.append((m.name, name, m.scheme))
    return out


def test_our_prefix_map_is_vllms(full):
    seen = 0
    for m in full.modules:
        name = runtime_name(m.name)
        if name is not None:
            assert vllm_name(m.name) == name
            seen += 1
    assert seen > 70_000


def test_fixed_checkpoint_every_module_resolves_to_its_stored_scheme(full):
    cfg = vllm_config(full.fixed.quantization_config)
    modules = in_main_model(full.modules)
    wrong = [(c, s, got) for c, n, s in modules if (got := vllm_weights(cfg, n)) != s]
    assert not wrong, f"{len(wrong)} modules resolve wrongly, e.g. {wrong[:3]}"
    # plain weights (router, norms' neighbours, ignored projections) resolve to None too
    assert sum(1 for _, _, s in modules if s is not None) >= 73_728 + 48 * 3
    assert sum(1 for _, _, s in modules if s is None) > 0


def test_shipped_checkpoint_is_misread_by_vllm(full):
    """The same harness on the shipped metadata: all 73,728 INT4 experts read as INT8 g128."""
    cfg = vllm_config(full.shipped.quantization_config)
    int4 = Scheme(4, 128)
    experts = [(n, s) for _, n, s in in_main_model(full.modules) if s == int4]
    assert len(experts) == 73_728
    assert {vllm_weights(cfg, n) for n, _ in experts} == {Scheme(8, 128)}


@pytest.mark.parametrize("which", ["shipped", "fixed"])
def test_our_emulation_agrees_with_vllm_module_by_module(full, which):
    qcfg = getattr(full, which).quantization_config
    cfg = vllm_config(qcfg)
    ours = SchemeMap.from_config(qcfg)
    schemes = {g: scheme_of_group(v) for g, v in qcfg["config_groups"].items()}
    disagree = []
    for _, name, stored in in_main_model(full.modules):
        if stored is None:
            continue  # which plain weights vLLM builds as Linears is the model's business
        group = ours.resolve(name, runtime=True)
        mine = schemes[group] if group else None
        if mine != vllm_weights(cfg, name):
            disagree.append(name)
    assert not disagree, disagree[:5]


# vLLM fuses these checkpoint modules into one Linear; all parts must share a scheme.
FUSED = {
    "self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj", "indexer.index_qk_proj"],
    "linear_attn.in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "mlp.shared_expert.gate_up_proj": ["gate_proj", "up_proj"],
    "ple.kv_proj": ["key_proj", "value_proj"],
}


def test_fused_modules_resolve_like_their_parts(full):
    cfg = vllm_config(full.fixed.quantization_config)
    by_name = {n: s for _, n, s in in_main_model(full.modules)}
    checked = 0
    for fused_suffix, parts in FUSED.items():
        parent, fused = fused_suffix.rsplit(".", 1)
        for name in by_name:
            m = re.match(rf"(.*\.{re.escape(parent)})\.{re.escape(parts[0])}$", name)
            if not m:
                continue
            part_schemes = {by_name[f"{m.group(1)}.{p}"] for p in parts}
            assert len(part_schemes) == 1, (name, part_schemes)
            assert vllm_weights(cfg, f"{m.group(1)}.{fused}") == part_schemes.pop()
            checked += 1
    assert checked >= 48 + 12 + 1  # every layer's fused projections, at least


def test_ple_table_is_ignored_and_unquantized(full):
    cfg = vllm_config(full.fixed.quantization_config)
    (table,) = ple_table_modules(full.fixed)
    prefix = runtime_name(table)
    assert prefix == "language_model.model.layers.1.ple.ple_embedding.ngram_embedding"
    # what nvidia/ngram_embedding.py asks: get_scheme_dict(None, prefix) is None -> unquantized
    assert cfg.get_scheme_dict(None, layer_name=prefix) is None
    assert should_ignore_layer(prefix, ignore=cfg.ignore, fused_mapping=cfg.packed_modules_mapping)


def test_fix_is_idempotent_on_the_full_checkpoint(full):
    again = plan_fix(full.fixed)
    assert again.changes == {}
    assert check(full.fixed).findings[0].status == "ok"


# ---------------------------------------------------------------- sampling keys


def diff_sampling_param(model_dir) -> dict:
    """vLLM's ModelConfig.get_diff_sampling_param with --generation-config MODEL_DIR."""
    cfg = types.SimpleNamespace(
        generation_config=str(model_dir),
        trust_remote_code=False,
        code_revision=None,
        config_format="auto",
        hf_token=None,
        override_generation_config={},
    )
    cfg.try_get_generation_config = types.MethodType(ModelConfig.try_get_generation_config, cfg)
    return ModelConfig.get_diff_sampling_param(cfg)


def test_vllm_reads_the_restored_sampling_keys(tmp_path):
    write_skeleton(tmp_path / "tiny", "tiny")
    assert diff_sampling_param(tmp_path / "tiny") == {}  # the shipped defect, per vLLM
    model = read_model_facts(tmp_path / "tiny")
    sampling = parse_sampling(["temperature=0.6", "top_p=0.95", "top_k=20"])
    apply_fix(plan_fix(model, sampling))
    assert diff_sampling_param(tmp_path / "tiny") == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
    }
