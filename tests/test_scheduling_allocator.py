"""The allocator's entry point (scheduling/allocator/allocation.py): configs, input errors, claims
that are already allocated."""

from __future__ import annotations

import pytest

from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import CelCompileError, ExplainError
from dra_driver.scheduling.allocator import (
    allocate,
    parse_claim,
    parse_device_class,
    parse_slice,
)
from tests.allocatordata import (
    CLASSES,
    DRIVER,
    NODE,
    allocated_claim,
    claim,
    devices_of,
    exactly,
    gpu,
    run,
    slice_,
)


def test_class_and_claim_configs_are_copied_in_order_naming_none_when_they_name_all() -> None:
    cls = dict(CLASSES)
    cls_obj = default_device_classes()[0]
    cls_obj["spec"]["config"] = [
        {"opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}}
    ]
    cls["gpu.nvidia.com"] = parse_device_class(cls_obj)
    slices = [parse_slice(slice_([gpu("gpu-0"), gpu("gpu-1")]))]
    c = claim(exactly("gpu"), exactly("other"))
    c["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}}
    ]
    result = allocate([parse_claim(c)], classes=cls, slices=slices, node=NODE)
    # the class config covers both requests: "empty means all", as the 1.37 scheduler writes it
    assert [(c["source"], c["requests"]) for c in result.allocations[0].config] == [
        ("FromClass", []),
        ("FromClaim", ["gpu"]),
    ]
    c = claim(exactly("gpu"))
    c["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}}
    ]
    result = allocate([parse_claim(c)], classes=cls, slices=slices, node=NODE)
    assert [(c["source"], c["requests"]) for c in result.allocations[0].config] == [
        ("FromClass", []),
        ("FromClaim", []),
    ]


def test_unknown_class_and_bad_selector_are_input_errors() -> None:
    with pytest.raises(ExplainError, match="device class 'nope' not found"):
        run([claim(exactly(cls="nope"))], [slice_([gpu("gpu-0")])])
    with pytest.raises(
        CelCompileError, match="request gpu: selectors\\[0\\]: CEL compile error: line 1, column 7"
    ):
        run([claim(exactly(selectors=("device.nope",)))], [slice_([gpu("gpu-0")])])
    with pytest.raises(ExplainError, match="count must be a positive integer"):
        parse_claim(claim(exactly(count=0)))


def test_an_already_allocated_claim_keeps_its_allocation() -> None:
    held = allocated_claim("gpu-1")
    held["metadata"]["uid"] = "uid-1"
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1")])]
    same_name = claim(exactly(), name="other")
    result = run([same_name], slices, allocated=[held])
    assert devices_of(result) == ["gpu-1"]
    assert result.allocations[0].existing
    assert any("already allocated" in n for n in result.notes)

    renamed = claim(exactly(), name="renamed")
    renamed["metadata"]["uid"] = "uid-1"
    assert devices_of(run([renamed], slices, allocated=[held])) == ["gpu-1"]

    # allocated together with a new claim: the new one cannot take the held device
    result = run([same_name, claim(exactly(), name="new")], slices, allocated=[held])
    assert devices_of(result) == ["gpu-1", "gpu-0"]
    assert [a.existing for a in result.allocations] == [True, False]


def test_an_allocation_for_another_node_is_unsatisfiable_here() -> None:
    held = allocated_claim("gpu-0")
    held["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node2"]}]}
        ]
    }
    result = run([claim(exactly(), name="other")], [slice_([gpu("gpu-0")])], allocated=[held])
    assert not result.satisfiable
    assert result.error == "claim ns/other is already allocated, for node node2"
