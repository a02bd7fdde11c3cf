"""matchAttribute and distinctAttribute (scheduling/allocator/constraints.py)."""

from __future__ import annotations

from typing import Any

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
