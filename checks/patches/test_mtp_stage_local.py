"""Patch 0030: the Qwen4Exp MTP drafter is stage-local under pipeline parallel.

The real drafter (vLLM's `Qwen4ExpMTP`, nvidia/mtp.py) is built on CPU from
the tiny qwen4_exp with one MTP layer, as PP rank r of 3 sees it (the PP group
is replayed, as in test_quant_embed_head_hc.py), and called the way both
model runners call it on the last rank: input ids, positions and the target's
hidden states, no intermediate tensors.

Two stand-ins, both device kernels with no CPU path: the MTP decoder layer
(QSA/attention + Triton hyper-connection ops) and the final mixer's
combine_and_mix (Triton). Each records what it was handed and returns a
fixed function of it, so the test sees exactly what the drafter's own
forward fed them. Embedding, pre-FC norms and fc_embedding / fc_hidden are
vLLM's own layers, run for real.
"""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
from tiny_qwen4_exp import engine_args, ensure_single_process_distributed, write_tiny_qwen4_exp

PATCH = "0030-qwen4-exp-mtp-stage-local.patch"
PP_SIZE = 3
HIDDEN = 128
HC = 4
TOKENS = [5, 7, 9, 11]


class TookPipelineBranch(Exception):
    """The drafter's forward asserted on pipeline inputs (stock's failure)."""


@pytest.fixture(scope="module")
def mtp_config(tmp_path_factory: pytest.TempPathFactory):
    model_dir = write_tiny_qwen4_exp(
        tmp_path_factory.mktemp("tiny-qwen4-exp-mtp-pp"),
        text_overrides={"mtp_num_hidden_layers": 1},
    )
    return engine_args(
        model_dir,
        dtype="float32",  # exact comparisons below
        engram_config={"cpu_offload": False},
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    ).create_engine_config()


@pytest.fixture
def pp_stage(monkeypatch: pytest.MonkeyPatch):
    """Replay rank `rank` of a `size`-rank PP group to vLLM's get_pp_group users."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.models.qwen4_exp.nvidia.mtp as mtp_module

    def set_stage(rank: int, size: int = PP_SIZE) -> None:
        group = SimpleNamespace(
            rank_in_group=rank,
            world_size=size,
            is_first_rank=rank == 0,
            is_last_rank=rank == size - 1,
            first_rank=0,
            last_rank=size - 1,
        )
        monkeypatch.setattr(parallel_state, "get_pp_group", lambda: group)
        monkeypatch.setattr(mtp_module, "get_pp_group", lambda: group)

    return set_stage


def _build_drafter(config):
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.qwen4_exp.nvidia.mtp import Qwen4ExpMTP
    from vllm.utils.torch_utils import set_default_torch_dtype

    # A config builds one model: its layers register their names in it.
    config.compilation_config.static_forward_context.clear()
    with (
        set_current_vllm_config(config),
        set_default_torch_dtype(config.model_config.dtype),
        torch.device("cpu"),
    ):
        return Qwen4ExpMTP(vllm_config=config, prefix="")


@pytest.fixture(scope="module")
def _distributed(mtp_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(mtp_config):
        ensure_single_process_distributed()


def _recording_layer():
    import torch

    class RecordingLayer(torch.nn.Module):
        """Stands in for the MTP decoder layer; keeps its inputs."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[dict] = []

        def forward(self, **kwargs):
            self.calls.append(kwargs)
            hidden = kwargs["hidden_states"]
            block_output = kwargs["prev_block_output"]
            return hidden * 2.0, block_output + 1.0, None

    return RecordingLayer()


def _recording_mixer(calls: list):
    def combine_and_mix(hidden_states, block_output, injection):
        calls.append((hidden_states, block_output, injection))
        num_tokens = hidden_states.shape[0]
        multi = hidden_states + block_output.repeat(1, HC)
        single = multi.view(num_tokens, HC, HIDDEN).sum(dim=1)
        return multi, single, None

    return combine_and_mix


def _with_standins(drafter, config):
    """Stand-ins in place, seeded weights, then vLLM's own post-load step (on
    CPU it binds the GEMM the linear layers call)."""
    import torch
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    layer = _recording_layer()
    mixer_calls: list = []
    drafter.model.layers[0] = layer
    drafter.model.hyper_connection_mixer.combine_and_mix = _recording_mixer(mixer_calls)
    gen = torch.Generator().manual_seed(0)
    for param in drafter.parameters():
        if param.is_floating_point():
            param.data.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    process_weights_after_loading(drafter, config.model_config, torch.device("cpu"))
    return layer, mixer_calls


