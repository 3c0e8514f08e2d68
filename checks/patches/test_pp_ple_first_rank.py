"""Patch 0001: PP>1 with PLE, accepted when every PLE layer lands on PP rank 0.

Both guards are exercised with the real vLLM 0.33.0 code: the config check
(`EngineArgs.create_engine_config()`) and the worker's `Qwen4ExpModelState`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_qwen4_exp import NUM_LAYERS, PLE_LAYER, engine_args, write_tiny_qwen4_exp

PATCH = "0001-qwen4-exp-pp-ple-on-first-rank.patch"
# Rank 0 keeps one layer; PLE's layer 1 moves to rank 1.
BAD_PARTITION = "1,3,3"
REFUSAL = "PLE layer 1 (ple_layer_ids entry 2) lands on pipeline rank 1 of 3"
FIX = (
    "Give rank 0 at least 2 layers with VLLM_PP_LAYER_PARTITION,"
    " e.g. VLLM_PP_LAYER_PARTITION=2,3,2."
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen4_exp(tmp_path_factory.mktemp("tiny-qwen4-exp"))


@pytest.fixture(scope="module")
def pp1_config(tiny_dir: Path):
    """A PP=1 config (accepted by stock too), for the worker-side guard."""
    return engine_args(tiny_dir).create_engine_config()


def test_default_split_puts_ple_on_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.utils import get_pp_indices

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    start, end = get_pp_indices(NUM_LAYERS, 0, 3)
    assert start <= PLE_LAYER < end
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", BAD_PARTITION)
    assert get_pp_indices(NUM_LAYERS, 1, 3) == (1, 4)


@pytest.mark.proves(PATCH, raises=NotImplementedError)
@pytest.mark.parametrize("partition", [None, "3,2,2"])
def test_pp3_config_accepted_with_ple_on_rank_0(
    tiny_dir: Path, partition: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if partition is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)

    config = engine_args(tiny_dir, pipeline_parallel_size=3).create_engine_config()

    assert config.parallel_config.pipeline_parallel_size == 3
    assert config.model_config.hf_text_config.ple_layer_ids == [PLE_LAYER + 1]


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_pp3_config_refuses_partition_moving_ple_off_rank_0(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", BAD_PARTITION)

    with pytest.raises(NotImplementedError) as excinfo:
        engine_args(tiny_dir, pipeline_parallel_size=3).create_engine_config()

    message = str(excinfo.value)
    assert REFUSAL in message
    assert "rank 0 holds layers 0-0 with this split" in message
    assert FIX in message


def _model_state(vllm_config, pp_size: int):
    import torch
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState

    # The worker of a PP=3 engine gets this config; stock's engine never does.
    vllm_config.parallel_config.pipeline_parallel_size = pp_size
    try:
        return Qwen4ExpModelState(vllm_config, torch.nn.Module(), None, torch.device("cpu"))
    finally:
        vllm_config.parallel_config.pipeline_parallel_size = 1


@pytest.mark.proves(PATCH, raises=RuntimeError)
def test_model_state_accepts_pp3_with_ple_on_rank_0(
    pp1_config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)

    state = _model_state(pp1_config, 3)

    assert state.uses_ngram_embedding
    assert tuple(state.ngram_context.shape) == (pp1_config.scheduler_config.max_num_seqs, 2)


@pytest.mark.proves(PATCH, raises=AssertionError)
def test_model_state_refuses_ple_off_rank_0(pp1_config, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", BAD_PARTITION)

    with pytest.raises(RuntimeError) as excinfo:
        _model_state(pp1_config, 3)

    assert REFUSAL in str(excinfo.value)
    assert FIX in str(excinfo.value)
