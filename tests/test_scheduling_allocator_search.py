"""The search (scheduling/allocator/search.py): first fit in slice order, backtracking (and what
it gives back: devices, constraint values, counters), allocationMode All, devices in use, admin
access, the 32-device limit, firstAvailable sub-requests, shared devices, devices with binding
conditions or off the node, a CEL runtime error aborting the attempt."""

from __future__ import annotations

import uuid
from typing import Any

from dra_driver.scheduling.allocator import allocate, parse_claim, parse_slice
from tests.allocatordata import (
    CLASSES,
    NODE,
    allocated_claim,
    claim,
    devices_of,
    exactly,
    gpu,
    mig,
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


# -- devices in use: by earlier requests, other claims, admin access ----------------------------

H100 = ("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100'",)
HAS_X = ("device.attributes['gpu.nvidia.com'].x == 1",)  # a CEL runtime error without x


def with_x(dev: dict[str, Any]) -> dict[str, Any]:
    dev["attributes"]["x"] = {"int": 1}
    return dev


def test_each_request_and_each_claim_takes_a_device_of_its_own() -> None:
    devices = [gpu("gpu-0"), gpu("gpu-1")]
    assert devices_of(run([claim(exactly("a"), exactly("b"))], [slice_(devices)])) == [
        "gpu-0",
        "gpu-1",
    ]
    two = run([claim(exactly(), name="a"), claim(exactly(), name="b")], [slice_(devices)])
    assert devices_of(two) == ["gpu-0", "gpu-1"]
    assert not run([claim(exactly("a"), exactly("b"))], [slice_([gpu("gpu-0")])]).satisfiable


def test_backtracking_gives_back_a_first_choice_a_later_request_needs() -> None:
    devices = [gpu("gpu-0"), gpu("gpu-1", product="NVIDIA A100")]
    result = run([claim(exactly("any"), exactly("h100", selectors=H100))], [slice_(devices)])
    assert [(r.request, r.device) for r in result.allocations[0].results] == [
        ("any", "gpu-1"),
        ("h100", "gpu-0"),
    ]


def test_a_device_in_use_is_skipped_before_its_selectors_run() -> None:
    """As the scheduler's allocateOne: "in use" is checked first, so a selector that would fail
    at runtime on a device in use never runs there."""
    devices = [gpu("gpu-0"), with_x(gpu("gpu-1"))]
    result = run(
        [claim(exactly(selectors=HAS_X))], [slice_(devices)], allocated=[allocated_claim("gpu-0")]
    )
    assert devices_of(result) == ["gpu-1"]
    assert run([claim(exactly(selectors=HAS_X))], [slice_(devices)]).error is not None


def test_admin_access_skips_only_the_devices_of_its_own_claim() -> None:
    devices = [gpu("gpu-0"), with_x(gpu("gpu-1"))]
    admin = exactly("admin", adminAccess=True, selectors=HAS_X)
    result = run([claim(exactly("a"), admin)], [slice_(devices)])
    assert [(r.request, r.device) for r in result.allocations[0].results] == [
        ("a", "gpu-0"),
        ("admin", "gpu-1"),
    ]
    other = run(
        [claim(exactly("admin", adminAccess=True))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        allocated=[allocated_claim("gpu-0")],
    )
    assert devices_of(other) == ["gpu-0"]


def test_admin_access_all_cannot_take_a_device_its_own_claim_holds() -> None:
    devices = [gpu("gpu-0"), gpu("gpu-1")]
    both = exactly("admin", adminAccess=True, allocationMode="All")
    assert not run([claim(exactly("a"), both)], [slice_(devices)]).satisfiable


# -- allocationMode All --------------------------------------------------------------------------


def test_allocation_mode_all_with_no_matching_device_does_not_fit() -> None:
    none = exactly(allocationMode="All", selectors=H100)
    result = run([claim(none)], [slice_([gpu("gpu-0", product="NVIDIA A100")])])
    assert not result.satisfiable
    assert result.error is None
    assert result.diagnoses[0].summary == "needs all matching devices, but none of 1 matches"


def test_allocation_mode_all_fails_the_attempt_on_a_constraint() -> None:
    devices = [gpu("gpu-0", root="a"), gpu("gpu-1", root="b")]
    result = run(
        [
            claim(
                exactly(allocationMode="All"),
                constraints=[{"matchAttribute": "resource.kubernetes.io/pcieRoot"}],
            )
        ],
        [slice_(devices)],
    )
    assert not result.satisfiable
    assert result.error == (
        "claim ns/c, request gpu: cannot add device gpu.nvidia.com/node1/gpu-1 because a claim "
        "constraint would not be satisfied"
    )


# -- at most 32 devices per claim ----------------------------------------------------------------

MANY = [gpu(f"gpu-{i}") for i in range(34)]
TOO_MANY = "more than 32 devices requested by one claim"


def test_a_claim_may_take_32_devices_and_no_more() -> None:
    assert len(devices_of(run([claim(exactly(count=32))], [slice_(MANY)]))) == 32
    assert run([claim(exactly(count=33))], [slice_(MANY)]).error == TOO_MANY
    split = run([claim(exactly("a"), exactly("b", count=32))], [slice_(MANY)])
    assert split.error == TOO_MANY
    later = run([claim(exactly(), name="a"), claim(exactly(count=33), name="b")], [slice_(MANY)])
    assert not later.satisfiable


# -- firstAvailable ------------------------------------------------------------------------------


def first_available(*subs: dict[str, Any], name: str = "gpu") -> dict[str, Any]:
    return {
        "name": name,
        "firstAvailable": [{"deviceClassName": "gpu.nvidia.com", **s} for s in subs],
    }


def test_first_available_passes_over_a_sub_request_that_asks_too_many() -> None:
    req = first_available({"name": "many", "count": 33}, {"name": "one"})
    result = run([claim(req)], [slice_(MANY)])
    assert [r.request for r in result.allocations[0].results] == ["gpu/one"]
    every = first_available({"name": "many", "count": 33}, {"name": "more", "count": 34})
    assert run([claim(every)], [slice_(MANY)]).error == TOO_MANY


def test_first_available_that_fits_nowhere_does_not_fit() -> None:
    req = first_available({"name": "h100", "selectors": [{"cel": {"expression": H100[0]}}]})
    result = run([claim(req)], [slice_([gpu("gpu-0", product="NVIDIA A100")])])
    assert not result.satisfiable
    assert result.error is None


def test_first_available_in_a_later_request_and_a_later_claim() -> None:
    req = first_available(
        {"name": "h100", "selectors": [{"cel": {"expression": H100[0]}}]}, {"name": "any"}
    )
    devices = [gpu("gpu-0"), gpu("gpu-1", product="NVIDIA A100")]
    later_request = run([claim(exactly("a"), req)], [slice_(devices)])
    assert [r.request for r in later_request.allocations[0].results] == ["a", "gpu/any"]
    later_claim = run([claim(exactly(), name="a"), claim(req, name="b")], [slice_(devices)])
    assert [r.request for r in later_claim.allocations[1].results] == ["gpu/any"]


def test_a_first_available_sub_request_may_take_all_devices() -> None:
    req = first_available({"name": "all", "allocationMode": "All"})
    result = run([claim(req)], [slice_([gpu("gpu-0"), gpu("gpu-1")])])
    assert [(r.request, r.device) for r in result.allocations[0].results] == [
        ("gpu/all", "gpu-0"),
        ("gpu/all", "gpu-1"),
    ]


# -- what placing a device checks, and what backtracking gives back ------------------------------

ROOT = "resource.kubernetes.io/pcieRoot"
EIGHT_SLICES = [
    {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
]


def test_a_constraint_over_named_requests_backtracks_across_them() -> None:
    devices = [
        gpu("gpu-0", root="a"),
        gpu("gpu-1", root="b", product="NVIDIA A100"),
        gpu("gpu-2", root="b"),
    ]
    result = run(
        [
            claim(
                exactly("any"),
                exactly("h100", selectors=H100),
                constraints=[{"requests": ["any", "h100"], "matchAttribute": ROOT}],
            )
        ],
        [slice_(devices)],
    )
    assert devices_of(result) == ["gpu-1", "gpu-2"]


def test_a_failed_second_constraint_undoes_the_first() -> None:
    devices = [
        gpu("gpu-0", root="a"),
        gpu("gpu-1", root="a", product="NVIDIA A100"),
        gpu("gpu-2", root="b"),
        gpu("gpu-3", root="a"),
    ]
    constraints = [
        {"requests": ["gpu"], "matchAttribute": ROOT},
        {"requests": ["gpu"], "matchAttribute": "gpu.nvidia.com/productName"},
    ]
    result = run([claim(exactly(count=2), constraints=constraints)], [slice_(devices)])
    assert devices_of(result) == ["gpu-0", "gpu-3"]


def test_a_refused_device_gives_its_counters_back() -> None:
    taint = [{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}]
    tainted = {**mig("tainted", start=0, size=4), "taints": taint}
    result = run(
        [claim(exactly(cls="mig.nvidia.com"))],
        [slice_([tainted, mig("same", start=0, size=4)], counters=EIGHT_SLICES)],
    )
    assert devices_of(result) == ["same"]
    same_profile = run(
        [
            claim(
                exactly("x", cls="mig.nvidia.com"),
                exactly("y", cls="mig.nvidia.com"),
                constraints=[{"requests": ["x", "y"], "matchAttribute": "gpu.nvidia.com/profile"}],
            )
        ],
        [
            slice_(
                [
                    mig("m0", start=0, size=2),
                    mig("m1", start=2, size=1),
                    mig("m2", start=2, size=2),
                ],
                counters=EIGHT_SLICES,
            )
        ],
    )
    assert devices_of(same_profile) == ["m0", "m2"]


def shared_gpu(name: str, memory: str = "80Gi", **extra: Any) -> dict[str, Any]:
    return gpu(
        name,
        memory=memory,
        allowMultipleAllocations=True,
        consumesCounters=[{"counterSet": "cs", "counters": {"c": {"value": "1"}}}],
        **extra,
    )


ONE_COUNTER = [{"name": "cs", "counters": {"c": {"value": "1"}}}]


def test_a_shared_device_takes_its_counters_once() -> None:
    part = exactly(capacity={"requests": {"memory": "10Gi"}})
    result = run(
        [claim(part, name="a"), claim(part, name="b")],
        [slice_([shared_gpu("gpu-0")], counters=ONE_COUNTER)],
    )
    assert devices_of(result) == ["gpu-0", "gpu-0"]
    ids = [a.results[0].share_id for a in result.allocations]
    assert len({str(uuid.UUID(str(i))) for i in ids}) == 2
    exhausted = run(
        [claim(exactly())],
        [slice_([gpu("gpu-0", **ONE_COUNTER_USE), shared_gpu("gpu-1")], counters=ONE_COUNTER)],
        allocated=[allocated_claim("gpu-0")],
    )
    assert not exhausted.satisfiable


ONE_COUNTER_USE: dict[str, Any] = {
    "consumesCounters": [{"counterSet": "cs", "counters": {"c": {"value": "1"}}}]
}


def test_a_device_without_the_capacity_gives_back_constraints_and_counters() -> None:
    small = shared_gpu("small", memory="10Gi")
    big = shared_gpu("big")
    result = run(
        [
            claim(
                exactly(capacity={"requests": {"memory": "20Gi"}}),
                constraints=[{"requests": ["gpu"], "matchAttribute": ROOT}],
            )
        ],
        [slice_([small, big], counters=ONE_COUNTER)],
    )
    assert devices_of(result) == ["big"]


def test_a_request_takes_a_shared_device_once() -> None:
    """Combinations, not permutations: a request's next device comes after its last one, so a
    request never takes one device twice, even one with room for two shares."""
    two = exactly(count=2, capacity={"requests": {"memory": "10Gi"}})
    one = run([claim(two)], [slice_([gpu("gpu-0", allowMultipleAllocations=True)])])
    assert not one.satisfiable
    devices = [gpu(f"gpu-{i}", allowMultipleAllocations=True) for i in range(2)]
    assert devices_of(run([claim(two)], [slice_(devices)])) == ["gpu-0", "gpu-1"]


def test_backtracking_gives_the_counters_of_a_first_choice_back() -> None:
    devices = [mig("big", start=0, size=4), mig("small", start=4, size=2)]
    four = ("device.attributes['gpu.nvidia.com'].profile == '4g'",)
    result = run(
        [
            claim(
                exactly("any", cls="mig.nvidia.com"),
                exactly("4g", cls="mig.nvidia.com", selectors=four),
            )
        ],
        [slice_(devices, counters=EIGHT_SLICES)],
    )
    assert devices_of(result) == ["small", "big"]


def test_the_devices_of_an_incomplete_pool_are_not_used() -> None:
    result = run([claim(exactly())], [slice_([gpu("gpu-0")], count=2)])
    assert not result.satisfiable


# -- devices the scheduler never selects: binding conditions off, another node's -----------------


def test_without_the_feature_a_device_with_binding_conditions_is_never_taken() -> None:
    bc: dict[str, Any] = {"bindingConditions": ["attached"], "bindingFailureConditions": ["f"]}
    devices = [gpu("gpu-0", root="a"), gpu("bc-1", root="b", **bc), gpu("gpu-2", root="b")]
    claims = [
        parse_claim(claim(exactly(count=2), constraints=[{"matchAttribute": ROOT}])),
        parse_claim(claim(exactly(), name="one")),
    ]

    def attempt(*which: int) -> Any:
        return allocate(
            [claims[i] for i in which],
            classes=CLASSES,
            slices=[parse_slice(slice_(devices))],
            node=NODE,
            binding_conditions=False,
        )

    assert not attempt(0).satisfiable  # bc-1 is refused again after the backtrack
    on = allocate(claims[:1], classes=CLASSES, slices=[parse_slice(slice_(devices))], node=NODE)
    assert devices_of(on) == ["bc-1", "gpu-2"]
    assert devices_of(attempt(1)) == ["gpu-0"]
    assert devices_of(attempt(1, 1)) == ["gpu-0", "gpu-2"]


def test_a_device_of_another_node_is_never_taken() -> None:
    s = slice_([gpu("gpu-0", nodeName="node2"), gpu("gpu-1", nodeName="node1")])
    del s["spec"]["nodeName"]
    s["spec"]["perDeviceNodeSelection"] = True
    assert devices_of(run([claim(exactly())], [s])) == ["gpu-1"]
