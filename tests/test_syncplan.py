"""syncplan.py: the G.3 sync plan against the slices the server has, and the fields it dropped.
Pure: no server involved."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dra_driver.devices import CounterSet, NodeDevices, Taint
from dra_driver.publish.slices import SliceContent
from dra_driver.publish.syncplan import dropped_fields, plan_sync
from tests.slicedata import NODE, build, counter_set, gpu, publish

# --- the sync plan -------------------------------------------------------------------------------


def test_first_publication_creates_every_slice_at_generation_1() -> None:
    pool = build(NodeDevices(devices=tuple(gpu(i) for i in range(200))))
    plan = plan_sync(pool, [], node_uid="node-uid")
    assert (plan.generation, plan.bumped) == (1, True)
    assert [w.index for w in plan.creates] == [0, 1]
    assert plan.updates == () and plan.deletes == ()
    assert all(w.body["spec"]["pool"]["generation"] == 1 for w in plan.creates)


def test_restart_with_unchanged_devices_plans_no_writes() -> None:
    taint = Taint(key="gpu.nvidia.com/gpu-lost", value="", effect="NoSchedule")
    devices = NodeDevices(
        devices=tuple(gpu(i, taints=(taint,) if i == 3 else ()) for i in range(300)),
        counter_sets=(counter_set("cs"),),
    )
    existing = publish(build(devices))
    plan = plan_sync(build(devices), existing, node_uid="node-uid")
    assert plan.write_count == 0
    assert (plan.generation, plan.bumped) == (1, False)
    assert sorted(plan.unchanged) == sorted(o["metadata"]["name"] for o in existing)


def test_one_changed_slice_is_updated_in_place_at_the_same_generation() -> None:
    devices = [gpu(i) for i in range(200)]
    existing = publish(build(NodeDevices(devices=tuple(devices))))
    devices[150] = gpu(150, memory="40Gi")
    plan = plan_sync(build(NodeDevices(devices=tuple(devices))), existing, node_uid="node-uid")
    assert (plan.generation, plan.bumped) == (1, False)
    assert [w.index for w in plan.updates] == [1]
    assert plan.creates == () and plan.deletes == ()
    body = plan.updates[0].body
    assert body["metadata"]["name"] == existing[1]["metadata"]["name"]
    assert body["metadata"]["resourceVersion"] == existing[1]["metadata"]["resourceVersion"]
    assert body["spec"]["devices"][150 - 128]["capacity"]["memory"] == {"value": "40Gi"}


def test_two_changed_slices_bump_the_generation_and_rewrite_every_slice() -> None:
    devices = [gpu(i) for i in range(300)]
    existing = publish(build(NodeDevices(devices=tuple(devices))))
    devices[0] = gpu(0, memory="40Gi")
    devices[200] = gpu(200, memory="40Gi")
    plan = plan_sync(build(NodeDevices(devices=tuple(devices))), existing, node_uid="node-uid")
    assert (plan.generation, plan.bumped) == (2, True)
    assert [w.index for w in plan.updates] == [0, 1, 2]
    assert all(w.body["spec"]["pool"]["generation"] == 2 for w in plan.updates)


def test_a_new_slice_bumps_the_generation() -> None:
    existing = publish(build(NodeDevices(devices=tuple(gpu(i) for i in range(100)))))
    plan = plan_sync(
        build(NodeDevices(devices=tuple(gpu(i) for i in range(200)))), existing, node_uid="node-uid"
    )
    assert (plan.generation, plan.bumped) == (2, True)
    assert [w.index for w in plan.updates] == [0]
    assert [w.index for w in plan.creates] == [1]
    assert plan.creates[0].body["spec"]["pool"] == {
        "name": NODE,
        "generation": 2,
        "resourceSliceCount": 2,
    }


def test_a_shrinking_pool_deletes_the_extra_slice() -> None:
    existing = publish(build(NodeDevices(devices=tuple(gpu(i) for i in range(200)))))
    plan = plan_sync(
        build(NodeDevices(devices=tuple(gpu(i) for i in range(100)))), existing, node_uid="node-uid"
    )
    assert [d.name for d in plan.deletes] == [existing[1]["metadata"]["name"]]
    assert plan.deletes[0].uid == existing[1]["metadata"]["uid"]
    assert [w.index for w in plan.updates] == [0]


def test_foreign_names_old_generations_other_pools_and_duplicates_are_deleted() -> None:
    pool = build(NodeDevices(devices=(gpu(0),)))
    (good,) = publish(pool)
    old_style = copy.deepcopy(good)
    old_style["metadata"].update(name="node1-gpu.nvidia.com-abcde", uid="old")
    duplicate = copy.deepcopy(good)
    duplicate["metadata"].update(name=good["metadata"]["name"] + "z", uid="dup")
    out_of_range = copy.deepcopy(good)
    out_of_range["metadata"].update(name="00007-gpu.nvidia.com-node1-qqqqq", uid="range")
    other_pool = copy.deepcopy(good)
    other_pool["spec"]["pool"]["name"] = "renamed"
    other_pool["metadata"].update(name="00000-gpu.nvidia.com-node1-other", uid="pool")
    stale = copy.deepcopy(good)
    stale["metadata"].update(name="00000-gpu.nvidia.com-node1-stale", uid="stale")
    stale["spec"]["pool"]["generation"] = 0
    plan = plan_sync(
        pool, [old_style, duplicate, good, out_of_range, other_pool, stale], node_uid="node-uid"
    )
    assert {d.uid for d in plan.deletes} == {"old", "dup", "range", "pool", "stale"}
    assert plan.updates == () and plan.creates == ()
    assert plan.unchanged == (good["metadata"]["name"],)


def test_a_driver_generation_above_the_current_one_is_used() -> None:
    devices = NodeDevices(devices=(gpu(0),))
    existing = publish(build(devices))
    plan = plan_sync(build(devices, generation=7), existing, node_uid="node-uid")
    assert (plan.generation, plan.bumped) == (7, True)
    assert [w.index for w in plan.updates] == [0]


def test_after_the_kubelet_wiped_the_slices_the_pool_restarts_at_generation_1() -> None:
    devices = [gpu(i) for i in range(300)]
    existing = publish(build(NodeDevices(devices=tuple(devices))))
    devices[0] = gpu(0, memory="1Gi")
    devices[299] = gpu(299, memory="1Gi")
    plan = plan_sync(build(NodeDevices(devices=tuple(devices))), existing, node_uid="node-uid")
    assert plan.generation == 2
    assert (
        plan_sync(build(NodeDevices(devices=tuple(devices))), [], node_uid="node-uid").generation
        == 1
    )


def test_server_set_taint_times_are_kept_on_update() -> None:
    taint = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoExecute")
    before = build(NodeDevices(devices=(gpu(0, taints=(taint,)), gpu(1))))
    existing = publish(before)
    after = build(NodeDevices(devices=(gpu(0, taints=(taint,)), gpu(1, memory="1Gi"))))
    (update,) = plan_sync(after, existing, node_uid="node-uid").updates
    assert update.body["spec"]["devices"][0]["taints"] == [
        {**existing[0]["spec"]["devices"][0]["taints"][0]}
    ]
    assert update.body["spec"]["devices"][0]["taints"][0]["timeAdded"] == "2026-01-01T00:00:00Z"


def test_taint_times_within_a_second_are_equal_and_further_apart_are_not() -> None:
    taint = Taint(key="k", value="v", effect="NoSchedule")
    pool = build(NodeDevices(devices=(gpu(0, taints=(taint,)),)))
    adopted = pool.with_slice(
        0,
        SliceContent(
            devices=(
                {
                    **pool.slices[0].devices[0],
                    "taints": [
                        {
                            "key": "k",
                            "value": "v",
                            "effect": "NoSchedule",
                            "timeAdded": "2026-01-01T00:00:00.500000Z",
                        }
                    ],
                },
            )
        ),
    )
    (obj,) = publish(pool)
    assert plan_sync(adopted, [obj], node_uid="node-uid").write_count == 0
    obj["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:05Z"
    assert plan_sync(adopted, [obj], node_uid="node-uid").write_count == 1


def test_dropped_taints_and_counters_name_their_feature_gates() -> None:
    taint = Taint(key="k", value="v", effect="NoSchedule")
    pool = build(
        NodeDevices(
            devices=(gpu(0, taints=(taint,), counter_set="cs"),), counter_sets=(counter_set("cs"),)
        )
    )
    sent = pool.slices[1]
    kept = SliceContent(
        devices=(
            {k: v for k, v in sent.devices[0].items() if k not in ("taints", "consumesCounters")},
        )
    )
    gates = {(d.path, d.gate) for d in dropped_fields(sent, kept)}
    assert gates == {
        ("devices[].taints", "DRADeviceTaints"),
        ("devices[].consumesCounters", "DRAPartitionableDevices"),
    }
    counters = pool.slices[0]
    assert [d.gate for d in dropped_fields(counters, SliceContent())] == ["DRAPartitionableDevices"]
    assert dropped_fields(sent, sent) == ()


# --- slice rewrites mutation testing found untested (issue 37) -----------------------------------


def one_slice_pool() -> tuple[NodeDevices, list[dict[str, object]]]:
    devices = NodeDevices(devices=tuple(gpu(i) for i in range(4)))
    return devices, publish(build(devices))


@pytest.mark.parametrize(
    "stored_change",
    [
        {"nodeName": "other-node"},
        {"nodeSelector": {"nodeSelectorTerms": [{"matchExpressions": []}]}},
        {"allNodes": True},
        {"perDeviceNodeSelection": True},
    ],
    ids=["nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection"],
)
def test_a_stored_slice_whose_node_selection_differs_is_rewritten(
    stored_change: dict[str, object],
) -> None:
    devices, existing = one_slice_pool()
    stored = copy.deepcopy(existing)
    spec = stored[0]["spec"]
    assert isinstance(spec, dict)
    spec.update(stored_change)
    plan = plan_sync(build(devices), stored, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]
    written = plan.updates[0].body["spec"]
    assert written["nodeName"] == NODE
    assert not {"nodeSelector", "allNodes", "perDeviceNodeSelection"} & set(written)


def tainted(*taints: Taint) -> NodeDevices:
    return NodeDevices(devices=tuple(gpu(i, taints=taints if i == 1 else ()) for i in range(4)))


LOST = Taint(key="gpu.nvidia.com/gpu-lost", value="", effect="NoSchedule")


@pytest.mark.parametrize(
    "other",
    [
        Taint(key="gpu.nvidia.com/xid", value="", effect="NoSchedule"),
        Taint(key="gpu.nvidia.com/gpu-lost", value="79", effect="NoSchedule"),
        Taint(key="gpu.nvidia.com/gpu-lost", value="", effect="NoExecute"),
    ],
    ids=["key", "value", "effect"],
)
def test_a_taint_that_differs_in_key_value_or_effect_is_a_change(other: Taint) -> None:
    stored = publish(build(tainted(LOST)))
    plan = plan_sync(build(tainted(other)), stored, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]


def with_time_added(devices: list[Any], when: str) -> None:
    for device in devices:
        for taint in device.get("taints") or ():
            taint["timeAdded"] = when


@pytest.mark.parametrize(
    ("desired_time", "stored_time", "changed"),
    [
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z", False),  # within the 1 s tolerance
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:00Z", False),
        ("2026-01-01T00:00:00Z", "2026-01-01T00:00:02Z", True),
        ("2026-01-01T00:00:03Z", "2026-01-01T00:00:00Z", True),
    ],
)
def test_taint_times_are_equal_within_one_second(
    desired_time: str, stored_time: str, changed: bool
) -> None:
    stored = copy.deepcopy(publish(build(tainted(LOST))))
    for obj in stored:
        with_time_added(obj["spec"]["devices"], stored_time)  # type: ignore[index]
    desired = build(tainted(LOST))
    for desired_slice in desired.slices:
        with_time_added(list(desired_slice.devices), desired_time)
    plan = plan_sync(desired, stored, node_uid="node-uid")
    assert bool(plan.updates) is changed


# --- what the rest of the mutants of syncplan.py showed untested (issue 37 item 6) ---------------


def test_a_created_slice_names_the_node_as_its_owner() -> None:
    devices = [gpu(i) for i in range(200)]
    existing = publish(build(NodeDevices(devices=tuple(devices))))
    devices += [gpu(i) for i in range(200, 300)]
    plan = plan_sync(build(NodeDevices(devices=tuple(devices))), existing, node_uid="node-uid-7")
    assert [w.index for w in plan.creates] == [2]
    assert plan.creates[0].body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid-7", "controller": True}
    ]


def test_a_delete_carries_the_uid_and_resource_version_it_saw_or_none_when_absent() -> None:
    existing = publish(build(NodeDevices(devices=tuple(gpu(i) for i in range(200)))))
    bare = copy.deepcopy(existing[0])
    bare["metadata"] = {"name": "00005-gpu.nvidia.com-node1-bare"}
    plan = plan_sync(
        build(NodeDevices(devices=tuple(gpu(i) for i in range(100)))),
        [*existing, bare],
        node_uid="node-uid",
    )
    refs = {d.name: (d.uid, d.resource_version) for d in plan.deletes}
    extra = existing[1]["metadata"]
    assert refs == {
        extra["name"]: (extra["uid"], extra["resourceVersion"]),
        "00005-gpu.nvidia.com-node1-bare": ("", ""),  # no precondition rather than a wrong one
    }


@pytest.mark.parametrize(
    "spec",
    [None, "not a mapping", {}, {"driver": "gpu.nvidia.com", "nodeName": NODE}],
    ids=["null", "string", "empty", "no-pool"],
)
def test_a_listed_slice_without_a_usable_spec_or_pool_is_deleted(spec: object) -> None:
    devices, existing = one_slice_pool()
    broken = copy.deepcopy(existing[0])
    broken["metadata"].update(name="00000-gpu.nvidia.com-node1-broke", uid="broken")  # type: ignore[attr-defined]
    broken["spec"] = spec
    plan = plan_sync(build(devices), [*existing, broken], node_uid="node-uid")
    assert [d.uid for d in plan.deletes] == ["broken"]
    assert plan.updates == () and plan.creates == ()


def test_a_slice_without_a_pool_generation_counts_as_generation_0() -> None:
    devices = tuple(gpu(i) for i in range(200))
    existing = publish(build(NodeDevices(devices=devices)))
    del existing[0]["spec"]["pool"]["generation"]
    plan = plan_sync(build(NodeDevices(devices=devices)), existing, node_uid="node-uid")
    # The other slice is at 1: the one without a generation is older, so it is replaced.
    assert [d.name for d in plan.deletes] == [existing[0]["metadata"]["name"]]
    assert [w.index for w in plan.creates] == [0]
    assert plan.generation == 2

    del existing[1]["spec"]["pool"]["generation"]
    plan = plan_sync(build(NodeDevices(devices=devices)), existing, node_uid="node-uid")
    # Both at 0, below the driver's minimum of 1: both rewritten at 1.
    assert (plan.generation, plan.bumped) == (1, True)
    assert [w.index for w in plan.updates] == [0, 1] and plan.deletes == ()


def test_a_changed_counter_set_is_rewritten() -> None:
    devices = NodeDevices(
        devices=tuple(gpu(i, counter_set="cs") for i in range(4)),
        counter_sets=(counter_set("cs"),),
    )
    existing = publish(build(devices))
    changed = NodeDevices(
        devices=devices.devices,
        counter_sets=(
            CounterSet(name="cs", counters={"memory": "40Gi", "multiprocessors": "132"}),
        ),
    )
    plan = plan_sync(build(changed), existing, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]
    assert plan.updates[0].body["spec"]["sharedCounters"][0]["counters"]["memory"] == {
        "value": "40Gi"
    }


def test_a_device_removed_from_a_slice_is_a_change() -> None:
    devices, existing = one_slice_pool()
    plan = plan_sync(build(NodeDevices(devices=devices.devices[:3])), existing, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]
    assert [d["name"] for d in plan.updates[0].body["spec"]["devices"]] == [
        "gpu-0",
        "gpu-1",
        "gpu-2",
    ]


@pytest.mark.parametrize(
    ("stored_taints", "desired_taints"),
    [((LOST,), ()), ((), (LOST,)), ((LOST,), (LOST, Taint(key="k", value="", effect="NoExecute")))],
    ids=["removed", "added", "second-added"],
)
def test_a_taint_added_or_removed_is_a_change(
    stored_taints: tuple[Taint, ...], desired_taints: tuple[Taint, ...]
) -> None:
    stored = publish(build(tainted(*stored_taints)))
    plan = plan_sync(build(tainted(*desired_taints)), stored, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]
    taints = plan.updates[0].body["spec"]["devices"][1].get("taints", [])
    assert [(t["key"], t["effect"]) for t in taints] == [(t.key, t.effect) for t in desired_taints]


def test_a_taint_stored_with_an_explicit_empty_value_is_the_same_taint() -> None:
    stored = publish(build(tainted(LOST)))
    stored[0]["spec"]["devices"][1]["taints"][0]["value"] = ""
    assert "value" not in build(tainted(LOST)).slices[0].devices[1]["taints"][0]
    assert plan_sync(build(tainted(LOST)), stored, node_uid="node-uid").write_count == 0


def test_an_update_keeps_the_server_fields_but_not_managed_fields() -> None:
    devices, existing = one_slice_pool()
    existing[0]["metadata"]["managedFields"] = [{"manager": "gpu-dra", "operation": "Update"}]
    existing[0]["metadata"]["labels"] = {"team": "a"}
    plan = plan_sync(build(NodeDevices(devices=devices.devices[:3])), existing, node_uid="node-uid")
    metadata = plan.updates[0].body["metadata"]
    assert "managedFields" not in metadata
    assert metadata == {k: v for k, v in existing[0]["metadata"].items() if k != "managedFields"}


def test_an_update_copies_stored_taint_times_only_onto_the_taints_that_lack_one() -> None:
    xid = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoExecute")
    before = NodeDevices(devices=(gpu(0, taints=(xid,)), gpu(1), gpu(2, taints=(LOST,)), gpu(3)))
    existing = publish(build(before))
    existing[0]["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    existing[0]["spec"]["devices"][2]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    after = build(
        NodeDevices(devices=(gpu(0, taints=(xid,)), gpu(1), gpu(2, taints=(LOST, xid)), gpu(3)))
    )
    own_time = [{**LOST_JSON, "timeAdded": "2026-01-01T00:10:00Z"}, XID_JSON]
    after = after.with_slice(
        0,
        SliceContent(
            devices=tuple(
                {**d, "taints": own_time} if d["name"] == "gpu-2" else d
                for d in after.slices[0].devices
            )
        ),
    )
    (update,) = plan_sync(after, existing, node_uid="node-uid").updates
    devices = update.body["spec"]["devices"]
    assert [d["name"] for d in devices] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert devices[0]["taints"] == [{**XID_JSON, "timeAdded": "2026-01-01T00:00:00Z"}]
    assert devices[1] == after.slices[0].devices[1] and devices[3] == after.slices[0].devices[3]
    # gpu-2's own time stays; its new taint was never stored, so it gets no time.
    assert devices[2]["taints"] == own_time


LOST_JSON = {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule"}
XID_JSON = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}


# --- dropped fields: each gate named, only for what was dropped ----------------------------------


def consumable_device(name: str = "gpu-0") -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            "model": {"string": "H100"},
            "profiles": {"strings": ["1g.10gb", "2g.20gb"]},
        },
        "capacity": {
            "memory": {
                "value": "80Gi",
                "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}},
            }
        },
        "allowMultipleAllocations": True,
        "taints": [{"key": "k", "effect": "NoSchedule"}],
    }


def without(device: dict[str, Any], *drop: str) -> dict[str, Any]:
    out = copy.deepcopy(device)
    for path in drop:
        *parents, last = path.split(".")
        node = out
        for p in parents:
            node = node[p]
        del node[last]
    return out


@pytest.mark.parametrize(
    ("dropped", "expected"),
    [
        (("taints",), [("devices[].taints", "DRADeviceTaints")]),
        (
            ("capacity.memory.requestPolicy", "allowMultipleAllocations"),
            [
                ("devices[].allowMultipleAllocations", "DRAConsumableCapacity"),
                ("devices[].capacity[].requestPolicy", "DRAConsumableCapacity"),
            ],
        ),
        (
            ("attributes.profiles",),
            [("devices[].attributes (list values)", "DRAListTypeAttributes")],
        ),
        (("attributes.model",), [("spec", "")]),  # a plain attribute: no gate explains it
    ],
    ids=["taints", "consumable-capacity", "list-attribute", "unexplained"],
)
def test_each_dropped_field_names_its_gate_and_nothing_kept_is_named(
    dropped: tuple[str, ...], expected: list[tuple[str, str]]
) -> None:
    sent = SliceContent(devices=(consumable_device(),))
    stored = SliceContent(devices=(without(consumable_device(), *dropped),))
    assert [(d.path, d.gate) for d in dropped_fields(sent, stored)] == expected


def test_dropped_shared_counters_are_named_by_path() -> None:
    counters = build(
        NodeDevices(devices=(gpu(0, counter_set="cs"),), counter_sets=(counter_set("cs"),))
    ).slices[0]
    assert [(d.path, d.gate) for d in dropped_fields(counters, SliceContent())] == [
        ("sharedCounters", "DRAPartitionableDevices")
    ]


def test_a_device_the_server_did_not_store_at_all_is_reported_with_its_gated_fields() -> None:
    sent = SliceContent(devices=(consumable_device("gpu-0"), consumable_device("gpu-1")))
    stored = SliceContent(devices=(consumable_device("gpu-0"),))
    assert [(d.path, d.gate) for d in dropped_fields(sent, stored)] == [
        ("devices[].allowMultipleAllocations", "DRAConsumableCapacity"),
        ("devices[].attributes (list values)", "DRAListTypeAttributes"),
        ("devices[].capacity[].requestPolicy", "DRAConsumableCapacity"),
        ("devices[].taints", "DRADeviceTaints"),
    ]


@pytest.mark.parametrize(
    "owners",
    [
        [],  # written without one (an older driver, or by hand): the Node's deletion keeps it
        [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "old-uid", "controller": True}],
    ],
    ids=["none", "an-earlier-node-of-that-name"],
)
def test_a_stored_slice_not_owned_by_this_node_is_given_the_node_as_owner(
    owners: list[dict[str, object]],
) -> None:
    devices, existing = one_slice_pool()
    stored = copy.deepcopy(existing)
    meta = stored[0]["metadata"]
    assert isinstance(meta, dict)
    other = {"apiVersion": "v1", "kind": "ConfigMap", "name": "keep-me", "uid": "cm-uid"}
    meta["ownerReferences"] = [*owners, other]
    plan = plan_sync(build(devices), stored, node_uid="node-uid")
    assert [w.index for w in plan.updates] == [0]
    written = plan.updates[0].body["metadata"]
    assert written["ownerReferences"] == [
        other,  # someone else's reference is kept
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid", "controller": True},
    ]
    assert written["name"] == meta["name"] and written["uid"] == meta["uid"]
    assert written["resourceVersion"] == meta["resourceVersion"]  # still a conditional update
    # the node's uid unknown (the Node could not be read): nothing to compare, nothing written
    assert plan_sync(build(devices), stored, node_uid="").write_count == 0
    # owned already: no write
    assert plan_sync(build(devices), existing, node_uid="node-uid").write_count == 0
