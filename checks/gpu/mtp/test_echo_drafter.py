"""checks/gpu/mtp/echo_drafter.py on a real sharded BF16 checkpoint with an MTP layer's names."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tiny"))

import echo_drafter  # noqa: E402
from bf16_checkpoint import bf16_exact, read_bf16, write_checkpoint  # noqa: E402
from checkpoint_copy import CheckpointEditError  # noqa: E402

HC, H, LOWRANK = 4, 4, 2
TARGET_MIXER = "model.language_model.hyper_connection_mixer."
MIXER_SHAPES = {
    "hc_norm.weight": (HC * H,),
    "input_mix_weight_down.weight": (LOWRANK, HC * H),
    "input_mix_weight_up.weight": (HC * H, LOWRANK),
}


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)

    def rand(shape):
        return bf16_exact(rng.standard_normal(shape))

    target = {TARGET_MIXER + k: rand(s) for k, s in MIXER_SHAPES.items()}
    target["lm_head.weight"] = rand((16, H))
    mtp = {"mtp.hyper_connection_mixer." + k: rand(s) for k, s in MIXER_SHAPES.items()}
    mtp |= {
        "mtp.pre_fc_norm_hidden.weight": rand((HC * H,)),
        "mtp.fc_hidden.weight": rand((H, H)),
        "mtp.fc_embedding.weight": rand((H, H)),
        "mtp.layers.0.self_attn.o_proj.weight": rand((H, 2 * H)),
    }
    src = write_checkpoint(tmp_path / "src", {"a.safetensors": target, "b.safetensors": mtp})
    (src / "config.json").write_text("{}")
    return src, target, mtp


def test_the_drafter_gets_the_targets_mixer_a_plain_norm_and_a_scaled_identity(
    checkpoint, tmp_path
):
    src, target, mtp = checkpoint
    dst = echo_drafter.write_echo_drafter(src, tmp_path / "dst", gain=4.0)

    for key in MIXER_SHAPES:
        assert np.array_equal(
            read_bf16(dst / "b.safetensors", "mtp.hyper_connection_mixer." + key),
            target[TARGET_MIXER + key],
        )
    assert not read_bf16(dst / "b.safetensors", "mtp.pre_fc_norm_hidden.weight").any()
    assert np.array_equal(read_bf16(dst / "b.safetensors", "mtp.fc_hidden.weight"), 4.0 * np.eye(H))
    # The MTP layer itself and the embedding branch are left as they were.
    for name in ("mtp.fc_embedding.weight", "mtp.layers.0.self_attn.o_proj.weight"):
        assert np.array_equal(read_bf16(dst / "b.safetensors", name), mtp[name])
    # The target's shard is byte for byte the source's.
    assert (dst / "a.safetensors").read_bytes() == (src / "a.safetensors").read_bytes()
    record = json.loads((dst / echo_drafter.RECORD).read_text())
    assert record["gain"] == 4.0
    assert record["changed"] == sorted(
        ["mtp.fc_hidden.weight", "mtp.pre_fc_norm_hidden.weight"]
        + ["mtp.hyper_connection_mixer." + k for k in MIXER_SHAPES]
    )


def _final_mix(streams, norm_w, down, up):
    """The final mixer's math (hc_combine_norm with no pending block, then
    hc_gate_mix): per-stream GemmaRMSNorm, a low-rank SiLU gate, the gated
    mean over the streams. A float64 restatement of ops/hc.py, to show the
    property the copy relies on, not a stand-in for vLLM in any check."""
    x = streams.reshape(HC, H)
    xn = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * (1 + norm_w.reshape(HC, H))
    lowrank = down @ xn.reshape(-1)
    gate = up @ (lowrank / (1 + np.exp(-lowrank)))
    return ((1 / (1 + np.exp(-gate.reshape(HC, H)))) * xn).mean(axis=0)


def test_a_mixer_that_renormalizes_each_stream_ignores_a_per_stream_scale(checkpoint):
    # Why the echo works: G x (state / its RMS) reaches the target's mixer
    # weights as the target's own state, up to one positive scale per stream.
    _, target, _ = checkpoint
    w = [target[TARGET_MIXER + k].astype(np.float64) for k in MIXER_SHAPES]
    state = np.random.default_rng(2).standard_normal(HC * H)
    scaled = (state.reshape(HC, H) * np.array([[3.0], [0.5], [7.0], [1.0]])).reshape(-1)
    assert np.allclose(_final_mix(state, *w), _final_mix(scaled, *w), rtol=1e-5)
    assert not np.allclose(_final_mix(state, *w), _final_mix(state[::-1].copy(), *w))


@pytest.mark.parametrize("gain", [0.0, -1.0])
def test_a_gain_that_is_not_positive_is_refused(checkpoint, tmp_path, gain):
    src, _, _ = checkpoint
    with pytest.raises(CheckpointEditError, match="positive gain"):
        echo_drafter.write_echo_drafter(src, tmp_path / "dst", gain)
    assert not (tmp_path / "dst").exists()


def test_a_checkpoint_without_an_mtp_layer_says_so_without_a_traceback(tmp_path, capsys):
    src = write_checkpoint(
        tmp_path / "src", {"a.safetensors": {"lm_head.weight": np.zeros((4, 4), np.float32)}}
    )
    assert echo_drafter.main([str(src), str(tmp_path / "dst"), "--gain", "4"]) == 1
    err = capsys.readouterr().err
    assert "no mtp.pre_fc_norm_hidden.weight" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
