"""Why a request cannot be allocated (scheduling/allocator/reasons.py): each device's reasons
and the claims that keep it from the request, and the one-line summary of each request."""

from __future__ import annotations

from typing import Any

from dra_driver.scheduling.allocator import (
    AllocationResult,
    DeviceVerdict,
    RequestDiagnosis,
    allocate,
    apply_taint_rules,
    parse_claim,
    parse_device_taint_rule,
    parse_slice,
)
from tests.allocatordata import (
    CLASSES,
    DRIVER,
    NODE,
    allocated_claim,
    claim,
    exactly,
    gpu,
    mig,
    run,
    slice_,
)

MIG = "mig.nvidia.com"
EIGHT_SLICES = [
    {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
]


def held(name: str, *devices: str, share: bool = False) -> dict[str, Any]:
    c = allocated_claim(*devices, share=share)
    c["metadata"]["name"] = name
    return c


def failed(result: AllocationResult) -> RequestDiagnosis:
    assert not result.satisfiable
    return result.diagnoses[0]


def reasons_of(result: AllocationResult, index: int = 0) -> dict[str, tuple[str, ...]]:
    return {v.device: v.reasons for v in result.diagnoses[index].verdicts}


def summaries(result: AllocationResult) -> list[str]:
    assert not result.satisfiable
    return [d.summary for d in result.diagnoses]


# -- the diagnosis of a request ---------------------------------------------------------------


def test_a_diagnosis_names_claim_request_class_and_each_device_with_its_holders() -> None:
    result = run(
        [claim(exactly("gpu", count=2))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        allocated=[held("a", "gpu-0")],
    )
    assert result.diagnoses == (
        RequestDiagnosis(
            claim="ns/c",
            request="gpu",
            device_class="gpu.nvidia.com",
            wanted="2",
            summary="needs 2, 1 of 2 devices usable: gpu-1; 1 matching device is allocated: "
            "gpu-0 (ns/a)",
            verdicts=(
                DeviceVerdict(DRIVER, "node1", "gpu-0", ("in use by ns/a",), ("ns/a",)),
                DeviceVerdict(DRIVER, "node1", "gpu-1", (), ()),
            ),
            all_taken=False,
        ),
    )


def test_all_taken_only_when_allocated_claims_hold_every_matching_device() -> None:
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("small", memory="1Gi")])]
    big = exactly(
        selectors=("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('2Gi')) > 0",)
    )
    result = run([claim(big)], slices, allocated=[held("a", "gpu-0"), held("b", "gpu-1")])
    diagnosis = failed(result)
    assert diagnosis.all_taken
    assert diagnosis.summary == ("all 2 matching devices are allocated: gpu-0 (ns/a), gpu-1 (ns/b)")
    nothing = run([claim(exactly(cls=MIG))], slices)
    assert not failed(nothing).all_taken


def test_an_all_request_wants_all() -> None:
    result = run(
        [claim(exactly(allocationMode="All"))],
        [slice_([gpu("gpu-0")])],
        allocated=[held("a", "gpu-0")],
    )
    diagnosis = failed(result)
    assert diagnosis.wanted == "all"
    assert diagnosis.summary == "needs all 1 matching devices, but 1 is allocated: gpu-0 (ns/a)"


# -- each device's reasons --------------------------------------------------------------------


def test_a_device_of_an_invalid_or_incomplete_pool_says_so() -> None:
    invalid = [slice_([gpu("d")], name="a", count=2), slice_([gpu("d")], name="b", count=2)]
    assert reasons_of(run([claim(exactly())], invalid))["d"] == (
        "pool node1 is invalid: device name d is not unique in the pool",
    )
    incomplete = [slice_([gpu("d")], count=2)]
    assert reasons_of(run([claim(exactly())], incomplete))["d"] == (
        "pool node1 is incomplete (not all of its slices are published)",
    )


def test_a_device_of_another_node_says_so() -> None:
    s = slice_([gpu("theirs", nodeName="node2"), gpu("everywhere", allNodes=True)])
    del s["spec"]["nodeName"]
    s["spec"]["perDeviceNodeSelection"] = True
    result = run([claim(exactly(count=2))], [s])
    assert reasons_of(result) == {"theirs": ("not available on node node1",), "everywhere": ()}
    assert failed(result).summary == "needs 2, 1 of 2 devices usable: everywhere"


