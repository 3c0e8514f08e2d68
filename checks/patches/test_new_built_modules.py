"""vLLM's own qwen4_exp unit tests build model states and PLE modules with
`object.__new__` (skipping `__init__`) and set only the attributes they use
(`tests/models/qwen4_exp/test_config.py`, `test_ple.py`). Attributes our
patches add in `__init__` must therefore have class-level defaults, or those
tests fail on the patched tree with AttributeError. These tests build the
same way and run on both trees (no `proves`: stock passes them too).
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import patch


def test_model_state_made_with_new_prepares_inputs_and_dummies():
    import torch
    from vllm.models.qwen4_exp.nvidia.model_state import Qwen4ExpModelState
    from vllm.v1.worker.gpu.model_states.mamba_hybrid import MambaHybridModelState

    state = object.__new__(Qwen4ExpModelState)
    state.uses_ngram_embedding = True
    state.ngram_context_len = 3
    state.ngram_eos_token_id = 7
    state.ngram_context = torch.empty((4, 3), dtype=torch.int32)
    state.ngram_context_offsets = torch.arange(-3, 0, dtype=torch.int64)
    state.ple_query_start_loc = torch.empty(5, dtype=torch.int32)
    batch = SimpleNamespace(
        num_reqs=1,
        num_reqs_after_padding=1,
        idx_mapping=torch.tensor([0]),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        input_ids=torch.tensor([5, 6]),
    )
    requests = SimpleNamespace(
        num_computed_tokens=SimpleNamespace(gpu=torch.tensor([2])),
        all_token_ids=SimpleNamespace(gpu=torch.tensor([[10, 11, 12, 13]], dtype=torch.int32)),
    )
    with patch.object(MambaHybridModelState, "prepare_inputs", return_value={}):
        inputs = state.prepare_inputs(batch, requests)
    # The two tokens before the chunk (10, 11), after one EOS of padding.
    assert inputs["ngram_context"][0].tolist() == [7, 10, 11]
    assert inputs["query_start_loc"].tolist() == [0, 2, 2, 2, 2]
    with patch.object(MambaHybridModelState, "prepare_dummy_inputs", return_value={}):
        dummy = state.prepare_dummy_inputs(num_reqs=2, num_tokens=3)
    assert dummy["query_start_loc"].tolist() == [0, 1, 3, 3, 3]
    assert bool((dummy["ngram_context"] == 7).all())


def test_ngram_embedding_made_with_new_loads_buffers_and_shards():
    import torch
    from vllm.models.qwen4_exp.nvidia.ngram_embedding import Qwen4ExpNGramEmbedding

    module = object.__new__(Qwen4ExpNGramEmbedding)
    torch.nn.Module.__init__(module)
    module.register_buffer("layer_multipliers", torch.zeros(3, dtype=torch.int64))
    module.register_buffer("ngram_heads_offsets", torch.zeros(2, dtype=torch.int64))
    module.register_buffer("ngram_heads_vocab_sizes", torch.zeros(2, dtype=torch.int64))
    table = torch.zeros(8, 2)

    def load_rows(param, rows, checkpoint_start):
        param[checkpoint_start : checkpoint_start + rows.shape[0]] = rows

    weight = SimpleNamespace(
        shape=table.shape,
        weight_loader=lambda _param, rows, checkpoint_start: load_rows(
            table, rows, checkpoint_start
        ),
    )
    module.ngram_embedding = SimpleNamespace(org_vocab_size=8, weight=weight)
    module.split_ngram_parts = 2
    shard_1 = torch.arange(8.0).view(4, 2)
    loaded = module.load_weights(
        [
            ("layer_multipliers", torch.tensor([1, 3, 5])),
            ("ngram_heads_offsets", torch.tensor([0, 4])),
            ("ngram_heads_vocab_sizes", torch.tensor([4, 4])),
            ("ngram_embedding.shard_1.weight", shard_1),
        ]
    )
    assert loaded == {
        "layer_multipliers",
        "ngram_heads_offsets",
        "ngram_heads_vocab_sizes",
        "ngram_embedding.weight",
    }
    assert module.layer_multipliers.tolist() == [1, 3, 5]
    assert torch.equal(table[4:], shard_1) and not table[:4].any()
