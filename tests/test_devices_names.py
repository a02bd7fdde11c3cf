"""names.py: device names as NVIDIA's driver writes them, and MIG names parsed back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.devices.names import (
    counter_set_name,
    gpu_device_name,
    memory_slice_capacity,
    memory_slice_counter,
    mig_device_name,
    mig_instance_name,
    mig_profile_slug,
    parse_mig_device_name,
)
from dra_driver.errors import DeviceModelError
from dra_driver.sim.profiles import HARDWARE_PROFILES
from tests.devicedata import H100_MIG, mig_instance


@pytest.mark.parametrize(
    ("profile", "slug"),
    [
        ("1g.5gb", "1g5gb"),
        ("1g.5gb+me", "1g5gb-me"),
        ("2g.47gb", "2g47gb"),
        ("1g.24gb+me.all", "1g24gb-meall"),
        ("1g.24gb-me", "1g24gb-me"),
        ("1c.3g.40gb", "1c3g40gb"),
        ("1G.5GB+ME", "1g5gb-me"),
        ("+1g.5gb+", "1g5gb"),
        ("-1g.5gb_", "1g5gb"),
    ],
)
def test_profile_slugs_drop_dots_and_replace_plus_as_nvidia_does(profile: str, slug: str) -> None:
    assert mig_profile_slug(profile) == slug


def test_mig_names_match_nvidias_example() -> None:
    name = mig_device_name(parent_minor=1, profile="2g.47gb", profile_id=14, placement_start=0)

    assert name == "gpu-1-mig-2g47gb-14-0"
    assert parse_mig_device_name(name) == (1, 14, 0, "2g47gb")


ALL_PROFILE_NAMES = sorted(
    {p.name for hw in HARDWARE_PROFILES.values() for p in hw.gpu_instance_profiles}
    | {"1g.24gb+me.all", "1g.24gb-me", "2g.48gb+gfx"}
)


@given(
    parent=st.integers(min_value=0, max_value=10_000),
    profile=st.sampled_from(ALL_PROFILE_NAMES),
    profile_id=st.integers(min_value=0, max_value=100),
    start=st.integers(min_value=0, max_value=7),
)
def test_mig_device_names_parse_back_into_what_made_them(
    parent: int, profile: str, profile_id: int, start: int
) -> None:
    name = mig_device_name(
        parent_minor=parent, profile=profile, profile_id=profile_id, placement_start=start
    )

    assert parse_mig_device_name(name) == (parent, profile_id, start, mig_profile_slug(profile))


@pytest.mark.parametrize(
    "name",
    [
        "gpu-1",
        "gpu-01-mig-1g5gb-19-0",
        "gpu-1-mig--19-0",
        "gpu-1-mig-1g5gb-19",
        "gpu-1-mig-1g5gb-19-00",
        "GPU-1-mig-1g5gb-19-0",
        "gpu-1-mig-1g.5gb-19-0",
    ],
)
def test_names_that_are_not_mig_device_names_are_refused(name: str) -> None:
    with pytest.raises(DeviceModelError) as caught:
        parse_mig_device_name(name)

    assert str(caught.value) == (
        f"{name!r} is not a MIG device name "
        "(expected gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>)"
    )


def test_counter_and_capacity_names_of_a_gpu_are_nvidias() -> None:
    assert gpu_device_name(7) == "gpu-7"
    assert counter_set_name(7) == "gpu-7-counter-set"
    assert memory_slice_counter(3) == "memory-slice-3"
    assert memory_slice_capacity(3) == "memorySlice3"


def test_an_existing_mig_device_is_named_by_its_gpu_profile_and_placement() -> None:
    (profile,) = [p for p in H100_MIG.mig_profiles if p.name == "3g.40gb"]

    assert mig_instance_name(H100_MIG, mig_instance(profile, 4, 1)) == "gpu-1-mig-3g40gb-9-4"