def test_a_device_with_binding_conditions_is_not_selectable_with_the_feature_off() -> None:
    device = gpu(
        "gpu-0", bindingConditions=["attached", "ready"], bindingFailureConditions=["failed"]
    )
    result = allocate(
        [parse_claim(claim(exactly()))],
        classes=CLASSES,
        slices=[parse_slice(slice_([device]))],
        node=NODE,
        binding_conditions=False,
    )
    assert reasons_of(result)["gpu-0"] == (
        "has bindingConditions (attached, ready): not selectable with DRADeviceBindingConditions "
        "off (the default before 1.36)",
    )
    assert failed(result).summary == "needs 1, 0 of 1 devices usable"


def test_the_first_failing_selector_is_named_with_each_reason() -> None:
    sel = (
        "device.attributes['gpu.nvidia.com'].productName == 'A' && "
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('90Gi')) >= 0"
    )
    result = run([claim(exactly(selectors=("true", sel)))], [slice_([gpu("gpu-0")])])
    assert reasons_of(result)["gpu-0"] == (
        "request selector #1: productName is 'NVIDIA H100', not 'A'; memory 80Gi is less than 90Gi",
    )


def test_a_shared_devices_capacity_names_its_holders() -> None:
    shared = gpu("gpu-0", allowMultipleAllocations=True)
    result = run(
        [claim(exactly(capacity={"requests": {"memory": "30Gi"}}))],
        [slice_([shared])],
        allocated=[held("a", "gpu-0", share=True), held("b", "gpu-0", share=True)],
    )
    assert reasons_of(result)["gpu-0"] == (
        "memory: 30Gi requested, 20Gi left on gpu-0 (in use by ns/a, ns/b)",
    )
    assert failed(result).summary == (
        "the one matching device is taken by allocated claims: gpu-0 (ns/a, ns/b)"
    )
    too_big = run(
        [claim(exactly(capacity={"requests": {"memory": "90Gi"}}))],
        [slice_([shared])],
        allocated=[held("a", "gpu-0", share=True)],
    )
    # more than the device has: its holders are not to blame
    assert reasons_of(too_big)["gpu-0"] == ("memory: 90Gi requested, 50Gi left on gpu-0",)
    assert failed(too_big).verdicts[0].in_use_by == ()
    assert failed(too_big).summary == "needs 1, 0 of 1 devices usable"


# -- counters ---------------------------------------------------------------------------------


def drawing(name: str, counters: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "mig"}},
        "consumesCounters": [
            {"counterSet": "cs", "counters": {n: {"value": v} for n, v in counters.items()}}
        ],
        **extra,
    }


def counter_set(**counters: str) -> list[dict[str, Any]]:
    return [{"name": "cs", "counters": {n: {"value": v} for n, v in counters.items()}}]


def test_plain_counters_say_what_is_needed_left_and_who_uses_them() -> None:
    devices = [drawing(f"d{i}", {"sm": "20", "mem": "12Gi"}) for i in range(5)]
    want = drawing("want", {"sm": "60", "mem": "30Gi", "x": "1500000"})
    want["attributes"]["profile"] = {"string": "big"}
    result = run(
        [
            claim(
                exactly(
                    cls=MIG, selectors=("device.attributes['gpu.nvidia.com'].profile == 'big'",)
                )
            )
        ],
        [slice_([*devices, want], counters=counter_set(sm="132", mem="80Gi", x="1000000"))],
        allocated=[held(f"h{i}", f"d{i}") for i in range(5)],
    )
    # three holders at most are named; whole MiB in binary units, anything else in decimal
    assert reasons_of(result)["want"] == (
        "counters of cs: sm: needs 60, 32 left (used by d0 of claim ns/h0, d1 of claim ns/h1, "
        "d2 of claim ns/h2); mem: needs 30Gi, 20Gi left (used by d0 of claim ns/h0, d1 of claim "
        "ns/h1, d2 of claim ns/h2); x: needs 1500k, 1M left",
    )
    assert failed(result).summary.startswith(
        "the one matching device is taken by allocated claims: want (ns/h0, ns/h1, ns/h2, ns/h3, "
    )


