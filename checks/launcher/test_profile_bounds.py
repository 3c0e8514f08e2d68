"""Profiles load through pydantic: every field's type and bounds, said with the key."""

from __future__ import annotations

from importlib import resources

import pytest
from flashnext.profiles import ProfileError, available_profiles, parse_profile

SHIPPED = (resources.files("flashnext.profiles") / "3x3090.toml").read_text()


@pytest.mark.parametrize(
    "old, new, message",
    [
        ("gpu_memory_utilization = 0.97", "gpu_memory_utilization = 1.5",
         "x.toml [memory]: memory.gpu_memory_utilization: Input should be less than or "
         "equal to 1, got 1.5"),
        ("gpu_memory_utilization = 0.97", "gpu_memory_utilization = 0",
         "x.toml [memory]: memory.gpu_memory_utilization: Input should be greater than 0, "
         "got 0"),
        ('host_pinning = "exact"', 'host_pinning = "pinned"',
         "x.toml [qsa_offload]: qsa_offload.host_pinning must be 'exact' or 'pow2'"),
        ("max_num_seqs = 4", "max_num_seqs = 0",
         "x.toml [scheduler]: scheduler.max_num_seqs: Input should be greater than or equal "
         "to 1, got 0"),
        ("max_num_seqs = 4", 'max_num_seqs = "4"',
         "x.toml [scheduler]: scheduler.max_num_seqs: Input should be a valid integer, got '4'"),
    ],
)  # fmt: skip
def test_a_value_out_of_bounds_is_refused_with_its_key(old, new, message):
    assert old in SHIPPED
    with pytest.raises(ProfileError) as err:
        parse_profile(SHIPPED.replace(old, new), "x.toml")
    assert str(err.value) == message


def test_the_shipped_profiles_load_within_their_bounds():
    profiles = available_profiles()
    assert {"3x3090", "h200-tiny"} <= set(profiles)
    for profile in profiles.values():
        assert 0 < profile.memory.gpu_memory_utilization <= 1
        assert profile.qsa_offload.host_pinning in ("exact", "pow2")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('CUDA_DEVICE_ORDER = ["PCI_BUS_ID"]',
         "x.toml [env]: CUDA_DEVICE_ORDER is a list, not a string or number"),
        ("CUDA_DEVICE_ORDER = { a = 1 }",
         "x.toml [env]: CUDA_DEVICE_ORDER is a dict, not a string or number"),
        ('"A=B" = "1"', "x.toml [env]: 'A=B' is not an environment variable name"),
        ('"" = "1"', "x.toml [env]: '' is not an environment variable name"),
    ],
)  # fmt: skip
def test_env_values_are_scalars_under_real_names(line, message):
    """Issue 39 class 10: a list or table was stringified into the child's environment,
    and a name with `=` split into another variable there."""
    text = SHIPPED.replace('CUDA_DEVICE_ORDER = "PCI_BUS_ID"', line)
    assert text != SHIPPED
    with pytest.raises(ProfileError) as err:
        parse_profile(text, "x.toml")
    assert str(err.value).startswith(message)
