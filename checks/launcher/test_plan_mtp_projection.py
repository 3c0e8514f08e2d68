"""MTP's gain on paper (plan/mtp_projection.py, issue 16): the geometric
tokens-per-step formula, the step's bytes under the decode roofline, the
profile's cited acceptance rate, and the refusal without one."""

from __future__ import annotations

import dataclasses
from importlib import resources

import pytest
from flashnext.plan.command import plan_json, serve_command
from flashnext.plan.mtp import (
    drafter_bytes_per_step,
    drafter_host_bytes_per_step,
    int4_bytes,
    lm_head_bytes,
    mtp_needs,
)
from flashnext.plan.mtp_projection import (
    GOAL_TOKENS_PER_S,
    NO_CITED_RATE,
    NO_HOST_LINK,
    StepCost,
    project_mtp,
    projection_table,
    tokens_per_step,
)
from flashnext.plan.planner import PlanOptions, plan
from flashnext.profiles import MtpSpec, ProfileError, available_profiles, parse_profile
from lead_fixtures import base_facts

PROFILE = available_profiles()["3x3090"]
SHIPPED = (resources.files("flashnext.profiles") / "3x3090.toml").read_text()
OPTIONS = PlanOptions(model_dir="/models/Qwen3.8-Flash-Next", table_path="/nvme/ple.bin")

# A hand-sized cost: 4 GB dense, 1 GB of routed experts per token, a 0.5 GB drafter, 1 TB/s.
COST = StepCost(
    target_dense_bytes=4_000_000_000,
    target_routed_bytes_per_token=1_000_000_000,
    drafter_bytes=500_000_000,
    bandwidth_bytes_per_s=1_000_000_000_000,
)


@pytest.mark.parametrize(
    "alpha, k, expected",
    [
        (0.5, 1, 1.5),  # 1 + 0.5
        (0.5, 2, 1.75),  # 1 + 0.5 + 0.25
        (0.5, 3, 1.875),
        (0.8, 2, 2.44),  # 1 + 0.8 + 0.64
        (0.65, 1, 1.65),
        (0.0, 3, 1.0),  # nothing accepted: the target's own token
        (1.0, 3, 4.0),  # everything accepted: k + 1
        (0.9, 0, 1.0),
    ],
)
def test_tokens_per_step_is_the_geometric_sum(alpha, k, expected):
    assert tokens_per_step(alpha, k) == pytest.approx(expected)


def test_tokens_per_step_refuses_a_rate_outside_0_1():
    with pytest.raises(ValueError):
        tokens_per_step(1.2, 1)


def test_step_bytes_and_rate_by_hand():
    # k=2: verify reads 4 GB + 3 x 1 GB, two drafter steps 1 GB: 8 GB in 8 ms.
    assert COST.bytes_per_step(2) == 8_000_000_000
    assert COST.tokens_per_s(0.5, 2) == pytest.approx(1.75 / 0.008)
    # k=1 at 0.5: 1.5 tokens for 6.5 GB.
    assert COST.tokens_per_s(0.5, 1) == pytest.approx(1.5 / 0.0065)


def test_draft_steps_add_their_host_reads_at_the_links_rate():
    # k=2: 8 GB from VRAM at 1 TB/s (8 ms) and 2 x 0.1 GB over a 10 GB/s link (20 ms).
    cost = dataclasses.replace(COST, drafter_host_bytes=100_000_000,
                               host_link_bytes_per_s=10_000_000_000)  # fmt: skip
    assert cost.host_bytes_per_step(2) == 200_000_000
    assert cost.seconds_per_step(2) == pytest.approx(0.008 + 0.02)
    assert cost.tokens_per_s(0.5, 2) == pytest.approx(1.75 / 0.028)
    assert cost.tokens_per_s(0.0, 0) == COST.tokens_per_s(0.0, 0)  # no draft, no host read


def test_without_the_host_links_figure_it_refuses_to_project():
    cost = dataclasses.replace(COST, drafter_host_bytes=100_000_000)
    p = project_mtp(cost, acceptance_rate=0.65, acceptance_source="x", num_speculative_tokens=1)
    assert p.rows == () and p.reason == NO_HOST_LINK
    with pytest.raises(ValueError, match="no cited host-link bandwidth"):
        cost.tokens_per_s(0.65, 1)


def test_k0_is_the_roofline(full_model):
    p = plan(base_facts(), full_model, PROFILE, OPTIONS)
    d = p.decode
    cost = StepCost(d.dense_bytes, d.bytes_per_token - d.dense_bytes, 123, d.bandwidth_bytes_per_s)
    assert cost.bytes_per_step(0) == d.bytes_per_token
    assert cost.tokens_per_s(0.7, 0) == pytest.approx(d.tokens_per_s)


def test_monotone_in_the_acceptance_rate():
    rates = (0.0, 0.3, 0.5, 0.65, 0.8, 0.9, 1.0)
    for k in (1, 2, 3):
        tps = [COST.tokens_per_s(a, k) for a in rates]
        assert tps == sorted(tps) and len(set(tps)) == len(tps)


def test_the_table_is_rates_outer_and_marks_the_goal():
    rows = projection_table(COST, (0.5, 0.9))
    assert [r.num_speculative_tokens for r in rows] == [1, 2, 3, 1, 2, 3]
    for r in rows:
        assert r.meets_goal == (r.tokens_per_s >= GOAL_TOKENS_PER_S)
    assert rows[0].speedup == pytest.approx(COST.tokens_per_s(0.5, 1) / COST.tokens_per_s(0, 0))


