"""Patch 0031: the MTP drafter's embedding and routed experts can be offloaded.

The real target (`Qwen4ExpForConditionalGeneration`) and the real drafter
(`Qwen4ExpMTP`) of the tiny qwen4_exp with one MTP layer are built, on the
meta device, with a recording offloader installed as the process's offloader
(`vllm.model_executor.offloader.set_offloader`), the way the model runner
installs the UVA offloader for `--cpu-offload-gb`. The recorder subclasses
vLLM's `BaseOffloader` and keeps what `wrap_modules` was handed and under
which prefix; it stands in for `UVAOffloader` only because UVA needs a CUDA
device. Which parameters the kit's `--cpu-offload-params` segments select
is then computed with UVAOffloader's rule (uva.py `_maybe_offload_to_cpu`:
the segment, dot-delimited, inside prefix + name).

Stock: the drafter builds its embedding and MTP layer outside make_layers,
so the offloader never sees them and the segments select nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tiny_qwen4_exp import NUM_LAYERS, build_model, engine_args, write_tiny_qwen4_exp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "launcher" / "src"))

from flashnext.plan.mtp import drafter_offload_params  # noqa: E402

PATCH = "0031-qwen4-exp-mtp-offloadable.patch"
MTP_LAYERS = 1


class DrafterNotOffloadable(Exception):
    """The offloader never saw the drafter's embedding or experts (stock)."""


def _recording_offloader():
    from vllm.model_executor.offloader import BaseOffloader

    class RecordingOffloader(BaseOffloader):
        def __init__(self) -> None:
            self.wrapped: list[tuple[str, object]] = []

        def wrap_modules(self, modules_generator, prefix: str = ""):
            modules = list(modules_generator)
            self.wrapped += [(prefix, module) for module in modules]
            return modules

    return RecordingOffloader()


def _selected(wrapped, segments) -> dict[str, object]:
    """Parameters UVAOffloader would offload: full name -> parameter."""
    chosen = {}
    for prefix, module in wrapped:
        lead = f"{prefix}." if prefix else ""
        for name, param in module.named_parameters():
            if any(f".{seg}." in f".{lead}{name}." for seg in segments):
                chosen[f"{lead}{name}"] = param
    return chosen


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("tiny-qwen4-exp-mtp-offload"),
        text_overrides={"mtp_num_hidden_layers": MTP_LAYERS},
    )
    return engine_args(
        model_dir,
        engram_config={"cpu_offload": False},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()


@pytest.fixture
def recorder():
    from vllm.model_executor import offloader as offloader_module

    recording = _recording_offloader()
    offloader_module.set_offloader(recording)
    try:
        yield recording
    finally:
        offloader_module.set_offloader(None)


def _build_target_then_drafter(config):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP

    target = build_model(config)  # through make_layers, as the runner loads it
    config.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(config), torch.device("meta"):
        drafter = Qwen4ExpMTP(vllm_config=config, prefix="")
    return target, drafter


@pytest.mark.proves(PATCH, raises=DrafterNotOffloadable)
def test_the_kits_segments_select_the_drafters_experts_and_embedding_only(config, recorder) -> None:
    target, drafter = _build_target_then_drafter(config)
    segments = drafter_offload_params(NUM_LAYERS, MTP_LAYERS)

    chosen = _selected(recorder.wrapped, segments)
    if not chosen:
        raise DrafterNotOffloadable(
            f"segments {segments} select nothing of what the offloader was handed "
            f"(prefixes: {sorted({p for p, _ in recorder.wrapped})})"
        )

    # The routed experts (mlp.experts.*, as the layer names its parameters) and
    # the embedding; not the router or the shared expert, which every token
    # reads and which the experts module only aliases (named under mlp.gate,
    # mlp.shared_expert).
    inner = drafter.model
    layer_params = dict(inner.layers[0].named_parameters())
    routed = {id(p) for n, p in layer_params.items() if n.startswith("mlp.experts.")}
    assert routed and {"mlp.gate.weight", "mlp.shared_expert.down_proj.weight"} <= set(layer_params)
    want = routed | {id(p) for p in inner.embed_tokens.parameters()}
    assert {id(p) for p in chosen.values()} == want, sorted(chosen)
    # Named as --cpu-offload-params sees them: the drafter's own names.
    assert all(
        name.startswith((f"mtp.layers.{NUM_LAYERS}.mlp.experts.", "mtp.embed_tokens."))
        for name in chosen
    ), sorted(chosen)
    # The target's layers reached the offloader too (make_layers), and none of
    # their parameters is selected: the byte budget goes to the drafter alone.
    target_params = {id(p) for p in target.parameters()}
    assert any(id(p) in target_params for _, m in recorder.wrapped for p in m.parameters())
    assert not target_params & {id(p) for p in chosen.values()}


def test_without_an_offloader_the_drafter_builds_as_before(config) -> None:
    """The default NoopOffloader hands every module back unchanged."""
    from vllm.model_executor.offloader import NoopOffloader, get_offloader

    assert isinstance(get_offloader(), NoopOffloader)
    _, drafter = _build_target_then_drafter(config)
    experts = drafter.model.layers[0].mlp.experts
    assert all(p.device.type == "meta" for p in experts.parameters())
    assert drafter.model.embed_tokens.weight.shape[0] >= config.model_config.get_vocab_size()
