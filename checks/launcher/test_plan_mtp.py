"""The MTP drafter's fit on the last PP rank (plan/mtp.py, issue 16), from the
full skeleton's real headers."""

from __future__ import annotations

from flashnext.plan.mtp import fit_mtp, int4_bytes, mtp_needs
from flashnext.units import GIB

CONTEXT = 4 * 262_144  # max_num_seqs x max_model_len of the 3x3090 profile


def needs(model):
    found = mtp_needs(model.tensor_bytes_by_class(), model.text_config)
    assert found is not None
    return found


def test_needs_are_the_checkpoints_mtp_layer(full_model):
    n = needs(full_model)
    # SPEC / issue 16: the MTP layer is 4.86 GiB, of which 4.69 GiB BF16 experts.
    assert round((n.layer_bytes + n.other_bytes) / GIB, 2) == 4.86
    assert round(n.routed_expert_bytes / GIB, 2) == 4.69
    # Its own BF16 embedding under PP>1: 248,320 x 2560 x 2 bytes.
    assert n.embed_bytes == 248_320 * 2560 * 2
    # One QSA layer's K/V (2 heads x 256 x K,V x BF16) plus its pooled indexer key.
    assert n.kv_bytes_per_token == 2 * 256 * 2 * 2 + 128 * 2 // 4


def test_int4_requant_is_a_quarter_plus_scales():
    assert int4_bytes(256) == 64 + 2  # 128 weights: 64 bytes packed, one BF16 scale
    assert int4_bytes(5_033_164_800) == 1_258_291_200 + 39_321_600


def test_shipped_plan_has_no_room_and_says_what_is_missing(full_model):
    n = needs(full_model)
    # Rank 2's headroom in the shipped 3x3090 plan (18,503,960 bytes).
    fit = fit_mtp(n, rank=2, headroom_bytes=18_503_960, tokens=CONTEXT, int4_experts=True)
    assert not fit.fits and fit.max_context_tokens == 0
    assert "weights alone need 2.56 GiB" in fit.reason and "INT4" in fit.reason
    bf16 = fit_mtp(n, rank=2, headroom_bytes=18_503_960, tokens=CONTEXT, int4_experts=False)
    assert "weights alone need 6.04 GiB" in bf16.reason


def test_room_for_weights_but_not_the_kv_names_the_context_that_would_fit(full_model):
    n = needs(full_model)
    weights = int4_bytes(n.routed_expert_bytes) + (n.layer_bytes - n.routed_expert_bytes)
    weights += n.other_bytes + n.embed_bytes
    room = weights + 100_000 * n.kv_bytes_per_token
    fit = fit_mtp(n, rank=2, headroom_bytes=room, tokens=CONTEXT, int4_experts=True)
    assert not fit.fits and fit.max_context_tokens == 100_000
    assert "K/V stays in VRAM" in fit.reason
    enough = fit_mtp(n, rank=2, headroom_bytes=room, tokens=100_000, int4_experts=True)
    assert enough.fits and enough.to_json()["needed_bytes"] == room


def test_no_mtp_tensors_means_no_drafter(full_model):
    body = {k: v for k, v in full_model.tensor_bytes_by_class().items() if not k.startswith("mtp.")}
    assert mtp_needs(body, full_model.text_config) is None