def test_drafter_step_reads_the_lm_head_from_vram_and_int4_experts_from_host(full_model):
    by_class = full_model.tensor_bytes_by_class()
    n = mtp_needs(by_class, full_model.text_config)
    head = lm_head_bytes(by_class)
    # The INT8 g128 LM head: 248,320 x 2560 bytes packed, BF16 scales per 128, its shape.
    assert head == 635_699_200 + 9_932_800 + 16
    got = drafter_bytes_per_step(n, head_bytes=head)
    assert got == n.layer_bytes - n.routed_expert_bytes + n.other_bytes + head
    assert round(got / 1e9, 3) == 0.827
    # One token's 10 of 512 experts, INT4 as `checkpoint mtp-int4` leaves them.
    host = drafter_host_bytes_per_step(n, experts_per_token=10, num_experts=512)
    assert host == int4_bytes(n.routed_expert_bytes) * 10 // 512 == 25_344_000


def test_without_a_cited_rate_it_refuses_to_project():
    p = project_mtp(COST, acceptance_rate=None, acceptance_source=None, num_speculative_tokens=1)
    assert p.rows == () and p.reason == NO_CITED_RATE
    assert p.to_json()["rows"] == [] and p.to_json()["acceptance_rate"] is None
    # A rate without its source is no citation either.
    p = project_mtp(COST, acceptance_rate=0.7, acceptance_source="", num_speculative_tokens=1)
    assert p.rows == ()


def test_the_profile_rate_needs_its_source():
    with pytest.raises(ProfileError) as err:
        parse_profile(SHIPPED.replace("acceptance_source =", "# acceptance_source ="), "x.toml")
    assert str(err.value).startswith(
        "x.toml [mtp]: mtp: acceptance_rate and acceptance_source go together"
    )
    with pytest.raises(ProfileError) as err:
        parse_profile(SHIPPED.replace("acceptance_rate = 0.65", "acceptance_rate = 1.5"), "x.toml")
    assert "mtp.acceptance_rate: Input should be less than or equal to 1, got 1.5" in str(err.value)


def test_the_shipped_profile_reads_its_mtp_section():
    # [mtp] is read from the TOML, not left at the dataclass defaults.
    assert PROFILE.mtp.acceptance_rate == 0.65
    assert "qwen3.8next_mtp.yaml" in PROFILE.mtp.acceptance_source
    assert "thinking_on 1: 1.65" in PROFILE.mtp.acceptance_source
    off, on = (
        "enabled = false\nnum_speculative_tokens = 1",
        "enabled = true\nnum_speculative_tokens = 3",
    )
    on = parse_profile(SHIPPED.replace(off, on), "x.toml")
    assert on.mtp.enabled and on.mtp.num_speculative_tokens == 3
    with pytest.raises(ProfileError, match=r"\[mtp\]: unknown acceptance"):
        parse_profile(SHIPPED.replace("acceptance_rate =", "acceptance =", 1), "x.toml")


def test_plan_json_mtp_has_the_projection_at_the_profile_rate(full_model):
    profile = dataclasses.replace(PROFILE, mtp=dataclasses.replace(PROFILE.mtp, enabled=True))
    p = plan(base_facts(), full_model, profile, OPTIONS)
    doc = plan_json(p, serve_command(p, profile, OPTIONS))
    proj = doc["mtp"]["projection"]
    assert proj["acceptance_rate"] == 0.65 and proj["num_speculative_tokens"] == 1
    assert proj["no_mtp_tokens_per_s"] == doc["decode"]["tokens_per_s"]
    by_k = {r["num_speculative_tokens"]: r for r in proj["rows"]}
    assert sorted(by_k) == [1, 2, 3]
    # k=1 at 0.65: 1.65 tokens for dense + 2 tokens' experts + one drafter step from
    # VRAM, and the drafter's experts over the host link.
    d = doc["decode"]
    routed = d["bytes_per_token"] - d["dense_bytes"]
    assert (
        by_k[1]["bytes_per_step"] == d["dense_bytes"] + 2 * routed + proj["drafter_bytes_per_step"]
    )
    assert by_k[1]["host_bytes_per_step"] == proj["drafter_host_bytes_per_step"] == 25_344_000
    link = PROFILE.gpu.host_link_bytes_per_s
    assert proj["host_link_bytes_per_s"] == link == 25 * 2**30  # the seed's PCIe 4.0 x16
    seconds = by_k[1]["bytes_per_step"] / d["bandwidth_bytes_per_s"] + 25_344_000 / link
    assert by_k[1]["tokens_per_s"] == round(1.65 / seconds, 2)
    assert by_k[1]["tokens_per_s"] == 196.38 and by_k[1]["speedup"] == 1.036
    assert "on paper, not measured" in proj["reason"]


def test_plan_json_without_a_cited_rate_says_so(full_model):
    profile = dataclasses.replace(PROFILE, mtp=MtpSpec(enabled=True))
    p = plan(base_facts(), full_model, profile, OPTIONS)
    proj = p.to_json()["mtp"]["projection"]
    assert proj["rows"] == [] and proj["reason"].startswith("no cited acceptance rate")
