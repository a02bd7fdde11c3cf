"""Which devices a request may take (scheduling/allocator/candidates.py): selectors, pool
generations, incomplete pools, slice order."""

from __future__ import annotations

from typing import Any

import pytest

from dra_driver.scheduling.allocator import (
    AllocationResult,
    Node,
    allocate,
    parse_claim,
    parse_device_class,
    parse_slice,
)
from dra_driver.scheduling.allocator.candidates import gather_pools, node_selector_matches
from tests.allocatordata import (
    CLASSES,
    DRIVER,
    NODE,
    claim,
    devices_of,
    exactly,
    gpu,
    mig,
    run,
    slice_,
)


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


LABELLED = Node("node1", labels={"zone": "a", "gpus": "8", "rack": "r1"})


def _node_selector(*terms: dict[str, Any]) -> dict[str, Any]:
    return {"nodeSelectorTerms": list(terms)}


def _label(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": op, "values": list(values)}]}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        (None, False),
        ({}, False),
        (_node_selector(), False),
        (_node_selector({}), False),  # a term without requirements matches no node
        (_label("zone", "In", "b", "a"), True),
        (_label("zone", "In", "b"), False),
        (_label("missing", "In", "a"), False),
        (_label("zone", "NotIn", "b"), True),
        (_label("zone", "NotIn", "a"), False),
        (_label("missing", "NotIn", "a"), True),
        (_label("zone", "Exists"), True),
        (_label("missing", "Exists"), False),
        (_label("zone", "DoesNotExist"), False),
        (_label("missing", "DoesNotExist"), True),
        (_label("gpus", "Gt", "7"), True),
        (_label("gpus", "Gt", "8"), False),
        (_label("gpus", "Lt", "9"), True),
        (_label("gpus", "Lt", "8"), False),
        (_label("gpus", "Gt"), False),  # no value to compare with
        (_label("missing", "Gt", "1"), False),
        (_label("zone", "Gt", "1"), False),  # not an integer
        (_label("gpus", "Lt", "x"), False),
        (_label("zone", "Equals", "a"), False),  # no such operator
        (
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
            | {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]},
            True,
        ),
        (
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
            | {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node2"]}]},
            False,  # requirements of a term are ANDed
        ),
        ({"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]}, True),
        ({"matchFields": [{"key": "metadata.uid", "operator": "Exists"}]}, False),
        ({"matchExpressions": [{"key": "zone", "operator": "Exists", "values": None}]}, True),
    ],
)
def test_a_node_selector_is_evaluated_as_the_core_api_defines_it(
    selector: dict[str, Any] | None, matches: bool
) -> None:
    if selector is not None and "nodeSelectorTerms" not in selector and selector:
        selector = _node_selector(selector)
    assert node_selector_matches(selector, LABELLED) is matches


def test_node_selector_terms_are_ored() -> None:
    selector = _node_selector(_label("zone", "In", "b"), _label("rack", "In", "r1"))
    assert node_selector_matches(selector, LABELLED)
    assert not node_selector_matches(selector, Node("node1", labels={"zone": "a"}))


def test_a_label_value_is_compared_as_text() -> None:
    selector = {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpus", "operator": "In", "values": [8]}]}
        ]
    }
    assert node_selector_matches(selector, LABELLED)


def _on(node: Node, *slices: dict[str, Any]) -> AllocationResult:
    return allocate(
        [parse_claim(claim(exactly()))],
        classes=CLASSES,
        slices=[parse_slice(s) for s in slices],
        node=node,
    )


def _slice_for(node_fields: dict[str, Any], devices: list[dict[str, Any]], **kw: Any) -> Any:
    s = slice_(devices, **kw)
    del s["spec"]["nodeName"]
    s["spec"].update(node_fields)
    return s


def test_a_slice_reaches_the_node_by_name_all_nodes_or_a_matching_selector() -> None:
    other = Node("node2", labels={"zone": "b"})
    by_name = slice_([gpu("gpu-0")])
    everywhere = _slice_for({"allNodes": True}, [gpu("gpu-0")])
    zone_a = _slice_for({"nodeSelector": _node_selector(_label("zone", "In", "a"))}, [gpu("gpu-0")])
    assert devices_of(_on(LABELLED, by_name)) == ["gpu-0"]
    assert not _on(other, by_name).satisfiable
    assert devices_of(_on(other, everywhere)) == ["gpu-0"]
    assert devices_of(_on(LABELLED, zone_a)) == ["gpu-0"]
    assert not _on(other, zone_a).satisfiable


def test_per_device_node_selection_checks_each_device() -> None:
    devices = [
        gpu("elsewhere", nodeName="node2"),
        gpu("not-zone-a", nodeSelector=_node_selector(_label("zone", "In", "b"))),
        gpu("zone-a", nodeSelector=_node_selector(_label("zone", "In", "a"))),
        gpu("mine", nodeName="node1"),
        gpu("everywhere", allNodes=True),
    ]
    s = _slice_for({"perDeviceNodeSelection": True}, devices)
    result = allocate(
        [parse_claim(claim(exactly(count=3)))],
        classes=CLASSES,
        slices=[parse_slice(s)],
        node=LABELLED,
    )
    assert devices_of(result) == ["zone-a", "mine", "everywhere"]
    assert result.allocations[0].node_selector == _node_selector(
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node1"]}]}
    )
    assert devices_of(_on(Node("node2"), s)) == ["elsewhere"]


