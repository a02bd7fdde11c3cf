"""The ``--simulate`` spec language: groups, options, MIG layouts placed as NVML would, and errors
that name the bad part."""

from __future__ import annotations

import pytest

from dra_driver.errors import SimulationSpecError
from dra_driver.sim.nvml import parse_spec
from dra_driver.sim.profiles import HARDWARE_PROFILES, hardware_profile


def test_groups_expand_to_gpus_in_spec_order() -> None:
    spec = parse_spec("a100-80gb:2, l4:1,t4")

    assert [g.hardware.key for g in spec.gpus] == ["a100-80gb", "a100-80gb", "l4", "t4"]
    assert not any(g.mig_enabled or g.fail for g in spec.gpus)


def test_aliases_and_case_are_accepted() -> None:
    spec = parse_spec("H100:1,h200")

    assert [g.hardware.key for g in spec.gpus] == ["h100-80gb", "h200-141gb"]


def test_mig_layout_is_placed_first_fit_in_the_given_order() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb").gpus

    assert gpu.mig_enabled and gpu.mig_pending
    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("3g.20gb", 0),
        ("2g.10gb", 4),
        ("1g.5gb", 6),
    ]


def test_me_suffixes_and_repeat_counts_in_layouts() -> None:
    (gpu,) = parse_spec("h100:1:mig=1g.10gb+me+1g.10gb*6").gpus

    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("1g.10gb+me", 0),
        *[("1g.10gb", start) for start in range(1, 7)],
    ]


def test_earlier_placements_are_revisited_when_a_later_instance_needs_room() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb*2").gpus

    assert [(m.profile.name, m.start) for m in gpu.mig_instances] == [
        ("3g.20gb", 4),
        ("2g.10gb", 0),
        ("1g.5gb", 2),
        ("1g.5gb", 3),
    ]


def test_two_memory_slice_profiles_use_their_own_placement_table() -> None:
    (gpu,) = parse_spec("a100-40gb:1:mig=1g.10gb*4").gpus
    (mixed,) = parse_spec("a100-40gb:1:mig=2g.10gb*3+1g.10gb").gpus

    assert [m.start for m in gpu.mig_instances] == [0, 2, 4, 6]
    assert [m.start for m in mixed.mig_instances] == [0, 2, 4, 6]


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ("4g.20gb+4g.20gb", "at most 1 instance"),
        ("1g.5gb+me+1g.5gb+me", "at most 1 instance"),
        ("7g.40gb+1g.5gb", "compute slices"),
        ("2g.10gb*3+1g.10gb+1g.5gb", "compute slices"),
        ("3g.20gb+3g.20gb+1g.5gb", "no combination of possible placements"),
        ("1g.10gb*3+3g.20gb+1g.5gb", "3g.20gb {0,4}:4"),
    ],
)
def test_layouts_that_do_not_fit_are_rejected_with_the_reason(layout: str, reason: str) -> None:
    with pytest.raises(SimulationSpecError, match="does not fit") as caught:
        parse_spec(f"a100-40gb:1:mig={layout}")

    assert reason in str(caught.value)
    assert layout in str(caught.value)


def test_unknown_product_lists_the_known_ones() -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec("h100:2,v100:1")

    message = str(caught.value)
    assert "'v100'" in message
    assert "group 2" in message
    for key in [*HARDWARE_PROFILES, "h100", "h200"]:
        assert key in message


def test_unknown_mig_profile_lists_the_products_profiles() -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec("a100-80gb:1:mig=1g.5gb")

    message = str(caught.value)
    assert "'1g.5gb'" in message
    assert "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in message


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("", "empty --simulate spec"),
        ("h100,,l4", "group 2 is empty"),
        ("h100:x", "unknown option 'x'"),
        ("h100:1:bogus", "unknown option 'bogus'"),
        ("h100:1:addressing=nvlink", "unknown option 'addressing=nvlink'"),
        ("h100:1:numa=-1", "unknown option 'numa=-1'"),
        ("h100:1:numa=1024", "unknown option 'numa=1024'"),
        ("h100:1:numa=", "unknown option 'numa='"),
        ("l4:1:mig", "l4 (NVIDIA L4) does not support MIG"),
        ("t4:1:mig-pending", "does not support MIG"),
        ("a100-40gb:1:mig=3g.20gb+", "empty entry"),
        ("a100-40gb:1:mig=1g.5gb*0", "bad repeat count"),
        ("a100-40gb:1:mig=1g.5gb*x", "bad repeat count"),
        ("h100:65", "more than 64 GPUs"),
    ],
)
def test_malformed_specs_name_the_bad_part(spec: str, names: str) -> None:
    with pytest.raises(SimulationSpecError) as caught:
        parse_spec(spec)

    assert names in str(caught.value)


def test_every_hardware_profile_is_reachable_by_its_key() -> None:
    for key, profile in HARDWARE_PROFILES.items():
        assert hardware_profile(key) is profile
        assert hardware_profile(key.upper()) is profile
    assert hardware_profile("v100") is None
