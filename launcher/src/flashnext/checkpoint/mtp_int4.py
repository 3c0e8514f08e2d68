"""The checkpoint's MTP experts as INT4 W4A16 (issue 16): `flashnext checkpoint mtp-int4`.

The shipped MTP layer keeps its 512 routed experts in BF16 (4.69 GiB), more
than the last PP rank can hold (plan/mtp.py). This writes them the way the
model's other experts are stored: compressed-tensors pack-quantized INT4,
symmetric, group 128, round to nearest with compressed-tensors' own rule for
symmetric INT (scale = max|w| / 7.5 per group, q = clamp(round(w / scale),
-8, 7); the packing is its `pack_to_int32`), the BF16 scale rounded up so
that no weight is off by more than half a step. Then:

1. one new shard, `mtp-int4.safetensors` (about 1.4 GiB): the MTP layer's
   tensors, its routed experts INT4, written beside and renamed into place;
2. `model.safetensors.index.json` names it instead of the MTP shards, which
   are renamed `*.bf16-mtp` (byte for byte; out of the `*.safetensors` that
   vLLM and this launcher read);
3. config.json: `ignore` keeps the MTP layer out of quantization except its
   routed experts, and the config groups' targets are derived again from what
   the tensors store (`checkpoint fix`'s derivation, verified by the same
   emulation `checkpoint check` runs).

The index and config.json as they were are kept as `*.bf16-mtp` too:
renaming the four kinds of file back restores the BF16 layer. Rerunning
after an interruption finishes the job; after success it changes nothing.

Runs in the pinned vLLM env (torch, safetensors, compressed-tensors):
`ENV/venv/bin/python -m flashnext.checkpoint.mtp_int4 MODEL_DIR` with the
launcher on PYTHONPATH; the CLI command does that.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from flashnext.atomic import write_text_atomic
from flashnext.checkpoint.errors import CheckpointError
from flashnext.checkpoint.fix import fixed_quantization_config
from flashnext.facts.model import read_model_facts

NEW_SHARD = "mtp-int4.safetensors"
BACKUP_SUFFIX = ".bf16-mtp"
INDEX = "model.safetensors.index.json"
EXPERT_WEIGHT = re.compile(r"^mtp\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
# What the shipped (and `checkpoint fix`ed) config ignores for MTP, and what it
# becomes: every MTP module but the routed experts.
MTP_IGNORE = r"re:^mtp\..*"
MTP_IGNORE_BUT_EXPERTS = r"re:^mtp\.(?!layers\.\d+\.mlp\.experts\.\d+\.).*"
BITS, GROUP = 4, 128
Q_MIN, Q_MAX = -(1 << (BITS - 1)), (1 << (BITS - 1)) - 1


def quantize(weight):
    """BF16 [out, in] -> (packed int32 [out, in/8], BF16 scale [out, in/GROUP])."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out_features, in_features = weight.shape
    if in_features % GROUP:
        raise CheckpointError(f"in_features {in_features} is not a multiple of {GROUP}")
    w = weight.float().reshape(out_features, in_features // GROUP, GROUP)
    scale = w.abs().amax(dim=2, keepdim=True) / ((Q_MAX - Q_MIN) / 2)
    # The stored scale is BF16. Rounded to nearest it can fall below max|w| / 7.5,
    # and the group's largest weight would then clamp at 7 with more than half a
    # step of error; nudged up by one BF16 spacing (2^-7) first, it never does.
    scale = (scale * (1 + 2**-7)).to(torch.bfloat16).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(w / safe), Q_MIN, Q_MAX).to(torch.int8)
    packed = pack_to_int32(q.reshape(out_features, in_features), BITS)
    return packed, scale.reshape(out_features, -1).to(torch.bfloat16)


# The same weights by tensor class (the expert number folded to `*`).
EXPERT_WEIGHT_CLASS = re.compile(
    r"^(mtp\.layers\.\d+\.mlp\.experts\.\*\.(?:gate|up|down)_proj)\.weight$"
)
SHAPE_BYTES = 2 * 8  # weight_shape: the [out, in] of one weight, int64


def int4_byte_classes(bytes_by_class: dict[str, int], num_experts: int) -> dict[str, int]:
    """The checkpoint's bytes by tensor class (facts.schema.tensor_class) as this writer
    leaves them, without writing: each BF16 expert weight class becomes its packed
    INT4 (a quarter of the bytes), its BF16 scales (one per GROUP weights) and its
    shapes. What the planner and the README figures see after `mtp-int4`."""
    out: dict[str, int] = {}
    for name, nbytes in bytes_by_class.items():
        m = EXPERT_WEIGHT_CLASS.match(name)
        if m is None:
            out[name] = nbytes
            continue
        weights = nbytes // 2
        out[f"{m[1]}.weight_packed"] = weights // 2
        out[f"{m[1]}.weight_scale"] = weights // GROUP * 2
        out[f"{m[1]}.weight_shape"] = num_experts * SHAPE_BYTES
    return out


def _say(msg: str) -> None:
    print(f"mtp-int4: {msg}", file=sys.stderr, flush=True)