def test_another_nodes_slice_of_the_pool_lends_no_devices() -> None:
    # One pool, two slices: this node's and another node's (with counters). Only this node's
    # devices are candidates; the other slice's counters still count.
    counters = [{"name": "gpu-0-cs", "counters": {"memory-slice-0": {"value": "1"}}}]
    mine = slice_([gpu("gpu-0")], name="a", count=2)
    theirs = slice_([gpu("gpu-9")], name="b", count=2, counters=counters)
    theirs["spec"]["nodeName"] = "node2"
    result = _on(LABELLED, mine, theirs)
    assert devices_of(result) == ["gpu-0"]
    result = allocate(
        [parse_claim(claim(exactly(count=2)))],
        classes=CLASSES,
        slices=[parse_slice(mine), parse_slice(theirs)],
        node=LABELLED,
    )
    assert not result.satisfiable
    assert [v.device for v in result.diagnoses[0].verdicts] == ["gpu-0"]


def test_a_counter_only_slice_gives_its_pool_the_counters() -> None:
    counters = [{"name": "gpu-0-cs", "counters": {"memory-slice-0": {"value": "1"}}}]
    devices = slice_([mig("gpu-0-mig-1", start=0, size=1)], name="a", count=2)
    shared = _slice_for({}, [], name="b", count=2, counters=counters)
    result = allocate(
        [parse_claim(claim(exactly(cls="mig.nvidia.com")))],
        classes=CLASSES,
        slices=[parse_slice(devices), parse_slice(shared)],
        node=LABELLED,
    )
    assert devices_of(result) == ["gpu-0-mig-1"]
    assert not result.notes


def test_a_pool_that_does_not_reach_the_node_is_passed_over() -> None:
    other = slice_([gpu("theirs")], pool="a-pool", name="a")
    other["spec"]["nodeName"] = "node2"
    result = _on(LABELLED, other, slice_([gpu("mine")], pool="b-pool", name="b"))
    assert devices_of(result) == ["mine"]
    (r,) = result.allocations[0].results
    assert (r.driver, r.pool, r.device) == (DRIVER, "b-pool", "mine")


def test_a_device_name_twice_in_a_pool_makes_it_invalid() -> None:
    result = run(
        [claim(exactly())],
        [slice_([gpu("gpu-0")], name="a", count=2), slice_([gpu("gpu-0")], name="b", count=2)],
    )
    assert not result.satisfiable
    assert result.notes == (
        f"pool {DRIVER}/node1 is invalid (device name gpu-0 is not unique in the pool); "
        "its devices are not used",
    )


def test_pools_with_binding_conditions_come_after_the_others() -> None:
    binding = slice_(
        [gpu("gpu-0", bindingConditions=["Ready"], bindingFailureConditions=["Failed"])],
        pool="a-pool",
        name="a",
    )
    plain = slice_([gpu("gpu-1")], pool="b-pool", name="b")
    third = slice_([gpu("gpu-2")], pool="c-pool", name="c")
    slices = [parse_slice(s) for s in (binding, plain, third)]
    assert [p.name for p in gather_pools(slices, NODE)] == ["b-pool", "c-pool", "a-pool"]
    assert [p.name for p in gather_pools(slices, NODE, binding_conditions=False)] == [
        "a-pool",
        "b-pool",
        "c-pool",
    ]
    assert devices_of(run([claim(exactly())], [binding, plain, third])) == ["gpu-1"]


def test_a_matching_request_selector_takes_the_device() -> None:
    sel = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    result = run(
        [claim(exactly(selectors=(sel,)))],
        [slice_([gpu("small", memory="40Gi"), gpu("big")])],
    )
    assert devices_of(result) == ["big"]


def test_a_cel_runtime_error_in_a_selector_aborts_naming_class_or_request_and_device() -> None:
    bad = "device.attributes['gpu.nvidia.com'].nope == 'x'"
    result = run([claim(exactly(selectors=(bad,)))], [slice_([gpu("gpu-0")])])
    assert not result.satisfiable
    assert result.error is not None
    assert result.error.startswith(
        f"claim ns/c: request gpu: selector #0 on device {DRIVER}/node1/gpu-0: CEL runtime error: "
    )
    cls = {
        "metadata": {"name": "broken"},
        "spec": {"selectors": [{"cel": {"expression": "true"}}, {"cel": {"expression": bad}}]},
    }
    result = allocate(
        [parse_claim(claim(exactly(cls="broken")))],
        classes={"broken": parse_device_class(cls)},
        slices=[parse_slice(slice_([gpu("gpu-0")]))],
        node=NODE,
    )
    assert result.error is not None
    assert result.error.startswith(
        f"class broken: selector #1 on device {DRIVER}/node1/gpu-0: CEL runtime error: "
    )