def _inputs(seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.tensor(TOKENS)
    positions = torch.arange(len(TOKENS)) + 20
    # The target's pre-final-mixer multi stream [T, hc_count * H].
    target_hidden = torch.randn(len(TOKENS), HC * HIDDEN, generator=gen)
    return input_ids, positions, target_hidden


def _draft(drafter, input_ids, positions, hidden_states):
    """Call the drafter as the runners' speculator does on the last rank."""
    import torch

    try:
        with torch.no_grad():
            return drafter(
                input_ids=input_ids,
                positions=positions,
                hidden_states=hidden_states,
                inputs_embeds=None,
            )
    except AssertionError as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        if frame.filename.endswith("qwen4_exp/nvidia/mtp.py"):
            raise TookPipelineBranch(f"mtp.py:{frame.lineno}: {frame.line}") from err
        raise


def _reference(drafter, input_ids, hidden_states):
    """What the drafter must hand its layer: its own embedding and the target's
    hidden states, each through its pre-FC norm and projection."""
    import torch

    model = drafter.model
    with torch.no_grad():
        embeds = model.fc_embedding(model.pre_fc_norm_embedding(model.embed_tokens(input_ids)))
        hidden = model.pre_fc_norm_hidden(hidden_states)
        hidden = model.fc_hidden(hidden.view(-1, HC, HIDDEN)).flatten(-2)
    return embeds, hidden


@pytest.mark.proves(PATCH, raises=TookPipelineBranch)
def test_drafter_runs_as_the_last_of_three_stages(mtp_config, _distributed, pp_stage) -> None:
    import torch

    pp_stage(PP_SIZE - 1)
    drafter = _build_drafter(mtp_config)
    layer, mixer_calls = _with_standins(drafter, mtp_config)
    input_ids, positions, target_hidden = _inputs()

    out = _draft(drafter, input_ids, positions, target_hidden)

    # Two streams back: [T, H] for the LM head, [T, hc*H] for the next step.
    assert isinstance(out, tuple) and len(out) == 2
    sample_hidden, multi_hidden = out
    assert tuple(sample_hidden.shape) == (len(TOKENS), HIDDEN)
    assert tuple(multi_hidden.shape) == (len(TOKENS), HC * HIDDEN)
    # The layer got this rank's own embedding of the draft's input ids and the
    # target's hidden states, projected; nothing from another stage.
    want_embeds, want_hidden = _reference(drafter, input_ids, target_hidden)
    (call,) = layer.calls
    assert torch.equal(call["prev_block_output"], want_embeds)
    assert torch.equal(call["hidden_states"], want_hidden)
    assert torch.equal(call["positions"], positions)
    # Finished with the final mixer, on the layer's outputs.
    (mixed,) = mixer_calls
    assert torch.equal(mixed[0], want_hidden * 2.0)
    assert torch.equal(mixed[1], want_embeds + 1.0)
    assert torch.equal(
        sample_hidden, (mixed[0] + mixed[1].repeat(1, HC)).view(-1, HC, HIDDEN).sum(1)
    )

    # Same drafter, same inputs, as a PP=1 engine sees it: the same answer.
    pp_stage(0, size=1)
    pp1_sample, pp1_multi = _draft(drafter, input_ids, positions, target_hidden)
    assert torch.equal(pp1_sample, sample_hidden) and torch.equal(pp1_multi, multi_hidden)


@pytest.mark.proves(PATCH, raises=AssertionError)
@pytest.mark.parametrize("rank", [0, 1])
def test_drafter_is_built_only_on_the_last_stage(
    mtp_config, _distributed, pp_stage, rank: int
) -> None:
    pp_stage(rank)
    try:
        drafter = _build_drafter(mtp_config)
    except RuntimeError as err:
        refusal = str(err)
    else:
        drafter_params = sum(p.numel() for p in drafter.parameters())
        refusal = f"built {drafter_params} parameters on rank {rank} of {PP_SIZE}"
    assert f"built on pipeline rank {rank} of {PP_SIZE}" in refusal, refusal
    assert "last pipeline stage only" in refusal


def test_last_stage_build_equals_pp1_build(mtp_config, _distributed, pp_stage) -> None:
    """Rank 2 of 3 gets every weight a PP=1 drafter has, lm_head included."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.utils import PPMissingLayer

    pp_stage(0, size=1)
    pp1 = {n: tuple(p.shape) for n, p in _build_drafter(mtp_config).named_parameters()}
    pp_stage(PP_SIZE - 1)
    last = _build_drafter(mtp_config)

    assert {n: tuple(p.shape) for n, p in last.named_parameters()} == pp1
    assert isinstance(last.lm_head, ParallelLMHead)
    assert not any(isinstance(m, PPMissingLayer) for m in last.modules())
    for name in (
        "model.embed_tokens.weight",
        "model.fc_embedding.weight",
        "model.fc_hidden.weight",
    ):
        assert name in pp1, name


def test_pp1_drafter_forward(mtp_config, _distributed, pp_stage) -> None:
    """PP=1 (both trees): the layer gets the embedding and projected target hidden."""
    import torch

    pp_stage(0, size=1)
    drafter = _build_drafter(mtp_config)
    layer, _ = _with_standins(drafter, mtp_config)
    input_ids, positions, target_hidden = _inputs(seed=1)

    sample_hidden, multi_hidden = _draft(drafter, input_ids, positions, target_hidden)

    want_embeds, want_hidden = _reference(drafter, input_ids, target_hidden)
    (call,) = layer.calls
    assert torch.equal(call["prev_block_output"], want_embeds)
    assert torch.equal(call["hidden_states"], want_hidden)
    assert tuple(multi_hidden.shape) == (len(TOKENS), HC * HIDDEN)
    assert tuple(sample_hidden.shape) == (len(TOKENS), HIDDEN)
