"""The search (scheduling/allocator/search.py): first fit in slice order, backtracking,
allocationMode All, devices in use, admin access, firstAvailable sub-requests, a CEL runtime
error aborting the attempt."""

from __future__ import annotations

from tests.allocatordata import (
    allocated_claim,
    claim,
    devices_of,
    exactly,
    gpu,
    run,
    slice_,
)


def test_first_fit_takes_devices_in_slice_order() -> None:
    result = run([claim(exactly(count=2))], [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2")])])
    assert devices_of(result) == ["gpu-0", "gpu-1"]
    assert result.allocations[0].node_selector == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]}
        ]
    }


def test_allocation_mode_all_takes_every_matching_device() -> None:
    result = run([claim(exactly(allocationMode="All"))], [slice_([gpu("gpu-0"), gpu("gpu-1")])])
    assert devices_of(result) == ["gpu-0", "gpu-1"]


def test_allocation_mode_all_fails_when_one_is_in_use() -> None:
    result = run(
        [claim(exactly(allocationMode="All"))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        allocated=[allocated_claim("gpu-1")],
    )
    assert not result.satisfiable
    reasons = {v.device: v.reasons for v in result.diagnoses[0].verdicts}
    assert reasons["gpu-1"] == ("in use by ns/other",)
    assert result.diagnoses[0].summary == (
        "needs all 2 matching devices, but 1 is allocated: gpu-1 (ns/other)"
    )


def test_devices_allocated_to_other_claims_are_skipped() -> None:
    result = run(
        [claim(exactly())],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        allocated=[allocated_claim("gpu-0")],
    )
    assert devices_of(result) == ["gpu-1"]


def test_admin_access_may_use_allocated_devices() -> None:
    result = run(
        [claim(exactly(adminAccess=True, allocationMode="All"))],
        [slice_([gpu("gpu-0")])],
        allocated=[allocated_claim("gpu-0")],
    )
    assert devices_of(result) == ["gpu-0"]
    assert result.allocations[0].results[0].admin_access


def test_first_available_tries_sub_requests_in_order() -> None:
    req = {
        "name": "gpu",
        "firstAvailable": [
            {
                "name": "h200",
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [
                    {
                        "cel": {
                            "expression": "device.attributes['gpu.nvidia.com'].productName"
                            " == 'NVIDIA H200'"
                        }
                    }
                ],
            },
            {"name": "any", "deviceClassName": "gpu.nvidia.com"},
        ],
    }
    result = run([claim(req)], [slice_([gpu("gpu-0")])])
    assert [r.request for r in result.allocations[0].results] == ["gpu/any"]


def test_a_cel_runtime_error_aborts_the_attempt() -> None:
    sel = "device.attributes['gpu.nvidia.com'].missing == 1"
    result = run([claim(exactly(selectors=(sel,)))], [slice_([gpu("gpu-0")])])
    assert not result.satisfiable
    assert result.error is not None
    assert "selector #0 on device gpu.nvidia.com/node1/gpu-0: CEL runtime error" in result.error