def test_a_counter_short_without_any_claim_or_overdrawn_says_so() -> None:
    result = run(
        [claim(exactly(cls=MIG))],
        [
            slice_(
                [drawing("want", {"mem": "2Mi", "sm": "2"})],
                counters=counter_set(mem="1Mi", sm="1"),
            )
        ],
    )
    assert reasons_of(result)["want"] == (
        "counters of cs: mem: needs 2Mi, 1Mi left; sm: needs 2, 1 left",
    )
    # an allocated device took more than the set has: nothing is left, not less than nothing
    devices = [drawing("big", {"sm": "3"}), drawing("want", {"sm": "1"})]
    result = run(
        [claim(exactly(cls=MIG))],
        [slice_(devices, counters=counter_set(sm="2"))],
        allocated=[held("a", "big")],
    )
    assert reasons_of(result)["want"] == (
        "counters of cs: sm: needs 1, 0 left (used by big of claim ns/a)",
    )


def test_memory_slices_name_the_span_and_the_devices_holding_them() -> None:
    devices = [
        mig("a", start=0, size=1, counter_set="gpu-0-cs"),
        mig("b", start=1, size=1, counter_set="gpu-0-cs"),
        mig("c", start=3, size=1, counter_set="gpu-0-cs"),
        mig("want", start=0, size=4, counter_set="gpu-0-cs"),
    ]
    result = run(
        [
            claim(
                exactly(cls=MIG, selectors=("device.attributes['gpu.nvidia.com'].profile == '4g'",))
            )
        ],
        [slice_(devices, counters=EIGHT_SLICES)],
        allocated=[held("x", "a", "b"), held("y", "c")],
    )
    assert reasons_of(result)["want"] == (
        "4g at placement 0 needs memory-slice-0..3 of gpu-0-cs; memory-slice-0 is used by a of "
        "claim ns/x; memory-slice-1 is used by b of claim ns/x; memory-slice-3 is used by c of "
        "claim ns/y",
    )
    assert failed(result).summary == (
        "the one matching device is taken by allocated claims: want (ns/x, ns/y)"
    )


def test_slices_held_together_are_named_together() -> None:
    odd = mig("odd", start=1, size=1, counter_set="gpu-0-cs")
    odd["consumesCounters"][0]["counters"]["memory-slice-3"] = {"value": "1"}
    want = mig("want", start=0, size=4, counter_set="gpu-0-cs")
    result = run(
        [
            claim(
                exactly(cls=MIG, selectors=("device.attributes['gpu.nvidia.com'].profile == '4g'",))
            )
        ],
        [slice_([odd, want], counters=EIGHT_SLICES)],
        allocated=[held("x", "odd")],
    )
    assert reasons_of(result)["want"] == (
        "4g at placement 0 needs memory-slice-0..3 of gpu-0-cs; memory-slice-1, memory-slice-3 "
        "are used by odd of claim ns/x",
    )


def test_two_indexed_counters_in_one_set_are_named_without_the_profile() -> None:
    device = drawing("want", {"a-0": "1", "a-1": "1", "b-2": "1"})
    device["attributes"]["profile"] = {"string": "1g"}
    result = run(
        [claim(exactly(cls=MIG))],
        [slice_([device], counters=counter_set(**{"a-0": "0", "a-1": "1", "b-2": "0"}))],
    )
    assert reasons_of(result)["want"] == (
        "needs a-0..1 of cs; a-0 is not available",
        "needs b-2 of cs; b-2 is not available",
    )


# -- the summary ------------------------------------------------------------------------------


