"""The structured-parameters allocator for one node (dra:structured/internal allocators)."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.devices.classes import default_device_classes
from dra_driver.errors import CelCompileError, ExplainError
from dra_driver.scheduling.allocator import (
    AllocationResult,
    Node,
    allocate,
    allocated_state,
    apply_taint_rules,
    parse_claim,
    parse_device_class,
    parse_device_taint_rule,
    parse_slice,
)

DRIVER = "gpu.nvidia.com"
NODE = Node("node1")
CLASSES = {c.name: c for c in (parse_device_class(o) for o in default_device_classes())}


def gpu(
    name: str,
    *,
    memory: str = "80Gi",
    product: str = "NVIDIA H100",
    root: str = "pci0",
    **extra: Any,
) -> dict[str, Any]:
    dev: dict[str, Any] = {
        "name": name,
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": product},
            "resource.kubernetes.io/pcieRoot": {"string": root},
        },
        "capacity": {"memory": {"value": memory}},
    }
    dev.update(extra)
    return dev


def mig(name: str, *, start: int, size: int, counter_set: str = "gpu-0-cs") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {"type": {"string": "mig"}, "profile": {"string": f"{size}g"}},
        "capacity": {"memory": {"value": f"{size * 10}Gi"}},
        "consumesCounters": [
            {
                "counterSet": counter_set,
                "counters": {
                    f"memory-slice-{i}": {"value": "1"} for i in range(start, start + size)
                },
            }
        ],
    }


def slice_(
    devices: list[dict[str, Any]],
    *,
    name: str = "s1",
    generation: int = 1,
    count: int = 1,
    counters: list[dict[str, Any]] | None = None,
    pool: str = "node1",
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": "node1",
        "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
        "devices": devices,
    }
    if counters:
        spec["sharedCounters"] = counters
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": spec,
    }


def claim(
    *requests: dict[str, Any], constraints: list[dict[str, Any]] | None = None, name: str = "c"
) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    return {
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"devices": devices},
    }


def exactly(
    name: str = "gpu",
    *,
    cls: str = "gpu.nvidia.com",
    selectors: tuple[str, ...] = (),
    **fields: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, **fields}
    if selectors:
        body["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": body}


def run(
    claims: list[dict[str, Any]],
    slices: list[dict[str, Any]],
    allocated: list[dict[str, Any]] | None = None,
) -> AllocationResult:
    return allocate(
        [parse_claim(c) for c in claims],
        classes=CLASSES,
        slices=[parse_slice(s) for s in slices],
        node=NODE,
        allocated=allocated_state(allocated or []),
    )


def devices_of(result: AllocationResult) -> list[str]:
    assert result.satisfiable, result
    return [r.device for a in result.allocations for r in a.results]


def allocated_claim(*devices: str, share: bool = False) -> dict[str, Any]:
    return {
        "metadata": {"name": "other", "namespace": "ns"},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "r",
                            "driver": DRIVER,
                            "pool": "node1",
                            "device": d,
                            **(
                                {"shareID": "1", "consumedCapacity": {"memory": "30Gi"}}
                                if share
                                else {}
                            ),
                        }
                        for d in devices
                    ]
                }
            }
        },
    }


def test_first_fit_takes_devices_in_slice_order() -> None:
    result = run([claim(exactly(count=2))], [slice_([gpu("gpu-0"), gpu("gpu-1"), gpu("gpu-2")])])
    assert devices_of(result) == ["gpu-0", "gpu-1"]
    assert result.allocations[0].node_selector == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]}
        ]
    }


def test_class_selector_filters_by_type() -> None:
    result = run(
        [claim(exactly(cls="mig.nvidia.com"))],
        [
            slice_(
                [gpu("gpu-0"), mig("gpu-0-mig-1", start=0, size=1)],
                counters=[
                    {
                        "name": "gpu-0-cs",
                        "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)},
                    }
                ],
            )
        ],
    )
    assert devices_of(result) == ["gpu-0-mig-1"]


def test_request_selector_and_unsatisfiable_reason() -> None:
    sel = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    result = run([claim(exactly(selectors=(sel,)))], [slice_([gpu("gpu-0", memory="40Gi")])])
    assert not result.satisfiable
    (diag,) = result.diagnoses
    assert diag.verdicts[0].reasons == ("request selector #0: memory 40Gi is less than 80Gi",)
    assert diag.summary == "needs 1, 0 of 1 devices usable"


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


def test_overlapping_partitions_cannot_both_be_allocated() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    devices = [
        mig("big", start=0, size=4),
        mig("overlap", start=2, size=2),
        mig("free", start=4, size=2),
    ]
    result = run(
        [claim(exactly(cls="mig.nvidia.com", count=2))], [slice_(devices, counters=counters)]
    )
    assert devices_of(result) == ["big", "free"]
    result = run(
        [claim(exactly(cls="mig.nvidia.com", count=3))], [slice_(devices, counters=counters)]
    )
    assert not result.satisfiable


def test_counters_used_by_allocated_devices_are_not_available() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    devices = [mig("big", start=0, size=4), mig("overlap", start=2, size=2)]
    result = run(
        [
            claim(
                exactly(
                    cls="mig.nvidia.com",
                    selectors=("device.attributes['gpu.nvidia.com'].profile == '2g'",),
                )
            )
        ],
        [slice_(devices, counters=counters)],
        allocated=[allocated_claim("big")],
    )
    assert not result.satisfiable
    reasons = {v.device: v.reasons for v in result.diagnoses[0].verdicts}
    assert reasons["overlap"] == (
        "2g at placement 2 needs memory-slice-2..3 of gpu-0-cs; "
        "memory-slice-2..3 are used by big of claim ns/other",
    )
    assert result.diagnoses[0].summary == (
        "the one matching device is taken by allocated claims: overlap (ns/other)"
    )


def test_taints_block_unless_tolerated() -> None:
    tainted = gpu(
        "gpu-0", taints=[{"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule"}]
    )
    result = run([claim(exactly())], [slice_([tainted])])
    assert not result.satisfiable
    assert result.diagnoses[0].verdicts[0].reasons == (
        "taint gpu.nvidia.com/xid=48:NoSchedule is not tolerated",
    )
    tolerant = exactly(tolerations=[{"key": "gpu.nvidia.com/xid", "operator": "Exists"}])
    assert devices_of(run([claim(tolerant)], [slice_([tainted])])) == ["gpu-0"]
    none_effect = gpu("gpu-0", taints=[{"key": "k", "effect": "None"}])
    assert devices_of(run([claim(exactly())], [slice_([none_effect])])) == ["gpu-0"]


def test_consumable_capacity_shares_a_device_until_it_is_full() -> None:
    shared = gpu("gpu-0", allowMultipleAllocations=True)
    shared["capacity"]["memory"]["requestPolicy"] = {
        "default": "10Gi",
        "validRange": {"min": "10Gi", "step": "10Gi"},
    }
    req = exactly(capacity={"requests": {"memory": "25Gi"}})
    result = run([claim(req, name="a"), claim(req, name="b")], [slice_([shared])])
    assert devices_of(result) == ["gpu-0", "gpu-0"]
    assert result.allocations[0].results[0].consumed_capacity == {"memory": "30Gi"}
    assert result.allocations[0].results[0].share_id
    full = run(
        [claim(req)], [slice_([shared])], allocated=[allocated_claim("gpu-0", share=True)] * 2
    )
    assert not full.satisfiable
    assert full.diagnoses[0].verdicts[0].reasons == (
        "memory: 30Gi requested (25Gi rounded up by the requestPolicy), 20Gi left on gpu-0 "
        "(in use by ns/other)",
    )
    assert full.diagnoses[0].summary == (
        "the one matching device is taken by allocated claims: gpu-0 (ns/other)"
    )


def test_only_the_highest_generation_counts() -> None:
    old = slice_([gpu("old")], name="a", generation=1)
    new = slice_([gpu("new")], name="b", generation=2)
    assert devices_of(run([claim(exactly())], [old, new])) == ["new"]


def test_an_incomplete_pool_is_skipped() -> None:
    result = run([claim(exactly())], [slice_([gpu("gpu-0")], count=2)])
    assert not result.satisfiable
    assert any("incomplete" in n for n in result.notes)
    result = run([claim(exactly(allocationMode="All"))], [slice_([gpu("gpu-0")], count=2)])
    assert result.error is not None and "being updated" in result.error


def test_slices_are_tried_in_name_order() -> None:
    result = run(
        [claim(exactly())],
        [slice_([gpu("b-dev")], name="z", count=2), slice_([gpu("a-dev")], name="a", count=2)],
    )
    assert devices_of(result) == ["a-dev"]


def test_a_cel_runtime_error_aborts_the_attempt() -> None:
    sel = "device.attributes['gpu.nvidia.com'].missing == 1"
    result = run([claim(exactly(selectors=(sel,)))], [slice_([gpu("gpu-0")])])
    assert not result.satisfiable
    assert result.error is not None
    assert "selector #0 on device gpu.nvidia.com/node1/gpu-0: CEL runtime error" in result.error


def test_v1beta1_shapes_are_normalised() -> None:
    beta_claim = {
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": 1}]
            }
        },
    }
    beta_slice = slice_([])
    beta_slice["spec"]["devices"] = [
        {"name": "gpu-0", "basic": {k: v for k, v in gpu("gpu-0").items() if k != "name"}}
    ]
    assert devices_of(run([beta_claim], [beta_slice])) == ["gpu-0"]


def test_class_and_claim_configs_are_copied_in_order() -> None:
    cls = dict(CLASSES)
    cls_obj = default_device_classes()[0]
    cls_obj["spec"]["config"] = [
        {"opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig"}}}
    ]
    cls["gpu.nvidia.com"] = parse_device_class(cls_obj)
    c = claim(exactly())
    c["spec"]["devices"]["config"] = [
        {"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": {"x": 1}}}
    ]
    result = allocate(
        [parse_claim(c)], classes=cls, slices=[parse_slice(slice_([gpu("gpu-0")]))], node=NODE
    )
    assert [(c["source"], c["requests"]) for c in result.allocations[0].config] == [
        ("FromClass", ["gpu"]),
        ("FromClaim", ["gpu"]),
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


def taint_rule(name: str, selector: dict[str, Any] | None, effect: str = "NoSchedule") -> Any:
    spec: dict[str, Any] = {"taint": {"key": "example.com/broken", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return parse_device_taint_rule(
        {"kind": "DeviceTaintRule", "metadata": {"name": name}, "spec": spec}
    )


def test_device_taint_rules_taint_what_their_selector_picks() -> None:
    counters = [
        {"name": "gpu-0-cs", "counters": {f"memory-slice-{i}": {"value": "1"} for i in range(8)}}
    ]
    slices = [
        parse_slice(
            slice_([gpu("gpu-0"), gpu("gpu-1"), mig("mig-a", start=0, size=1)], counters=counters)
        )
    ]

    def tainted(*rules: Any) -> dict[str, list[str]]:
        out = apply_taint_rules(slices, rules, classes=CLASSES)
        return {d.name: [t.rule for t in d.taints] for s in out for d in s.devices if d.taints}

    assert tainted(taint_rule("one", {"device": "gpu-1", "pool": "node1"})) == {"gpu-1": ["one"]}
    assert tainted(taint_rule("other-driver", {"driver": "x.example.com"})) == {}
    assert tainted(taint_rule("no-selector", None)) == {}
    assert tainted(taint_rule("all", {})) == {"gpu-0": ["all"], "gpu-1": ["all"], "mig-a": ["all"]}
    # v1alpha3 before 1.35: a class and CEL selectors narrow the rule
    assert tainted(taint_rule("migs", {"deviceClassName": "mig.nvidia.com"})) == {"mig-a": ["migs"]}
    assert tainted(taint_rule("missing-class", {"deviceClassName": "nope"})) == {}

    rules = [taint_rule("one", {"device": "gpu-0"})]
    result = allocate(
        [parse_claim(claim(exactly(count=2)))],
        classes=CLASSES,
        slices=apply_taint_rules(slices, rules, classes=CLASSES),
        node=NODE,
    )
    assert not result.satisfiable
    reasons = {v.device: v.reasons for v in result.diagnoses[0].verdicts}
    assert reasons["gpu-0"] == (
        "taint example.com/broken:NoSchedule is not tolerated (from DeviceTaintRule one)",
    )
    tolerant = exactly(count=2, tolerations=[{"key": "example.com/broken", "operator": "Exists"}])
    result = allocate(
        [parse_claim(claim(tolerant))],
        classes=CLASSES,
        slices=apply_taint_rules(slices, rules, classes=CLASSES),
        node=NODE,
    )
    assert devices_of(result) == ["gpu-0", "gpu-1"]


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


def test_allocated_state_counts_each_kind_of_result_as_the_scheduler_does() -> None:
    def named(name: str, c: dict[str, Any]) -> dict[str, Any]:
        c["metadata"]["name"] = name
        return c

    admin = named("monitor", allocated_claim("gpu-0"))
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    state = allocated_state(
        [
            admin,
            named("share-a", allocated_claim("gpu-1", share=True)),
            named("share-b", allocated_claim("gpu-1", share=True)),
            named("whole", allocated_claim("gpu-2")),
            {"metadata": {"name": "pending", "namespace": "ns"}},
        ]
    )
    assert state.holders((DRIVER, "node1", "gpu-0")) == ()  # admin access holds nothing
    assert state.holders((DRIVER, "node1", "gpu-1")) == ("ns/share-a", "ns/share-b")
    assert state.holders((DRIVER, "node1", "gpu-2")) == ("ns/whole",)
    assert state.shared_capacity[(DRIVER, "node1", "gpu-1")] == {"memory": 60 * 2**30}
    assert sorted(state.claims) == ["ns/monitor", "ns/share-a", "ns/share-b", "ns/whole"]
    assert state.claims["ns/monitor"].results[0].admin_access
