"""The allocator's entry point (scheduling/allocator/allocation.py): configs, input errors, claims
that are already allocated."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import CelCompileError, ExplainError
from dra_driver.scheduling.allocator import (
    MAX_RESULTS_PER_CLAIM,
    AllocationResult,
    ClaimAllocation,
    DeviceResult,
    Node,
    Toleration,
    allocate,
    compile_selectors,
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
    mig,
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


NODE1 = {
    "nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]}
    ]
}


def test_an_allocation_names_request_device_pool_and_node() -> None:
    tolerate = [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    result = run(
        [claim(exactly("gpu", tolerations=tolerate), exactly("watch", adminAccess=True))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
    )
    assert result == AllocationResult(
        node="node1",
        satisfiable=True,
        allocations=(
            ClaimAllocation(
                claim="ns/c",
                results=(
                    DeviceResult(
                        "gpu",
                        DRIVER,
                        "node1",
                        "gpu-0",
                        tolerations=(Toleration("k", "Exists", "", "NoSchedule"),),
                    ),
                    DeviceResult("watch", DRIVER, "node1", "gpu-1", admin_access=True),
                ),
                config=(),
                node_selector=NODE1,
            ),
        ),
    )


def test_a_share_of_a_device_carries_its_capacity_in_the_devices_format() -> None:
    shared = gpu("gpu-0", allowMultipleAllocations=True)
    shared["capacity"]["cores"] = {"value": "100"}
    asks = exactly(capacity={"requests": {"memory": "10Gi", "cores": "25"}})
    result = run(
        [claim(asks, exactly("second", capacity={"requests": {"memory": "1Gi", "cores": "75"}}))],
        [slice_([shared])],
    )
    first, second = result.allocations[0].results
    assert first.consumed_capacity == {"memory": "10Gi", "cores": "25"}
    assert second.consumed_capacity == {"memory": "1Gi", "cores": "75"}
    assert first.share_id and second.share_id and first.share_id != second.share_id


def _first_available(*subs: dict[str, Any]) -> dict[str, Any]:
    return {"name": "gpu", "firstAvailable": [{"name": s["name"], **s["exactly"]} for s in subs]}


BIG = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"


def test_a_first_available_request_takes_the_first_sub_request_that_fits() -> None:
    c = claim(_first_available(exactly("big", selectors=(BIG,)), exactly("small")), exactly("x"))
    c["spec"]["devices"]["config"] = [
        {"requests": ["gpu/small"], "opaque": {"driver": DRIVER, "parameters": {"n": 1}}},
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"n": 2}}},
        {"requests": ["gpu/big"], "opaque": {"driver": DRIVER, "parameters": {"n": 3}}},
        {"opaque": {"driver": DRIVER, "parameters": {"n": 4}}},
    ]
    result = run([c], [slice_([gpu("gpu-0", memory="40Gi"), gpu("gpu-1", memory="40Gi")])])
    assert [(r.request, r.device) for r in result.allocations[0].results] == [
        ("gpu/small", "gpu-0"),
        ("x", "gpu-1"),
    ]
    assert [
        (c["source"], c["requests"], c["opaque"]["parameters"])
        for c in result.allocations[0].config
    ] == [
        ("FromClaim", ["gpu/small"], {"n": 1}),
        ("FromClaim", ["gpu"], {"n": 2}),
        ("FromClaim", [], {"n": 4}),
    ]
    big = run([c], [slice_([gpu("gpu-0"), gpu("gpu-1", memory="40Gi")])])
    assert [r.request for r in big.allocations[0].results] == ["gpu/big", "x"]
    assert [c["opaque"]["parameters"]["n"] for c in big.allocations[0].config] == [2, 3, 4]


def test_a_class_config_names_the_requests_of_that_class() -> None:
    cls = dict(CLASSES)
    for name in ("gpu.nvidia.com", "mig.nvidia.com"):
        obj = next(o for o in default_device_classes() if o["metadata"]["name"] == name)
        obj["spec"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": {"class": name}}}]
        cls[name] = parse_device_class(obj)
    counters = [{"name": "gpu-0-cs", "counters": {"memory-slice-0": {"value": "1"}}}]
    slices = [
        parse_slice(
            slice_([gpu("gpu-0"), gpu("gpu-1"), mig("m", start=0, size=1)], counters=counters)
        )
    ]
    c = claim(exactly("a"), exactly("b"), exactly("m", cls="mig.nvidia.com"))
    result = allocate([parse_claim(c)], classes=cls, slices=slices, node=NODE)
    assert [
        (c["source"], c["requests"], c["opaque"]["parameters"]["class"])
        for c in result.allocations[0].config
    ] == [
        ("FromClass", ["a", "b"], "gpu.nvidia.com"),
        ("FromClass", ["m"], "mig.nvidia.com"),
    ]


def test_an_all_request_takes_every_device_whose_capacity_can_hold_it() -> None:
    devices = [
        gpu(n, memory=m, allowMultipleAllocations=True)
        for n, m in (("small", "40Gi"), ("big-0", "80Gi"), ("big-1", "80Gi"))
    ]
    asks = exactly(allocationMode="All", capacity={"requests": {"memory": "50Gi"}})
    assert devices_of(run([claim(asks)], [slice_(devices)])) == ["big-0", "big-1"]


def test_an_all_request_fails_on_the_first_invalid_or_incomplete_pool() -> None:
    invalid = [
        slice_([gpu("d")], pool="a-pool", name="a1", count=2),
        slice_([gpu("d")], pool="a-pool", name="a2", count=2),
    ]
    incomplete = slice_([gpu("e")], pool="b-pool", name="b", count=2)
    all_ = claim(exactly(allocationMode="All"))
    result = run([all_], [*invalid, incomplete])
    assert result.error == (
        f"request gpu: asks for all devices, but resource pool {DRIVER}/a-pool is currently invalid"
    )
    assert result.notes == (
        f"pool {DRIVER}/a-pool is invalid (device name d is not unique in the pool); "
        "its devices are not used",
        f"pool {DRIVER}/b-pool is incomplete (not all of its slices are published); "
        "its devices are not used",
    )
    assert result.diagnoses[0].summary == result.error
    result = run([all_], [incomplete, slice_([gpu("f")], pool="c-pool", name="c")])
    assert result.error == (
        f"request gpu: asks for all devices, but resource pool {DRIVER}/b-pool is currently "
        "being updated"
    )


def test_more_devices_than_a_claim_may_hold_is_an_error() -> None:
    n = MAX_RESULTS_PER_CLAIM + 1
    result = run([claim(exactly(count=n))], [slice_([gpu(f"gpu-{i}") for i in range(n)])])
    assert not result.satisfiable
    assert result.error == "more than 32 devices requested by one claim"


def test_an_unsatisfiable_claim_is_diagnosed_unless_asked_not_to() -> None:
    c = [parse_claim(claim(exactly(count=2)))]
    slices = [parse_slice(slice_([gpu("gpu-0")]))]
    result = allocate(c, classes=CLASSES, slices=slices, node=NODE)
    assert result == AllocationResult(node="node1", satisfiable=False, diagnoses=result.diagnoses)
    assert [d.summary for d in result.diagnoses] == ["needs 2, 1 of 1 devices usable: gpu-0"]
    quiet = allocate(c, classes=CLASSES, slices=slices, node=NODE, diagnose=False)
    assert quiet == AllocationResult(node="node1", satisfiable=False)


def test_a_cel_runtime_error_is_the_results_error_and_the_diagnosis_says_so() -> None:
    bad = "device.attributes['gpu.nvidia.com'].nope == 'x'"
    result = run([claim(exactly(selectors=(bad,)))], [slice_([gpu("gpu-0")])])
    assert not result.satisfiable
    assert result.error is not None
    assert result.error.startswith("claim ns/c: request gpu: selector #0 on device ")
    assert result.diagnoses[0].request == "gpu"
    two = run(
        [claim(exactly("a"), exactly("b", selectors=(bad,)))],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
    )
    assert two.diagnoses[0].summary == (
        "2 devices usable (gpu-0, gpu-1), but the attempt was given up on the error above"
    )


def test_a_device_of_another_node_in_a_per_device_slice_is_not_taken() -> None:
    s = slice_([gpu("theirs", nodeName="node2"), gpu("mine", nodeName="node1")])
    del s["spec"]["nodeName"]
    s["spec"]["perDeviceNodeSelection"] = True
    result = run([claim(exactly())], [s])
    assert devices_of(result) == ["mine"]
    assert result.allocations[0].node_selector == NODE1


def test_unknown_classes_are_named_with_the_known_ones() -> None:
    with pytest.raises(ExplainError) as err:
        run([claim(_first_available(exactly("a"), exactly("b", cls="nope")))], [])
    assert str(err.value) == (
        "claim ns/c: request gpu/b: device class 'nope' not found "
        "(known: gpu.nvidia.com, mig.nvidia.com)"
    )
    with pytest.raises(
        ExplainError, match=r"request gpu: device class 'x' not found \(known: none\)"
    ):
        allocate([parse_claim(claim(exactly(cls="x")))], classes={}, slices=[], node=NODE)


def test_a_class_selector_that_does_not_compile_is_named() -> None:
    cls = {
        "metadata": {"name": "broken"},
        "spec": {
            "selectors": [{"cel": {"expression": "true"}}, {"cel": {"expression": "device.nope"}}]
        },
    }
    with pytest.raises(
        CelCompileError, match=r"^DeviceClass broken: spec.selectors\[1\]: CEL compile"
    ):
        allocate(
            [parse_claim(claim(exactly(cls="broken")))],
            classes={"broken": parse_device_class(cls)},
            slices=[],
            node=NODE,
        )


def _held(name: str, device: str, *nodes: str) -> dict[str, Any]:
    held = allocated_claim(device)
    held["metadata"]["name"] = name
    if nodes:
        held["status"]["allocation"]["nodeSelector"] = {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": list(nodes)}]}
            ]
        }
    return held


def test_claims_already_allocated_are_noted_each_and_kept() -> None:
    held = [_held("a", "gpu-0", "node1"), _held("b", "gpu-1")]
    result = run(
        [claim(exactly(), name="a"), claim(exactly(), name="b")],
        [slice_([gpu("gpu-0"), gpu("gpu-1")])],
        allocated=held,
    )
    assert result.satisfiable and result.node == "node1"
    assert [a.claim for a in result.allocations] == ["ns/a", "ns/b"]
    assert result.notes == tuple(
        f"claim ns/{n} is already allocated (status.allocation of ns/{n}): "
        "shown as it is, not allocated again"
        for n in "ab"
    )


def test_a_claim_allocated_elsewhere_is_named_with_its_nodes() -> None:
    slices = [slice_([gpu("gpu-0"), gpu("gpu-1")], count=2)]
    claims = [claim(exactly(), name="new"), claim(exactly(), name="b")]
    result = run(claims, slices, allocated=[_held("b", "gpu-1", "node2", "node3")])
    assert result == AllocationResult(
        node="node1",
        satisfiable=False,
        error="claim ns/b is already allocated, for nodes node2, node3",
        notes=(
            f"pool {DRIVER}/node1 is incomplete (not all of its slices are published); "
            "its devices are not used",
            "claim ns/b is already allocated (status.allocation of ns/b): "
            "shown as it is, not allocated again",
        ),
    )
    zone = _held("b", "gpu-1")
    zone["status"]["allocation"]["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node1"]}]},
        ]
    }
    result = run(claims, slices, allocated=[zone])
    assert result.error == (
        "claim ns/b is already allocated, for other nodes "
        "(its nodeSelector does not match this one)"
    )


def _zone(zone: str, key: str = "zone") -> dict[str, Any]:
    return {"key": key, "operator": "In", "values": [zone]}


def _selector_slice(name: str, pool: str, *devices: dict[str, Any], **spec: Any) -> dict[str, Any]:
    s = slice_(list(devices), name=name, pool=pool)
    del s["spec"]["nodeName"]
    s["spec"].update(spec)
    return s


ZONED = Node("node1", labels={"zone": "a", "rack": "r1"})


def test_the_allocations_node_selector_joins_the_slices_requirements() -> None:
    by_label = {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [_zone("a")],
                "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node9"]}],
            }
        ]
    }
    by_rack = {"nodeSelectorTerms": [{"matchExpressions": [_zone("a"), _zone("r1", "rack")]}]}
    slices = [
        _selector_slice("a", "a-pool", gpu("gpu-0"), nodeSelector=by_label),
        _selector_slice("b", "b-pool", gpu("gpu-1"), nodeSelector=by_rack),
    ]
    result = allocate(
        [parse_claim(claim(exactly(count=2)))],
        classes=CLASSES,
        slices=[parse_slice(s) for s in slices],
        node=ZONED,
    )
    assert result.allocations[0].node_selector == {
        "nodeSelectorTerms": [
            {
                "matchExpressions": [_zone("a"), _zone("r1", "rack")],
                "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node9"]}],
            }
        ]
    }
    result = allocate(
        [parse_claim(claim(exactly()))],
        classes=CLASSES,
        slices=[parse_slice(slices[1])],
        node=ZONED,
    )
    assert result.allocations[0].node_selector == by_rack


def test_devices_on_all_nodes_leave_the_allocation_without_a_node_selector() -> None:
    everywhere = _selector_slice("a", "a-pool", gpu("gpu-0"), allNodes=True)
    assert run([claim(exactly())], [everywhere]).allocations[0].node_selector is None


def test_a_per_device_node_selector_is_the_devices() -> None:
    zone = {"nodeSelectorTerms": [{"matchExpressions": [_zone("a")]}]}
    other = {"nodeSelectorTerms": [{"matchExpressions": [_zone("b")]}]}
    s = _selector_slice(
        "a",
        "a-pool",
        gpu("gpu-0", nodeSelector=zone),
        perDeviceNodeSelection=True,
        nodeSelector=other,
    )
    result = allocate(
        [parse_claim(claim(exactly()))], classes=CLASSES, slices=[parse_slice(s)], node=ZONED
    )
    assert result.allocations[0].node_selector == zone


def test_a_device_that_binds_to_the_node_pins_the_allocation_with_the_feature_on() -> None:
    s = _selector_slice(
        "a", "a-pool", gpu("gpu-0", bindsToNode=True, bindingConditions=["ok"]), allNodes=True
    )
    plain = _selector_slice("a", "a-pool", gpu("gpu-0", bindsToNode=True), allNodes=True)
    on = allocate(
        [parse_claim(claim(exactly()))], classes=CLASSES, slices=[parse_slice(s)], node=NODE
    )
    assert on.allocations[0].node_selector == NODE1
    assert on.allocations[0].results[0].binding_conditions == ("ok",)
    off = allocate(
        [parse_claim(claim(exactly()))],
        classes=CLASSES,
        slices=[parse_slice(plain)],
        node=NODE,
        binding_conditions=False,
    )
    assert off.allocations[0].node_selector is None


def test_pools_with_binding_conditions_are_tried_last_only_with_the_feature_on() -> None:
    binding = slice_([gpu("gpu-0", bindingConditions=["ok"])], pool="a-pool", name="a")
    plain = slice_([gpu("gpu-1", memory="1Gi")], pool="b-pool", name="b")
    slices = [parse_slice(s) for s in (binding, plain)]
    on = allocate([parse_claim(claim(exactly()))], classes=CLASSES, slices=slices, node=NODE)
    assert devices_of(on) == ["gpu-1"]
    # off: pools in name order (what the verdicts show)
    big = parse_claim(claim(exactly(count=3)))
    off = allocate([big], classes=CLASSES, slices=slices, node=NODE, binding_conditions=False)
    assert [v.device for v in off.diagnoses[0].verdicts] == ["gpu-0", "gpu-1"]
    on = allocate([big], classes=CLASSES, slices=slices, node=NODE)
    assert [v.device for v in on.diagnoses[0].verdicts] == ["gpu-1", "gpu-0"]


def test_a_satisfiable_allocation_keeps_its_notes() -> None:
    result = run(
        [claim(exactly())],
        [slice_([gpu("gpu-0")]), slice_([gpu("gpu-9")], pool="other", name="o", count=2)],
    )
    assert devices_of(result) == ["gpu-0"]
    assert result.notes == (
        f"pool {DRIVER}/other is incomplete (not all of its slices are published); "
        "its devices are not used",
    )


def test_an_all_request_after_another_request_gets_its_devices() -> None:
    only = "device.attributes['gpu.nvidia.com'].productName == '{}'"
    c = claim(
        exactly("one", selectors=(only.format("A"),)),
        exactly("all", allocationMode="All", selectors=(only.format("B"),)),
    )
    devices = [gpu("a", product="A"), gpu("b0", product="B"), gpu("b1", product="B")]
    assert devices_of(run([c], [slice_(devices)])) == ["a", "b0", "b1"]


def test_a_claim_config_for_all_requests_does_not_end_the_list() -> None:
    c = claim(exactly("gpu"), exactly("other"))
    c["spec"]["devices"]["config"] = [
        {"opaque": {"driver": DRIVER, "parameters": {"n": 1}}},
        {"requests": ["other"], "opaque": {"driver": DRIVER, "parameters": {"n": 2}}},
    ]
    result = run([c], [slice_([gpu("gpu-0"), gpu("gpu-1")])])
    assert [
        (c["requests"], c["opaque"]["parameters"]["n"]) for c in result.allocations[0].config
    ] == [
        ([], 1),
        (["other"], 2),
    ]


def test_a_device_of_another_node_is_diagnosed_as_such() -> None:
    s = slice_([gpu("theirs", nodeName="node2")])
    del s["spec"]["nodeName"]
    s["spec"]["perDeviceNodeSelection"] = True
    result = run([claim(exactly())], [s])
    assert result.diagnoses[0].verdicts[0].reasons == ("not available on node node1",)


def test_selectors_compile_as_the_given_kubernetes_version_compiles_them() -> None:
    c = [parse_claim(claim(exactly(selectors=("lists.range(2) == [0, 1]",))))]
    compile_selectors(c, CLASSES, k8s_version="1.35")
    with pytest.raises(CelCompileError, match=r"request gpu: selectors\[0\]: CEL compile error"):
        compile_selectors(c, CLASSES, k8s_version="1.34")


def test_a_config_naming_the_only_request_by_its_parent_or_sub_request_names_none() -> None:
    for names in (["gpu"], ["gpu/small"]):
        c = claim(_first_available(exactly("big", selectors=(BIG,)), exactly("small")))
        c["spec"]["devices"]["config"] = [
            {"requests": names, "opaque": {"driver": DRIVER, "parameters": {}}}
        ]
        result = run([c], [slice_([gpu("gpu-0", memory="40Gi")])])
        assert [c["requests"] for c in result.allocations[0].config] == [[]], names
