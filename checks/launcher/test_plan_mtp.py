"""The MTP drafter's fit on the last PP rank (plan/mtp.py, issue 16), from the
full skeleton's real headers, and what the plan and the argv make of it."""

from __future__ import annotations

import dataclasses
import json

from flashnext.plan.command import plan_json, serve_command
from flashnext.plan.mtp import fit_mtp, int4_bytes, mtp_needs
from flashnext.plan.planner import PlanOptions, plan
from flashnext.profiles import MtpSpec, available_profiles
from flashnext.units import GIB
from lead_fixtures import _gpus, base_facts

PROFILE = available_profiles()["3x3090"]
OPTIONS = PlanOptions(model_dir="/models/Qwen3.8-Flash-Next", table_path="/nvme/ple.bin")

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


def test_shipped_checkpoint_has_no_room_and_names_the_int4_writer(full_model):
    n = needs(full_model)
    assert n.experts_bf16
    # Rank 2's headroom in the shipped 3x3090 plan (18,503,960 bytes).
    fit = fit_mtp(n, rank=2, headroom_bytes=18_503_960, tokens=CONTEXT)
    assert not fit.fits and fit.max_context_tokens == 0
    assert "weights alone need 6.04 GiB" in fit.reason and "BF16 experts 4.69 GiB" in fit.reason
    assert "`flashnext checkpoint mtp-int4` would make the experts 1.21 GiB" in fit.reason


def test_room_for_weights_but_not_the_kv_names_the_context_that_would_fit(full_model):
    n = needs(full_model)
    weights = n.layer_bytes + n.other_bytes + n.embed_bytes
    room = weights + 100_000 * n.kv_bytes_per_token
    fit = fit_mtp(n, rank=2, headroom_bytes=room, tokens=CONTEXT)
    assert not fit.fits and fit.max_context_tokens == 100_000
    assert "K/V stays in VRAM" in fit.reason
    enough = fit_mtp(n, rank=2, headroom_bytes=room, tokens=100_000)
    assert enough.fits and enough.to_json()["needed_bytes"] == room


def mtp_profile(**spec):
    return dataclasses.replace(PROFILE, mtp=MtpSpec(enabled=True, **spec))


def speculative(argv) -> list[dict]:
    return [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--speculative-config"]


def test_plan_on_3x3090_says_mtp_does_not_fit_and_the_argv_has_none(full_model):
    profile = mtp_profile()
    p = plan(base_facts(), full_model, profile, OPTIONS)
    doc = plan_json(p, serve_command(p, profile, OPTIONS))
    mtp = doc["mtp"]
    assert mtp["fits"] is False and mtp["rank"] == 2
    assert mtp["headroom_bytes"] == doc["ranks"][2]["headroom_bytes"]
    assert mtp["placed_bytes"]["routed_experts"] == 5_033_164_800
    assert "mtp-int4" in mtp["reason"]
    assert speculative(doc["argv"]) == []


def test_plan_with_room_passes_exactly_one_mtp_speculative_config(full_model):
    # The same model on 48 GiB cards: the drafter and its K/V fit on the last rank.
    big = _gpus(base_facts(), lambda d: dataclasses.replace(d, memory_total_bytes=48 * GIB))
    profile = mtp_profile(num_speculative_tokens=2)
    p = plan(big, full_model, profile, OPTIONS)
    assert p.mtp is not None and p.mtp.fits, p.mtp
    argv = serve_command(p, profile, OPTIONS).argv
    assert speculative(argv) == [{"method": "mtp", "num_speculative_tokens": 2}]


def test_without_mtp_the_plan_json_is_unchanged(full_model):
    p = plan(base_facts(), full_model, PROFILE, OPTIONS)
    assert p.mtp is None and "mtp" not in p.to_json()


def test_no_mtp_tensors_means_no_drafter(full_model):
    body = {k: v for k, v in full_model.tensor_bytes_by_class().items() if not k.startswith("mtp.")}
    assert mtp_needs(body, full_model.text_config) is None


def test_preflight_fails_mtp_that_does_not_fit_with_the_writer_as_fix(
    full_skeleton, full_model, monkeypatch
):
    from flashnext import assess as assess_module

    monkeypatch.setattr(assess_module, "select_profile", lambda facts, name: (mtp_profile(), "t"))
    opts = PlanOptions(model_dir=str(full_skeleton), table_path="/nvme/flashnext/ple-table.bin")
    a = assess_module.assess(base_facts(), opts, None, model=full_model)
    (f,) = [f for f in a.findings if f.id == "mtp.fit"]
    assert f.level == "fail"
    assert f.fix == f"flashnext checkpoint mtp-int4 --model {full_skeleton}"
    assert f.measured_bytes > f.required_bytes
