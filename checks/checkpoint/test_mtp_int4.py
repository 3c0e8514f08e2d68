"""`flashnext checkpoint mtp-int4` (checkpoint/mtp_int4.py, issue 16) on a real checkpoint's layout.

The tiny skeleton (the full model's tensor names and dtypes at toy size,
`--fixed-metadata`) gets seeded random BF16 MTP experts, then the writer runs
as the CLI runs it: a subprocess of this (the pinned vLLM env's) python.
Checked against compressed-tensors' own unpacker and vLLM 0.33.0's own
scheme resolution for the MTP drafter (Qwen4ExpMTP, the quant config
configured as its loader does): INT4 g128 for the experts, unquantized for
the rest of the layer; every expert dequantizes to within round-to-nearest
error of its BF16 weight; the original shards are untouched; rerunning
changes nothing; `checkpoint check` passes.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from flashnext.checkpoint.mtp_int4 import EXPERT_WEIGHT, NEW_SHARD, int4_byte_classes  # noqa: E402
from flashnext.facts.model import read_model_facts  # noqa: E402
from flashnext.skeleton import write_skeleton  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (  # noqa: E402
    CompressedTensorsConfig,
)
from vllm.model_executor.model_loader.utils import configure_quant_config  # noqa: E402
from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def launcher(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    src = REPO / "launcher" / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp") / "ckpt"
    write_skeleton(root, "tiny", fixed_metadata=True)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    gen = torch.Generator().manual_seed(0)
    originals = {}
    for file in sorted({f for n, f in index["weight_map"].items() if EXPERT_WEIGHT.match(n)}):
        tensors = load_file(str(root / file))
        for name in tensors:
            if EXPERT_WEIGHT.match(name):
                # Heavy-tailed like trained weights: every group has its own range.
                w = torch.randn(tensors[name].shape, generator=gen) * 0.02
                w *= torch.rand(w.shape[0], 1, generator=gen) * 3
                tensors[name] = w.to(torch.bfloat16)
                originals[name] = tensors[name]
        save_file(tensors, str(root / file), metadata={"format": "pt"})
    before = {p.name: sha256(p) for p in root.glob("model-*.safetensors")}
    proc = launcher("-m", "flashnext.checkpoint.mtp_int4", str(root), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return root, originals, before, proc


def test_every_expert_dequantizes_within_rounding_error(written):
    root, originals, _, _ = written
    assert len(originals) == 8 * 3  # the tiny model's 8 experts, gate/up/down
    with safe_open(str(root / NEW_SHARD), framework="pt") as f:
        for name, w in originals.items():
            module = name[: -len(".weight")]
            packed = f.get_tensor(f"{module}.weight_packed")
            scale = f.get_tensor(f"{module}.weight_scale")
            shape = f.get_tensor(f"{module}.weight_shape")
            out_f, in_f = w.shape
            assert shape.tolist() == [out_f, in_f]
            assert packed.dtype == torch.int32 and tuple(packed.shape) == (out_f, in_f // 8)
            assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (out_f, in_f // 128)
            q = unpack_from_int32(packed, 4, torch.Size([out_f, in_f]))
            assert int(q.min()) >= -8 and int(q.max()) <= 7
            s = scale.float().repeat_interleave(128, dim=1)
            err = (q.float() * s - w.float()).abs()
            # Round to nearest: at most half a step, plus float slack.
            assert bool((err <= s / 2 + 1e-6).all()), name
            assert float(err.mean()) > 0  # real values, really rounded


def test_the_planners_int4_byte_classes_are_what_the_writer_wrote(written, tmp_path):
    """int4_byte_classes (what the planner and the README figures use for an INT4
    drafter) against the written checkpoint's own headers."""
    root = written[0]
    before = tmp_path / "before"
    write_skeleton(before, "tiny", fixed_metadata=True)  # the same inventory, BF16 experts
    shipped = read_model_facts(before)
    experts = int(shipped.text_config["num_experts"])
    expected = int4_byte_classes(shipped.tensor_bytes_by_class(), experts)
    assert read_model_facts(root).tensor_bytes_by_class() == expected
    assert expected != shipped.tensor_bytes_by_class()


def test_index_names_the_new_shard_and_the_old_ones_are_kept_byte_for_byte(written):
    root, originals, before, _ = written
    old = json.loads((root / "model.safetensors.index.json.bf16-mtp").read_text())["weight_map"]
    mtp_files = {f for n, f in old.items() if EXPERT_WEIGHT.match(n)}
    now = {p.name: sha256(p) for p in root.glob("model-*.safetensors")}
    assert now == {f: h for f, h in before.items() if f not in mtp_files}
    for f in mtp_files:  # moved aside, unchanged
        assert sha256(root / f"{f}.bf16-mtp") == before[f]
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(EXPERT_WEIGHT.match(n) for n in weight_map)
    assert not set(weight_map.values()) & mtp_files
    # Every other MTP tensor moved with the layer into the new shard.
    others = {n for n, f in old.items() if f in mtp_files and not EXPERT_WEIGHT.match(n)}
    assert others and all(weight_map[n] == NEW_SHARD for n in others)
    for name in originals:
        module = name[: -len(".weight")]
        for suffix in ("weight_packed", "weight_scale", "weight_shape"):
            assert weight_map[f"{module}.{suffix}"] == NEW_SHARD
    assert (root / "config.json.bf16-mtp").is_file()


def drafter_config(root: Path) -> tuple[CompressedTensorsConfig, int]:
    config = json.loads((root / "config.json").read_text())
    cfg = CompressedTensorsConfig.from_config(copy.deepcopy(config["quantization_config"]))
    configure_quant_config(cfg, Qwen4ExpMTP)
    cfg._add_fused_moe_to_target_scheme_map()
    return cfg, int(config["text_config"]["num_hidden_layers"])


class RoutedExperts(torch.nn.Module):
    pass


class ColumnParallelLinear(torch.nn.Module):
    """Only the class name matters to vLLM's target matching."""


def test_vllm_reads_the_drafters_experts_as_int4_g128_and_the_rest_unquantized(written):
    root = written[0]
    cfg, first = drafter_config(root)
    # nvidia/mtp.py builds the drafter's layer under prefix mtp.layers.<num_hidden_layers + i>.
    layer = f"mtp.layers.{first}"
    scheme = cfg.get_scheme_dict(RoutedExperts(), layer_name=f"{layer}.mlp.experts.0.gate_proj")
    w = scheme["weights"]
    assert (w.num_bits, w.group_size, w.symmetric, w.strategy) == (4, 128, True, "group")
    for plain in (f"{layer}.self_attn.qkv_proj", f"{layer}.mlp.shared_expert.gate_up_proj",
                  "mtp.fc_embedding", "mtp.fc_hidden"):  # fmt: skip
        assert cfg.get_scheme_dict(ColumnParallelLinear(), layer_name=plain) is None, plain


def test_cli_rerun_changes_nothing_and_checkpoint_check_passes(written):
    root = written[0]
    state = {p.name: sha256(p) for p in root.iterdir() if p.is_file()}
    # This time as users run it: the CLI, with this env (ENV/venv/bin/python) named.
    env_dir = str(Path(sys.executable).parents[2])
    again = launcher(
        "-m", "flashnext", "checkpoint", "mtp-int4", "--model", str(root), "--vllm-env", env_dir,
        cwd=REPO,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert "is in place" in again.stderr
    assert {p.name: sha256(p) for p in root.iterdir() if p.is_file()} == state
    check = launcher(
        "-m", "flashnext", "checkpoint", "check", "--model", str(root), "--json", cwd=REPO
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