def test_summaries_of_all_requests() -> None:
    none = run(
        [claim(exactly(cls=MIG, allocationMode="All"))], [slice_([gpu("gpu-0"), gpu("gpu-1")])]
    )
    assert summaries(none) == ["needs all matching devices, but none of 2 matches"]
    overlap = [mig("a", start=0, size=2), mig("b", start=1, size=2)]
    together = run(
        [claim(exactly(cls=MIG, allocationMode="All"))], [slice_(overlap, counters=EIGHT_SLICES)]
    )
    assert summaries(together) == [
        "needs all 2 matching devices (a, b); not all of them can be allocated together"
    ]
    two = run(
        [claim(exactly(allocationMode="All"))],
        [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2")])],
        allocated=[held("a", "gpu-0"), held("b", "gpu-1")],
    )
    assert summaries(two) == [
        "needs all 3 matching devices, but 2 are allocated: gpu-0 (ns/a), gpu-1 (ns/b)"
    ]


def test_summaries_count_usable_and_taken_devices() -> None:
    many = [gpu(f"gpu-{i}") for i in range(10)]
    result = run([claim(exactly(count=12))], [slice_(many)])
    assert summaries(result) == [  # eight names at most
        "needs 12, 10 of 10 devices usable: gpu-0, gpu-1, gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, "
        "gpu-7 ..."
    ]
    result = run([claim(exactly(count=12))], [slice_(many[:8])])
    assert summaries(result)[0].endswith("gpu-6, gpu-7")
    result = run([claim(exactly(count=9))], [slice_(many)], allocated=[held("a", "gpu-0", "gpu-1")])
    assert summaries(result) == [
        "needs 9, 8 of 10 devices usable: gpu-2, gpu-3, gpu-4, gpu-5, gpu-6, gpu-7, gpu-8, gpu-9; "
        "2 matching devices are allocated: gpu-0 (ns/a), gpu-1 (ns/a)"
    ]
    result = run(
        [claim(exactly(count=2))],
        [slice_(many[:2])],
        allocated=[held("a", "gpu-0"), held("b", "gpu-1")],
    )
    assert summaries(result) == ["all 2 matching devices are allocated: gpu-0 (ns/a), gpu-1 (ns/b)"]
    result = run([claim(exactly(count=2))], [slice_(many[:1])], allocated=[held("a", "gpu-0")])
    assert summaries(result) == ["the one matching device is allocated: gpu-0 (ns/a)"]


def test_summaries_of_constraints() -> None:
    devices = [gpu("a", root="pci0"), gpu("b", root="pci1"), gpu("c", root="pci1"), gpu("d")]
    del devices[3]["attributes"]["resource.kubernetes.io/pcieRoot"]
    same = {"matchAttribute": "resource.kubernetes.io/pcieRoot"}
    result = run([claim(exactly(count=3), constraints=[same])], [slice_(devices)])
    assert summaries(result) == [
        "needs 3 devices with the same resource.kubernetes.io/pcieRoot; usable devices have "
        "'pci0' x1, 'pci1' x2 (1 lack it)"
    ]
    result = run(
        [claim(exactly(count=2), constraints=[same])],
        [slice_([devices[0], devices[1]])],
        allocated=[held("x", "gpu-9")],
    )
    assert summaries(result) == [
        "needs 2 devices with the same resource.kubernetes.io/pcieRoot; usable devices have "
        "'pci0' x1, 'pci1' x1"
    ]
    result = run(
        [claim(exactly(count=2), constraints=[{"matchAttribute": "gpu.nvidia.com/nope"}])],
        [slice_(devices)],
    )
    assert summaries(result) == [
        "needs 2 devices with the same gpu.nvidia.com/nope; usable devices have no such attribute "
        "(4 lack it)"
    ]
    distinct = {"distinctAttribute": "resource.kubernetes.io/pcieRoot"}
    result = run([claim(exactly(count=3), constraints=[distinct])], [slice_(devices)])
    assert summaries(result) == [
        "needs 3 devices with distinct resource.kubernetes.io/pcieRoot; only 2 distinct values "
        "among usable devices"
    ]
    result = run(
        [claim(exactly(count=2), constraints=[distinct])],
        [slice_(devices[1:3])],
        allocated=[held("x", "gpu-9")],
    )
    assert summaries(result) == [
        "needs 2 devices with distinct resource.kubernetes.io/pcieRoot; only 1 distinct values "
        "among usable devices"
    ]


def test_summaries_of_counters_capacity_and_the_rest() -> None:
    overlap = [mig("a", start=0, size=2), mig("b", start=1, size=2)]
    result = run([claim(exactly(cls=MIG, count=2))], [slice_(overlap, counters=EIGHT_SLICES)])
    assert summaries(result) == [
        "2 devices usable (a, b), but no 2 of them fit the shared counters together (overlapping "
        "partitions) alongside the other requests"
    ]
    counters = [{"name": "cs", "counters": {"x": {"value": "2"}}}]
    dev = gpu(
        "gpu-0",
        allowMultipleAllocations=True,
        consumesCounters=[{"counterSet": "cs", "counters": {"x": {"value": "1"}}}],
    )
    half: dict[str, Any] = {"capacity": {"requests": {"memory": "50Gi"}}}
    # Shares of one device take its counters once (two are left): not a counter problem.
    result = run(
        [claim(exactly("a", **half), exactly("b", **half))], [slice_([dev], counters=counters)]
    )
    capacity = CAPACITY.format("1 devices usable (gpu-0)", "its")
    assert summaries(result) == [capacity, capacity]
    plain = gpu("gpu-0", allowMultipleAllocations=True)
    result = run([claim(exactly("a", **half), exactly("b", **half))], [slice_([plain])])
    assert summaries(result) == [capacity, capacity]


def test_shared_devices_short_of_counters_not_capacity_say_counters() -> None:
    counters = [{"name": "cs", "counters": {"x": {"value": "1"}}}]
    devices = [
        gpu(
            n,
            product=n,
            allowMultipleAllocations=True,
            consumesCounters=[{"counterSet": "cs", "counters": {"x": {"value": "1"}}}],
        )
        for n in ("A", "B")
    ]
    only = "device.attributes['gpu.nvidia.com'].productName == '{}'"
    result = run(
        [
            claim(
                exactly("a", selectors=(only.format("A"),)),
                exactly("b", selectors=(only.format("B"),)),
            )
        ],
        [slice_(devices, counters=counters)],
    )
    assert summaries(result) == [
        f"1 devices usable ({n}), but no 1 of them fit the shared counters together (overlapping "
        "partitions) alongside the other requests"
        for n in "AB"
    ]
    sel = "device.attributes['gpu.nvidia.com'].productName == 'A'"
    result = run(
        [claim(exactly("a"), exactly("b", selectors=(sel,)))], [slice_([gpu("gpu-0", product="A")])]
    )
    assert summaries(result) == [GENERIC.format("1 devices usable (gpu-0)")] * 2


def test_an_aborted_attempt_says_the_devices_were_usable() -> None:
    bad = "device.attributes['gpu.nvidia.com'].nope == 'x'"
    result = run(
        [claim(exactly("a"), exactly("b", selectors=(bad,)))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
    )
    assert result.error is not None
    assert summaries(result)[0] == (
        "2 devices usable (gpu-0, gpu-1), but the attempt was given up on the error above"
    )


def test_with_the_feature_off_binding_conditions_come_before_selectors() -> None:
    sel = "device.attributes['gpu.nvidia.com'].productName == 'A'"
    devices = [gpu("bc", bindingConditions=["ok"]), gpu("plain")]
    result = allocate(
        [parse_claim(claim(exactly(selectors=(sel,))))],
        classes=CLASSES,
        slices=[parse_slice(slice_(devices))],
        node=NODE,
        binding_conditions=False,
    )
    assert reasons_of(result) == {
        "bc": (
            "has bindingConditions (ok): not selectable with DRADeviceBindingConditions off "
            "(the default before 1.36)",
        ),
        "plain": ("request selector #0: productName is 'NVIDIA H100', not 'A'",),
    }


def test_a_taint_not_tolerated_is_named_with_its_rule() -> None:
    device = gpu(
        "gpu-0", taints=[{"key": "example.com/xid", "value": "48", "effect": "NoSchedule"}]
    )
    result = run([claim(exactly())], [slice_([device])])
    assert reasons_of(result)["gpu-0"] == ("taint example.com/xid=48:NoSchedule is not tolerated",)
    rule = parse_device_taint_rule(
        {
            "kind": "DeviceTaintRule",
            "metadata": {"name": "broken"},
            "spec": {
                "taint": {"key": "k", "effect": "NoExecute"},
                "deviceSelector": {"device": "gpu-1"},
            },
        }
    )
    slices = apply_taint_rules([parse_slice(slice_([gpu("gpu-1")]))], [rule], classes=CLASSES)
    result = allocate([parse_claim(claim(exactly()))], classes=CLASSES, slices=slices, node=NODE)
    assert reasons_of(result)["gpu-1"] == (
        "taint k:NoExecute is not tolerated (from DeviceTaintRule broken)",
    )


def test_counters_of_a_set_the_pool_lacks_are_each_named_unless_the_pool_is_invalid() -> None:
    device = drawing("want", {"a": "1", "b": "1"})
    device["consumesCounters"][0]["counterSet"] = "nope"
    result = run([claim(exactly(cls=MIG))], [slice_([device], counters=counter_set(a="1"))])
    assert reasons_of(result)["want"] == (
        "consumes unknown counter nope/a",
        "consumes unknown counter nope/b",
    )
    invalid = [
        slice_([device], name="s1", count=2, counters=counter_set(a="1")),
        slice_([device], name="s2", count=2),
    ]
    result = run([claim(exactly(cls=MIG))], invalid)
    assert reasons_of(result)["want"] == (
        "pool node1 is invalid: device name want is not unique in the pool",
    )


def test_a_span_not_at_zero_and_a_qualified_profile() -> None:
    held_device = mig("a", start=5, size=2)
    want = mig("want", start=4, size=4)
    want["attributes"] = {
        "type": {"string": "mig"},
        "gpu.nvidia.com/profile": {"string": "4g.40gb"},
    }
    result = run(
        [
            claim(
                exactly(
                    cls=MIG, selectors=("device.attributes['gpu.nvidia.com'].profile == '4g.40gb'",)
                )
            )
        ],
        [slice_([held_device, want], counters=EIGHT_SLICES)],
        allocated=[held("x", "a")],
    )
    assert reasons_of(result)["want"] == (
        "4g.40gb at placement 4 needs memory-slice-4..7 of gpu-0-cs; memory-slice-5..6 are used "
        "by a of claim ns/x",
    )


def test_a_constraint_that_holds_leads_on_to_the_counters() -> None:
    # Both partitions have the same profile (the match holds) or distinct ones (so does that):
    # what fails is the counters.
    same = [mig("a", start=0, size=2), mig("b", start=1, size=2)]
    result = run(
        [
            claim(
                exactly(cls=MIG, count=2),
                constraints=[{"matchAttribute": "gpu.nvidia.com/profile"}],
            )
        ],
        [slice_(same, counters=EIGHT_SLICES)],
    )
    counters = (
        "2 devices usable (a, b), but no 2 of them fit the shared counters together (overlapping "
        "partitions) alongside the other requests"
    )
    assert summaries(result) == [counters]
    distinct = [mig("a", start=0, size=2), mig("b", start=1, size=3)]
    result = run(
        [
            claim(
                exactly(cls=MIG, count=2),
                constraints=[{"distinctAttribute": "gpu.nvidia.com/profile"}],
            )
        ],
        [slice_(distinct, counters=EIGHT_SLICES)],
    )
    assert summaries(result) == [counters]


def test_a_constraint_on_other_requests_is_passed_over() -> None:
    devices = [gpu("a", root="pci0"), gpu("b", root="pci0")]
    result = run(
        [
            claim(
                exactly(count=2),
                constraints=[
                    {"requests": ["other"], "matchAttribute": "resource.kubernetes.io/pcieRoot"},
                    {"distinctAttribute": "resource.kubernetes.io/pcieRoot"},
                ],
            )
        ],
        [slice_(devices)],
    )
    assert summaries(result) == [
        "needs 2 devices with distinct resource.kubernetes.io/pcieRoot; only 1 distinct values "
        "among usable devices"
    ]


def test_a_list_attribute_counts_each_value() -> None:
    devices = [gpu("a"), gpu("b")]
    devices[0]["attributes"]["gpu.nvidia.com/links"] = {"strings": ["x", "y"]}
    devices[1]["attributes"]["gpu.nvidia.com/links"] = {"strings": ["z"]}
    result = run(
        [claim(exactly(count=2), constraints=[{"matchAttribute": "gpu.nvidia.com/links"}])],
        [slice_(devices)],
    )
    assert summaries(result) == [
        "needs 2 devices with the same gpu.nvidia.com/links; usable devices have 'x' x1, 'y' x1, "
        "'z' x1"
    ]


CAPACITY = (
    "{}, but {} capacity cannot hold this request's share beside the shares of the other "
    "requests that can take no other device"
)
GENERIC = (
    "{}, but no combination satisfies the claim's constraints together with its other requests"
)
ONLY = "device.attributes['gpu.nvidia.com'].productName == '{}'"
NOTHING = "device.attributes['gpu.nvidia.com'].productName == 'none'"


def memory(name: str, size: str, only: str | None = None, **extra: Any) -> dict[str, Any]:
    selectors = [{"cel": {"expression": ONLY.format(only)}}] if only else []
    return {
        "name": name,
        "deviceClassName": "gpu.nvidia.com",
        "selectors": selectors,
        "capacity": {"requests": {"memory": size}},
        **extra,
    }


def shared(*names: str) -> list[dict[str, Any]]:
    return [gpu(n, product=n, allowMultipleAllocations=True) for n in names]


def by_request(result: AllocationResult) -> dict[str, str]:
    assert not result.satisfiable
    return {d.request: d.summary for d in result.diagnoses}


def test_the_capacity_sentence_counts_the_smallest_share_a_request_must_take_there() -> None:
    for x in (
        [memory("x1", "50Gi"), memory("x2", "20Gi")],
        [memory("x1", "20Gi"), memory("x2", "50Gi")],
    ):
        # "x" takes 20Gi at the least: beside "y"'s 55Gi that fits (what fails is "z")
        c = claim(
            {"name": "x", "firstAvailable": x},
            {"name": "y", "exactly": memory("y", "55Gi")},
            exactly("z", selectors=(NOTHING,)),
        )
        result = run([c], [slice_(shared("A"))])
        assert by_request(result)["y"] == GENERIC.format("1 devices usable (A)")
        c["spec"]["devices"]["requests"][1]["exactly"] = memory("y", "70Gi")
        result = run([c], [slice_(shared("A"))])
        assert by_request(result)["y"] == CAPACITY.format("1 devices usable (A)", "its")


def test_a_request_that_may_take_another_device_is_not_counted() -> None:
    c = claim(
        {"name": "any", "exactly": memory("any", "50Gi")},
        {"name": "a", "exactly": memory("a", "50Gi", only="A")},
        exactly("z", selectors=(NOTHING,)),
    )
    assert by_request(run([c], [slice_(shared("A", "B"))]))["a"] == GENERIC.format(
        "1 devices usable (A)"
    )


def test_the_capacity_sentence_when_every_usable_device_is_too_full() -> None:
    c = claim(
        {"name": "a", "exactly": memory("a", "50Gi", only="A")},
        {"name": "b", "exactly": memory("b", "50Gi", only="B")},
        {"name": "any", "exactly": memory("any", "50Gi")},
    )
    assert by_request(run([c], [slice_(shared("A", "B"))]))["any"] == CAPACITY.format(
        "2 devices usable (A, B)", "each one's"
    )


def test_what_allocated_claims_hold_counts_toward_the_capacity() -> None:
    result = run(
        [
            claim(
                exactly("a", capacity={"requests": {"memory": "40Gi"}}),
                exactly("b", capacity={"requests": {"memory": "20Gi"}}),
            )
        ],
        [slice_(shared("gpu-0"))],
        allocated=[held("h", "gpu-0", share=True)],
    )
    assert [d.summary for d in result.diagnoses] == [
        CAPACITY.format("1 devices usable (gpu-0)", "its")
    ] * 2


def test_a_selector_the_search_never_evaluated_does_not_break_the_diagnosis() -> None:
    bad = "device.attributes['gpu.nvidia.com'].nope == 'x'"
    c = claim(
        {"name": "a", "exactly": memory("a", "50Gi")},
        {"name": "b", "exactly": memory("b", "50Gi")},
        exactly("c", selectors=(bad,)),
    )
    result = run([c], [slice_(shared("A"))])
    assert result.error is None
    assert by_request(result)["a"] == CAPACITY.format("1 devices usable (A)", "its")


def test_shares_that_fill_a_device_exactly_leave_room_and_a_broken_selector_takes_none() -> None:
    # "a" and "b" fill gpu A exactly; what fails is "z". "c"'s selector, never evaluated by
    # the search (it stopped at "z"), fails with a CEL runtime error: it takes no share.
    bad = "device.attributes['gpu.nvidia.com'].nope == 'x'"
    c = claim(
        {"name": "a", "exactly": memory("a", "40Gi")},
        {"name": "b", "exactly": memory("b", "40Gi")},
        exactly("z", selectors=(NOTHING,)),
        exactly("c", selectors=(bad,)),
    )
    result = run([c], [slice_(shared("A"))])
    assert result.error is None
    assert by_request(result)["a"] == GENERIC.format("1 devices usable (A)")


def test_shares_on_a_device_that_no_longer_allows_them_are_no_capacity_taken() -> None:
    # The search does not count them either: the device is not in use (no exclusive holder).
    result = run(
        [claim(exactly(count=2))],
        [slice_([gpu("gpu-0")])],
        allocated=[held("h", "gpu-0", share=True)],
    )
    assert reasons_of(result) == {"gpu-0": ()}
