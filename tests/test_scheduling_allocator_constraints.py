"""matchAttribute and distinctAttribute (scheduling/allocator/constraints.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.allocatordata import (
    claim,
    devices_of,
    exactly,
    gpu,
    run,
    slice_,
)


def test_match_attribute_backtracks_to_a_matching_pair() -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="b"), gpu("gpu-2", root="b")]
    result = run(
        [
            claim(
                exactly(count=2),
                constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}],
            )
        ],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-1", "gpu-2"]


def test_match_attribute_finds_unqualified_attributes_of_the_driver() -> None:
    devices = [gpu("gpu-0", product="A"), gpu("gpu-1", product="B"), gpu("gpu-2", product="A")]
    result = run(
        [claim(exactly(count=2), constraints=[{"matchAttribute": "gpu.nvidia.com/productName"}])],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-0", "gpu-2"]


def test_match_attribute_unsatisfiable_says_which_values_exist() -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="b")]
    result = run(
        [
            claim(
                exactly(count=2),
                constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}],
            )
        ],
        [slice_(devices)],
    )
    assert not result.satisfiable
    assert "same resource.kubernetes.io/pcieRoot" in result.diagnoses[0].summary


def test_match_attribute_on_the_int_numa_node_skips_devices_without_one() -> None:
    def on_numa(name: str, node: int | None) -> dict[str, Any]:
        device = gpu(name)
        if node is not None:
            device["attributes"]["resource.kubernetes.io/numaNode"] = {"int": node}
        return device

    devices = [
        on_numa("gpu-0", 0),
        on_numa("gpu-1", None),
        on_numa("gpu-2", 1),
        on_numa("gpu-3", 1),
    ]
    result = run(
        [
            claim(
                exactly(count=2),
                constraints=[{"matchAttribute": "resource.kubernetes.io/numaNode"}],
            )
        ],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-2", "gpu-3"]


def test_distinct_attribute_needs_different_values() -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="a"), gpu("gpu-2", root="b")]
    result = run(
        [
            claim(
                exactly(count=2),
                constraints=[{"distinctAttribute": "resource.kubernetes.io/pcieRoot"}],
            )
        ],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-0", "gpu-2"]


ROOT = "resource.kubernetes.io/pcieRoot"


def test_a_constraint_binds_only_the_requests_it_names() -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="b"), gpu("gpu-2", root="b")]
    result = run(
        [
            claim(
                exactly("two", count=2),
                exactly("other"),
                constraints=[{"requests": ["two"], "matchAttribute": ROOT}],
            )
        ],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-1", "gpu-2", "gpu-0"]


@pytest.mark.parametrize("named", ["gpu", "gpu/two"])
def test_a_constraint_names_a_first_available_request_or_its_sub_request(named: str) -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="b"), gpu("gpu-2", root="b")]
    req = {
        "name": "gpu",
        "firstAvailable": [{"name": "two", "deviceClassName": "gpu.nvidia.com", "count": 2}],
    }
    result = run(
        [claim(req, constraints=[{"requests": [named], "matchAttribute": ROOT}])],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-1", "gpu-2"]


def with_attr(name: str, value: dict[str, Any]) -> dict[str, Any]:
    device = gpu(name)
    device["attributes"]["k"] = value
    return device


def test_match_attribute_on_lists_narrows_to_the_common_values() -> None:
    """DRAListTypeAttributes: lists match when they overlap, and the values all devices so far
    share narrow with each one."""
    devices = [
        with_attr("d0", {"strings": ["pci-a", "pci-b"]}),
        with_attr("d1", {"strings": ["pci-b", "pci-c"]}),
        with_attr("d2", {"strings": ["pci-a", "pci-c"]}),  # overlaps each, not their common b
        with_attr("d3", {"string": "pci-a"}),
        with_attr("d4", {"string": "pci-b"}),
    ]
    result = run(
        [claim(exactly(count=3), constraints=[{"matchAttribute": "gpu.nvidia.com/k"}])],
        [slice_(devices)],
    )
    assert devices_of(result) == ["d0", "d1", "d4"]
    scalar_then_list = [
        with_attr("d0", {"strings": ["pci-a", "pci-b"]}),
        with_attr("d1", {"string": "pci-b"}),
        with_attr("d2", {"string": "pci-a"}),
        with_attr("d3", {"strings": ["pci-b"]}),
    ]
    result = run(
        [claim(exactly(count=3), constraints=[{"matchAttribute": "gpu.nvidia.com/k"}])],
        [slice_(scalar_then_list)],
    )
    assert devices_of(result) == ["d0", "d1", "d3"]


def test_values_of_different_types_never_match() -> None:
    devices = [with_attr("d0", {"int": 1}), with_attr("d1", {"string": "1"}),
               with_attr("d2", {"int": 1})]  # fmt: skip
    result = run(
        [claim(exactly(count=2), constraints=[{"matchAttribute": "gpu.nvidia.com/k"}])],
        [slice_(devices)],
    )
    assert devices_of(result) == ["d0", "d2"]


def test_an_unqualified_attribute_counts_only_in_the_drivers_own_domain() -> None:
    result = run(
        [claim(exactly(), constraints=[{"matchAttribute": "example.com/productName"}])],
        [slice_([gpu("gpu-0")])],
    )
    assert not result.satisfiable
