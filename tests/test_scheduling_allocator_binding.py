"""The allocator on devices with binding conditions (KEP-5007, DRADeviceBindingConditions): pool
order, the results' conditions, ``bindsToNode``, and the feature switched off, as the
scheduler's structured allocator does them (``GatherPools``, ``isSelectable``,
``createNodeSelector``)."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.errors import ExplainError
from dra_driver.scheduling.allocator import (
    allocate,
    allocated_state,
    gather_pools,
    parse_claim,
    parse_device_class,
    parse_slice,
)
from dra_driver.scheduling.environment import device_binding_conditions
from tests.allocatordata import CLASSES, NODE, claim, exactly, gpu, slice_

OTHER = "attach.example.com"  # sorts before gpu.nvidia.com


def with_bc(name: str, **extra: Any) -> dict[str, Any]:
    return gpu(name, bindingConditions=["attached"], bindingFailureConditions=["failed"], **extra)


def other_slice(*devices: dict[str, Any], name: str = "o1", count: int = 1) -> dict[str, Any]:
    s = slice_(list(devices), name=name, pool="other-pool", count=count)
    s["spec"]["driver"] = OTHER
    return s


ANY = parse_claim(claim(exactly(cls="any")))


@pytest.fixture
def classes() -> dict[str, Any]:
    return {**CLASSES, "any": parse_device_class({"metadata": {"name": "any"}, "spec": {}})}


def test_the_feature_is_on_by_default_from_1_36() -> None:
    assert [device_binding_conditions(v) for v in ("1.34", "1.35", "1.36", "1.37")] == [
        False,
        False,
        True,
        True,
    ]


def test_pools_with_binding_conditions_are_gathered_last_their_slices_in_name_order() -> None:
    slices = [
        parse_slice(s)
        for s in (
            other_slice(with_bc("a"), name="o1", count=2),
            other_slice(gpu("b"), name="o2", count=2),
            slice_([gpu("gpu-0")]),
        )
    ]
    on = gather_pools(slices, NODE)
    # buildPool sorts a pool's slices by name only (found by the oracle tier)
    assert [(p.driver, [s.name for s in p.slices]) for p in on] == [
        ("gpu.nvidia.com", ["s1"]),
        (OTHER, ["o1", "o2"]),
    ]
    off = gather_pools(slices, NODE, binding_conditions=False)
    assert [(p.driver, [s.name for s in p.slices]) for p in off] == [
        (OTHER, ["o1", "o2"]),
        ("gpu.nvidia.com", ["s1"]),
    ]


@pytest.mark.parametrize("enabled", [True, False])
def test_results_carry_the_conditions_only_with_the_feature_on(
    classes: dict[str, Any], enabled: bool
) -> None:
    result = allocate(
        [ANY],
        classes=classes,
        slices=[parse_slice(other_slice(with_bc("a"), gpu("b")))],
        node=NODE,
        binding_conditions=enabled,
    )
    assert result.satisfiable
    ((only,),) = [a.results for a in result.allocations]
    if enabled:  # "a" is first in its slice and selectable
        assert (only.device, only.binding_conditions, only.binding_failure_conditions) == (
            "a",
            ("attached",),
            ("failed",),
        )
    else:  # "a" is not selectable
        assert (only.device, only.binding_conditions) == ("b", ())


def test_an_existing_allocation_keeps_its_conditions() -> None:
    state = allocated_state(
        [
            {
                "metadata": {"name": "x", "namespace": "ns"},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "r",
                                    "driver": OTHER,
                                    "pool": "other-pool",
                                    "device": "a",
                                    "bindingConditions": ["attached"],
                                    "bindingFailureConditions": ["failed"],
                                }
                            ]
                        }
                    }
                },
            }
        ]
    )
    (result,) = state.claims["ns/x"].results
    assert result.binding_conditions == ("attached",)
    assert result.binding_failure_conditions == ("failed",)


def test_a_condition_that_is_not_a_string_is_an_input_error() -> None:
    with pytest.raises(ExplainError, match=r"bindingConditions\[0\]"):
        parse_slice(other_slice(gpu("a", bindingConditions=[3])))
