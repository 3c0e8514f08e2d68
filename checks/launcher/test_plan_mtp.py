"""The MTP drafter on the last PP rank (plan/mtp.py, issue 16), from the full
skeleton's real headers (and, INT4, as `checkpoint mtp-int4` leaves them): what
stays in VRAM, what goes to pinned host memory through vLLM's weight offloader
(patch 0031), its pass through VRAM while loading, and the argv."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from flashnext.plan import qsa_sizing
from flashnext.plan.command import plan_json, serve_command
from flashnext.plan.host_pools import pow2_ceil
from flashnext.plan.mtp import (
    EMBED_PREFIX,
    MtpLoad,
    cpu_offload_gib,
    drafter_offload_params,
    int4_bytes,
    mtp_needs,
    offload_selects,
    offloader_name,
)
from flashnext.plan.planner import PlanOptions, plan
from flashnext.profiles import MtpSpec, available_profiles
from flashnext.units import GIB
from lead_fixtures import _gpus, base_facts

PROFILE = available_profiles()["3x3090"]
OPTIONS = PlanOptions(model_dir="/models/Qwen3.8-Flash-Next", table_path="/nvme/ple.bin")
# With the drafter a 262,144-token request does not fit the 3x3090 pool (vLLM refuses to
# start); 128k does (qsa_sizing.RequestCapacity, held to vLLM in checks/patches).
FITS = 131_072
SEGMENTS = ("mtp.embed_tokens", "mtp.layers.48.mlp.experts")
DRAFTER_EXPERT = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.\d+\.")


def needs(model):
    found = mtp_needs(model.tensor_bytes_by_class(), model.text_config)
    assert found is not None
    return found


def mtp_profile(**spec):
    return dataclasses.replace(PROFILE, mtp=MtpSpec(enabled=True, **spec))


def mtp_flags(argv) -> dict[str, list]:
    """Each MTP flag of the argv with the values that follow it (up to the next flag)."""
    found: dict[str, list] = {}
    for i, arg in enumerate(argv):
        if arg in ("--speculative-config", "--cpu-offload-gb", "--cpu-offload-params"):
            values = []
            for value in argv[i + 1 :]:
                if value.startswith("--"):
                    break
                values.append(value)
            found.setdefault(arg, []).append(values)
    return found


# ---------------------------------------------------------------- what the drafter is


def test_needs_are_the_checkpoints_mtp_layer(full_model):
    n = needs(full_model)
    # SPEC / issue 16: the MTP layer is 4.86 GiB, of which 4.69 GiB BF16 experts.
    assert round((n.layer_bytes + n.other_bytes) / GIB, 2) == 4.86
    assert round(n.routed_expert_bytes / GIB, 2) == 4.69
    # Its own copy of the target's INT8 g128 embedding under PP>1 (patch 0033):
    # 248,320 x 2560 bytes packed, one BF16 scale per 128, the int64 shape.
    assert n.embed_bytes == 248_320 * 2560 + 248_320 * 20 * 2 + 16
    assert n.num_layers == 1 and n.offload_params == SEGMENTS
    # What stays in VRAM: the layer without its experts, fc/norms/mixer.
    assert n.resident_bytes == 141_769_216 + 39_367_680
    # vLLM fuses gate+up into w13, down into w2; the embedding keeps the target's tensors.
    assert n.offloaded_params == {
        f"{EMBED_PREFIX}weight_packed": 248_320 * 2560,
        f"{EMBED_PREFIX}weight_scale": 248_320 * 20 * 2,
        f"{EMBED_PREFIX}weight_shape": 16,
        "mtp.layers.48.mlp.experts.w13_weight": 2 * 1_677_721_600,
        "mtp.layers.48.mlp.experts.w2_weight": 1_677_721_600,
    }
    assert n.offloaded_bytes == n.routed_expert_bytes + n.embed_bytes


def test_int4_requant_is_a_quarter_plus_scales():
    assert int4_bytes(256) == 64 + 2  # 128 weights: 64 bytes packed, one BF16 scale
    assert int4_bytes(5_033_164_800) == 1_258_291_200 + 39_321_600


def test_int4_experts_are_packed_scales_and_shapes(full_model_int4):
    n = needs(full_model_int4)
    assert not n.experts_bf16
    shapes = 3 * 512 * 16  # gate/up/down x 512 experts x int64 [out, in]
    assert n.routed_expert_bytes == int4_bytes(5_033_164_800) + shapes
    assert set(n.offloaded_params) == {
        *(f"{EMBED_PREFIX}{s}" for s in ("weight_packed", "weight_scale", "weight_shape")),
        *(f"mtp.layers.48.mlp.experts.{w}_{s}" for w in ("w13", "w2")
          for s in ("weight_packed", "weight_scale", "weight_shape")),
    }  # fmt: skip
    # PyTorch's pinned allocator rounds each parameter up to a power of two.
    assert n.pinned_weight_bytes == sum(pow2_ceil(b) for b in n.offloaded_params.values())
    assert pow2_ceil(n.offloaded_params[f"{EMBED_PREFIX}weight_packed"]) == GIB


# ---------------------------------------------------------------- the offloader's segments


def test_segments_are_the_embedding_then_each_mtp_layers_experts():
    assert drafter_offload_params(48, 1) == SEGMENTS
    assert drafter_offload_params(48, 2) == (*SEGMENTS, "mtp.layers.49.mlp.experts")


def test_segments_select_exactly_the_drafters_experts_and_embedding(full_model):
    """vLLM's rule on every tensor of the real headers: the drafter's copy of a
    checkpoint tensor is seen as mtp.layers.(48+i).X; the target's layers are wrapped
    under "" (so the offloader sees layer-relative names), and neither form is hit."""
    segments = drafter_offload_params(48, 1)
    names = [t.name for t in full_model.tensors]
    selected = set()
    for name in names:
        full = offloader_name(name, 48)
        if full is not None and offload_selects(segments, full):
            selected.add(name)
        relative = re.sub(r"^model\.language_model\.layers\.\d+\.", "", name)
        assert not offload_selects(segments, name) and not offload_selects(segments, relative)
    experts = {n for n in names if DRAFTER_EXPERT.match(n)}
    assert len(experts) == 512 * 3 and selected == experts
    # The drafter's own embedding (vLLM's name for it); not the target's.
    assert offload_selects(segments, f"{EMBED_PREFIX}weight_packed")
    assert not offload_selects(segments, "embed_tokens.weight_packed")
    # Of the drafter's layer, the fused experts only (vLLM's parameter names).
    for param, hit in [
        ("mtp.layers.48.mlp.experts.w13_weight_packed", True),
        ("mtp.layers.48.mlp.experts.w2_weight_scale", True),
        ("mtp.layers.48.mlp.shared_expert.gate_up_proj.weight", False),
        ("mtp.layers.48.mlp.gate.weight", False),
        ("mtp.layers.48.self_attn.qkv_proj.weight", False),
        ("mtp.layers.480.mlp.experts.w13_weight", False),
    ]:
        assert offload_selects(segments, param) is hit, param


@pytest.mark.parametrize(
    "nbytes, gb", [(GIB, "1.00"), (GIB + 1, "1.01"), (2_569_035_776, "2.40"), (1, "0.01")]
)
def test_cpu_offload_gb_rounds_up_to_cover_every_byte(nbytes, gb):
    assert cpu_offload_gib(nbytes) == gb
    assert int(float(gb) * 1024**3) >= nbytes  # vLLM's own conversion


def test_load_room_is_the_smaller_of_budget_and_measured():
    assert MtpLoad(10, 20, None).binds == "plan budget"
    assert MtpLoad(10, 20, 30).binds == "plan budget" and MtpLoad(10, 20, 30).room_bytes == 20
    tight = MtpLoad(25, 30, 20)
    assert tight.binds == "measured start peak" and not tight.fits


# ---------------------------------------------------------------- the plan on 3x3090


def test_3x3090_with_int4_experts_fits_on_rank_2_with_the_offload_argv(full_model_int4):
    profile = mtp_profile(num_speculative_tokens=1)
    options = dataclasses.replace(OPTIONS, max_model_len=FITS)
    p = plan(base_facts(), full_model_int4, profile, options)
    n = needs(full_model_int4)
    mtp = p.mtp
    assert mtp is not None and mtp.fits and mtp.rank == 2, mtp.reason
    # VRAM: its resident weights on rank 2, the KV budget sized with them.
    assert [r.drafter_weight_bytes for r in p.ranks] == [0, 0, n.resident_bytes]
    assert p.tightest_rank == 2 and all(r.headroom_bytes >= 0 for r in p.ranks)
    assert p.ranks[2].headroom_bytes == 0
    # Its QSA layer counts among rank 2's for the pool: a smaller block, a 5th arena.
    assert p.qsa.layers_per_rank == (4, 4, 5)
    shape = qsa_sizing.QsaShape(num_speculative_tokens=1, drafter_qsa_layers=1)
    assert p.qsa.block_tokens == qsa_sizing.offload_block_size(shape, 5)
    # vLLM's count of the pool: one 128k request with the drafter, three without.
    assert mtp.requests == p.kv_capacity and mtp.requests.max_model_len == FITS
    assert (mtp.requests.full_length_requests, mtp.requests_without.full_length_requests) == (1, 3)
    assert mtp.kv_tokens < mtp.to_json()["kv_tokens_without_mtp"]
    assert mtp.kv_cache_bytes == p.kv_cache_memory_bytes.value
    placed = mtp.placed_bytes
    assert placed["vram"]["kv"] == p.qsa.tokens * 66  # slot number + pooled key
    assert placed["host"] == {
        "routed_experts": n.routed_expert_bytes,
        "embed_tokens": n.embed_bytes,
        "kv": p.qsa.per_layer_exact_bytes,
    }
    # Pinned: every arena (the drafter's among them) plus its weights as pinned.
    assert p.pinned_bytes_needed == p.qsa.pinned_total_bytes + n.pinned_weight_bytes
    assert p.host_ram_needed_bytes == p.pinned_bytes_needed + PROFILE.memory.host_overhead_bytes
    # Loading: the resident part and the INT4 experts (the largest module) at once.
    assert mtp.load.transient_bytes == n.resident_bytes + n.routed_expert_bytes
    assert mtp.load.budget_room_bytes == p.ranks[2].vram_usable_bytes - p.ranks[2].weight_bytes
    peak = PROFILE.memory.measured_start_peak_bytes[2]
    assert mtp.load.measured_room_bytes == peak - p.ranks[2].weight_bytes
    assert mtp.load.binds == "plan budget" and mtp.load.fits
    assert "fits on rank 2" in mtp.reason

    argv = serve_command(p, profile, options).argv
    flags = mtp_flags(argv)
    assert [json.loads(v[0]) for v in flags["--speculative-config"]] == [
        {"method": "mtp", "num_speculative_tokens": 1}
    ]
    assert flags["--cpu-offload-gb"] == [[cpu_offload_gib(n.offloaded_bytes)]] == [["1.81"]]
    assert flags["--cpu-offload-params"] == [list(SEGMENTS)]
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(p.kv_cache_memory_bytes.value)
    # Decode graphs for 1, 2 and 4 requests of 2 tokens each (the contract suite
    # asks vLLM's runner which decodes replay them).
    compilation = json.loads(argv[argv.index("--compilation-config") + 1])
    assert compilation["cudagraph_capture_sizes"] == [1, 2, 4, 8]


def test_shipped_bf16_experts_do_not_load_and_the_reason_names_the_writer(full_model):
    p = plan(base_facts(), full_model, mtp_profile(), OPTIONS)
    mtp = p.mtp
    assert mtp is not None and not mtp.fits and mtp.experts_bf16
    assert not mtp.load.fits
    assert mtp.load.transient_bytes == needs(full_model).resident_bytes + 5_033_164_800
    assert "`flashnext checkpoint mtp-int4` rewrites the experts INT4 (1.21 GiB)" in mtp.reason
    assert mtp.reason.endswith("would fit")
    doc = plan_json(p, serve_command(p, mtp_profile(), OPTIONS))
    assert doc["mtp"]["fits"] is False and doc["mtp"]["rank"] == 2
    assert doc["mtp"]["placed_bytes"]["host"]["routed_experts"] == 5_033_164_800
    assert mtp_flags(doc["argv"]) == {}
    # Not placed: the rest of the plan is the plan without MTP.
    off = plan(base_facts(), full_model, PROFILE, OPTIONS)
    assert dataclasses.replace(p, mtp=None, profile=off.profile) == off


def test_a_pool_that_vllm_would_refuse_is_no_fit(full_model_int4):
    # The shipped 262,144 tokens: 27 K/V blocks and 39 of state (18 GDN groups and the
    # PLE group, 2 blocks each with a draft token, and the ring) of the 53 the drafter
    # leaves; vLLM refuses to start, and estimates 136,864 tokens would.
    p = plan(base_facts(), full_model_int4, mtp_profile(), OPTIONS)
    assert not p.mtp.fits and p.mtp.load.fits
    assert "a request of 262144 tokens takes 66 blocks of the pool's 53" in p.mtp.reason
    assert p.mtp.reason.endswith(
        "vLLM refuses to start; it starts at --max-model-len 136864 at most"
    )
    assert p.qsa.layers_per_rank == (4, 4, 4)  # the plan without the drafter
    assert p.kv_capacity == p.mtp.requests_without


def test_plan_with_room_loads_even_bf16_experts(full_model):
    # The same model on 48 GiB cards: the BF16 experts pass through VRAM once.
    big = _gpus(base_facts(), lambda d: dataclasses.replace(d, memory_total_bytes=48 * GIB))
    profile = mtp_profile(num_speculative_tokens=2)
    p = plan(big, full_model, profile, OPTIONS)
    assert p.mtp is not None and p.mtp.fits, p.mtp.reason
    flags = mtp_flags(serve_command(p, profile, OPTIONS).argv)
    assert [json.loads(v[0]) for v in flags["--speculative-config"]] == [
        {"method": "mtp", "num_speculative_tokens": 2}
    ]
    assert flags["--cpu-offload-gb"] == [[cpu_offload_gib(needs(full_model).offloaded_bytes)]]


def test_without_mtp_the_plan_json_is_unchanged(full_model):
    p = plan(base_facts(), full_model, PROFILE, OPTIONS)
    doc = p.to_json()
    assert p.mtp is None and "mtp" not in doc
    assert all("drafter_weight_bytes" not in r for r in doc["ranks"])
    argv = serve_command(p, PROFILE, OPTIONS).argv
    assert mtp_flags(argv) == {}
    compilation = json.loads(argv[argv.index("--compilation-config") + 1])
    assert compilation["cudagraph_capture_sizes"] == list(
        PROFILE.compilation.cudagraph_capture_sizes
    )


def test_no_mtp_tensors_means_no_drafter(full_model):
    body = {k: v for k, v in full_model.tensor_bytes_by_class().items() if not k.startswith("mtp.")}
    assert mtp_needs(body, full_model.text_config) is None


# ---------------------------------------------------------------- preflight


def _findings(monkeypatch, full_skeleton, model, max_model_len=FITS):
    from flashnext import assess as assess_module

    monkeypatch.setattr(assess_module, "select_profile", lambda facts, name: (mtp_profile(), "t"))
    opts = PlanOptions(model_dir=str(full_skeleton), table_path="/nvme/flashnext/ple-table.bin",
                       max_model_len=max_model_len)  # fmt: skip
    a = assess_module.assess(base_facts(), opts, None, model=model)
    return a, {f.id: f for f in a.findings}


def test_preflight_fails_mtp_that_does_not_load_with_the_writer_as_fix(
    full_skeleton, full_model, monkeypatch
):
    _, found = _findings(monkeypatch, full_skeleton, full_model)
    f = found["mtp.fit"]
    assert f.level == "fail"
    assert f.fix == f"flashnext checkpoint mtp-int4 --model {full_skeleton}"
    assert f.measured_bytes > f.required_bytes


def test_preflight_passes_int4_mtp_and_pins_its_weights(
    full_skeleton, full_model_int4, monkeypatch
):
    a, found = _findings(monkeypatch, full_skeleton, full_model_int4)
    f = found["mtp.fit"]
    assert f.level == "ok", f.message
    assert f.measured_bytes == a.plan.mtp.load.transient_bytes <= f.required_bytes
    # The host checks count the drafter's pinned weights and arena.
    assert found["host.ram"].required_bytes == a.plan.host_ram_needed_bytes
    assert found["host.memlock"].required_bytes == a.plan.pinned_bytes_needed
    assert a.plan.pinned_bytes_needed > a.plan.qsa.pinned_total_bytes


def test_preflight_fails_mtp_that_vllm_would_refuse_with_the_length_that_starts(
    full_skeleton, full_model_int4, monkeypatch
):
    _, found = _findings(monkeypatch, full_skeleton, full_model_int4, max_model_len=None)
    f = found["mtp.fit"]
    assert f.level == "fail"
    assert (f.measured, f.required) == (
        "53 KV blocks with the drafter",
        ">= 66 (one request of 262144 tokens)",
    )
    assert f.fix == "--mtp 0 (serve without MTP), or --max-model-len 136864"


# ---------------------------------------------------------------- --mtp N


def test_the_mtp_option_turns_the_profiles_mtp_on_or_off():
    from flashnext.profiles import with_mtp

    assert with_mtp(PROFILE, None) is PROFILE
    on = with_mtp(PROFILE, 2)
    assert (on.mtp.enabled, on.mtp.num_speculative_tokens) == (True, 2)
    # The cited rate stays: the projection is for the profile's machine.
    assert on.mtp.acceptance_rate == PROFILE.mtp.acceptance_rate
    off = with_mtp(mtp_profile(num_speculative_tokens=3), 0)
    assert (off.mtp.enabled, off.mtp.num_speculative_tokens) == (False, 3)
    assert dataclasses.replace(on, mtp=PROFILE.mtp) == PROFILE


def test_mtp_1_on_the_shipped_profile_places_the_int4_drafter(full_skeleton, full_model_int4):
    from flashnext.assess import assess

    opts = PlanOptions(model_dir=str(full_skeleton), table_path="/nvme/ple.bin", mtp=1)
    full = assess(base_facts(), opts, "3x3090", model=full_model_int4)
    assert {f.id: f for f in full.findings}["mtp.fit"].level == "fail"  # 262,144 tokens
    opts = dataclasses.replace(opts, max_model_len=FITS)
    a = assess(base_facts(), opts, "3x3090", model=full_model_int4)
    found = {f.id: f for f in a.findings}
    assert found["mtp.fit"].level == "ok", found["mtp.fit"].message
    assert a.plan.mtp.fits and a.profile.mtp.num_speculative_tokens == 1
    flags = mtp_flags(a.command.argv)
    assert [json.loads(v[0]) for v in flags["--speculative-config"]] == [
        {"method": "mtp", "num_speculative_tokens": 1}
    ]
    # --mtp 0 is the plan without MTP, whatever the profile says.
    none = assess(base_facts(), dataclasses.replace(opts, mtp=0), "3x3090", model=full_model_int4)
    assert none.plan.mtp is None and "mtp.fit" not in {f.id for f in none.findings}
    assert mtp_flags(none.command.argv) == {}


def test_the_cli_takes_mtp_and_says_the_bf16_drafter_needs_the_writer(full_skeleton):
    from click.testing import CliRunner
    from flashnext.cli import main
    from lead_fixtures import BASE_FILE

    runner = CliRunner()
    args = ["plan", "--facts", BASE_FILE, "--model", str(full_skeleton), "--json"]
    doc = json.loads(runner.invoke(main, [*args, "--mtp", "1"]).output)
    assert doc["mtp"]["fits"] is False and "checkpoint mtp-int4" in doc["mtp"]["reason"]
    assert mtp_flags(doc["argv"]) == {}
    pre = runner.invoke(main, ["preflight", "--facts", BASE_FILE, "--model", str(full_skeleton),
                               "--mtp", "1", "--json"])  # fmt: skip
    fit = next(f for f in json.loads(pre.output)["findings"] if f["id"] == "mtp.fit")
    assert fit["fix"] == f"flashnext checkpoint mtp-int4 --model {full_skeleton}"
    bad = runner.invoke(main, [*args, "--mtp", "-1"])
    assert bad.exit_code == 2 and "--mtp" in bad.output and "Traceback" not in bad.output


def test_two_drafts_fit_at_no_length_and_the_fix_is_one_draft_at_a_length_that_starts(
    full_skeleton, full_model_int4
):
    """With 2 drafts each GDN and PLE state group keeps 3 blocks per request:
    the state alone outgrows the last card's pool, so no --max-model-len
    helps; the fix names the most drafts that start, and its length, and that
    plan's drafter fits."""
    from flashnext.assess import assess

    opts = PlanOptions(model_dir=str(full_skeleton), table_path="/nvme/ple.bin", mtp=2,
                       max_model_len=FITS)  # fmt: skip
    a = assess(base_facts(), opts, "3x3090", model=full_model_int4)
    f = {f.id: f for f in a.findings}["mtp.fit"]
    assert f.level == "fail" and a.plan.mtp.requests.longest_request_tokens == 0
    # What `plan --json` says of it (the perf harness grows the pool from these).
    doc = a.plan.mtp.to_json()
    assert doc["blocks_per_request"] > doc["pool_blocks"] == a.plan.mtp.requests.usable_blocks
    off, fewer = f.fix.split(", or ")
    assert off == "--mtp 0 (serve without MTP)"
    drafts, length = re.fullmatch(r"--mtp (\d+) --max-model-len (\d+)", fewer).groups()
    assert drafts == "1" and int(length) <= FITS
    one = dataclasses.replace(opts, mtp=int(drafts), max_model_len=int(length))
    fixed = assess(base_facts(), one, "3x3090", model=full_model_int4)
    assert {f.id: f for f in fixed.findings}["mtp.fit"].level == "ok"