def _write_shard(root: Path, files: list[str], weight_map: dict[str, str]) -> dict[str, Any]:
    """Every tensor of `files` into NEW_SHARD, the routed experts as INT4."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out: dict[str, Any] = {}
    experts = sum(1 for n, f in weight_map.items() if f in files and EXPERT_WEIGHT.match(n))
    done, step = 0, max(experts // 10, 1)
    for file in files:
        with safe_open(str(root / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), no __iter__)
                tensor = f.get_tensor(name)
                if not EXPERT_WEIGHT.match(name):
                    out[name] = tensor
                    continue
                if tensor.dtype != torch.bfloat16 or tensor.ndim != 2:
                    shape = tuple(tensor.shape)
                    raise CheckpointError(f"{name}: {tensor.dtype} {shape}, not BF16 2-D")
                packed, scale = quantize(tensor)
                module = name[: -len(".weight")]
                out[f"{module}.weight_packed"] = packed
                out[f"{module}.weight_scale"] = scale
                out[f"{module}.weight_shape"] = torch.tensor(list(tensor.shape), dtype=torch.int64)
                done += 1
                if done % step == 0 or done == experts:
                    _say(f"quantized {done}/{experts} expert weights")
    partial = root / f".{NEW_SHARD}.partial"
    save_file(out, str(partial), metadata={"format": "pt"})
    partial.replace(root / NEW_SHARD)
    return out


def _update_config(root: Path) -> list[str]:
    """config.json: MTP ignored but its routed experts, targets derived from the
    tensors now stored (verified before it is written, then written once)."""
    model = read_model_facts(root)
    qcfg = copy.deepcopy(model.quantization_config or {})
    ignore = list(qcfg.get("ignore") or [])
    if MTP_IGNORE not in ignore and MTP_IGNORE_BUT_EXPERTS not in ignore:
        raise CheckpointError(
            f"quantization_config.ignore lacks {MTP_IGNORE!r} (the MTP layer as shipped, "
            "BF16); this writer knows only that layout"
        )
    qcfg["ignore"] = [MTP_IGNORE_BUT_EXPERTS if p == MTP_IGNORE else p for p in ignore]
    narrowed = copy.copy(model)
    object.__setattr__(narrowed, "quantization_config", qcfg)
    fixed, notes = fixed_quantization_config(narrowed)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = fixed
    write_text_atomic(config_path, json.dumps(config, indent=2) + "\n")
    return notes


def _mtp_files(weight_map: dict[str, str]) -> list[str]:
    """The shards holding the BF16 MTP experts; each must hold MTP tensors only."""
    files = sorted({f for n, f in weight_map.items() if EXPERT_WEIGHT.match(n)})
    for file in files:
        other = next(
            (n for n, f in weight_map.items() if f == file and not n.startswith("mtp.")), None
        )
        if other:
            raise CheckpointError(
                f"{file} holds {other} beside the MTP layer; this writer moves whole MTP "
                "shards aside and knows no other layout"
            )
    return files


def _finish(root: Path) -> None:
    """Move the BF16 MTP shards aside (named by the index as it was), then the config."""
    backup_index = root / f"{INDEX}{BACKUP_SUFFIX}"
    old_map = json.loads(backup_index.read_text())["weight_map"]
    for file in _mtp_files(old_map):
        if (root / file).exists():
            (root / file).replace(root / f"{file}{BACKUP_SUFFIX}")
    for note in _update_config(root):
        _say(note)


def run(model_dir: str) -> int:
    root = Path(model_dir)
    index_path = root / INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{index_path} is missing: this writer updates a sharded checkpoint")
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = index["weight_map"]
    if NEW_SHARD in weight_map.values():  # written before: finish what may be left
        _finish(root)
        _say(f"{NEW_SHARD} is in place; the checkpoint is consistent")
        return 0
    read_model_facts(root)  # the checkpoint as it is must read cleanly first
    files = _mtp_files(weight_map)
    if not files:
        raise CheckpointError(
            "no BF16 MTP expert weights (mtp.layers.N.mlp.experts.E.*) in the index"
        )
    for name in (INDEX, "config.json"):  # the way back
        shutil.copy2(root / name, root / f"{name}{BACKUP_SUFFIX}")
    _say(f"{', '.join(files)}: the MTP layer, its experts as INT4 g{GROUP}, into {NEW_SHARD}")
    written = _write_shard(root, files, weight_map)
    kept = {n: f for n, f in weight_map.items() if f not in files}
    kept.update(dict.fromkeys(written, NEW_SHARD))
    index["weight_map"] = dict(sorted(kept.items()))
    write_text_atomic(index_path, json.dumps(index, indent=2) + "\n")
    _finish(root)
    _say(f"done: {NEW_SHARD}; the BF16 shards, index and config are kept as *{BACKUP_SUFFIX}")
    return 0


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m flashnext.checkpoint.mtp_int4 MODEL_DIR", file=sys.stderr)
        return 2
    try:
        return run(sys.argv[1])
    except CheckpointError as exc:
        print(f"mtp-int4: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
