"""slices.py: chunking, API shapes, validation and the G.3 sync plan. Pure: no server involved;
the slice limits are checked with the fake API server's independent validator, and the slices of a
simulated MIG node against Kubernetes' strict OpenAPI schemas."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import kubernetes_validate
import pytest

from dra_driver.devices import (
    CounterConsumption,
    CounterSet,
    Device,
    NodeDevices,
    Taint,
    Version,
    node_devices,
    with_taints,
)
from dra_driver.errors import PublishError
from dra_driver.health.decisions import MAX_HEALTH_TAINTS
from dra_driver.publish.slices import (
    DesiredPool,
    SliceContent,
    build_slices,
    content_of,
    convert_slice,
    dropped_fields,
    plan_sync,
    slice_index,
    slice_to_v1,
    to_api_objects,
)
from dra_driver.sim.localapi import validate_slice
from dra_driver.sim.nvml import discover_simulated

DRIVER = "gpu.nvidia.com"
NODE = "node1"
_uid = itertools.count()


def gpu(
    minor: int,
    *,
    taints: tuple[Taint, ...] = (),
    counter_set: str | None = None,
    memory: str = "80Gi",
) -> Device:
    consumes = (
        (CounterConsumption(counter_set=counter_set, counters={"memory": memory}),)
        if counter_set
        else ()
    )
    return Device(
        name=f"gpu-{minor}",
        attributes={
            "type": "gpu",
            "uuid": f"GPU-{minor:08d}",
            "cudaComputeCapability": Version("9.0.0"),
            "minorNumber": minor,
            "mig": False,
        },
        capacity={"memory": memory},
        consumes_counters=consumes,
        taints=taints,
    )


def counter_set(name: str) -> CounterSet:
    return CounterSet(name=name, counters={"memory": "80Gi", "multiprocessors": "132"})


def build(node_devices: NodeDevices, **kw: Any) -> DesiredPool:
    return build_slices(node_devices, driver_name=DRIVER, node_name=NODE, **kw)


def stored(body: dict[str, Any]) -> dict[str, Any]:
    """What the API server keeps of a created body: a name, uid, resourceVersion, taint times."""
    obj = copy.deepcopy(body)
    n = next(_uid)
    meta = obj["metadata"]
    meta["name"] = meta["generateName"] + f"x{n:04d}"[-5:]
    meta["uid"] = f"uid-{n}"
    meta["resourceVersion"] = str(1000 + n)
    for device in obj["spec"].get("devices", ()):
        for taint in device.get("taints", ()):
            taint.setdefault("timeAdded", "2026-01-01T00:00:00Z")
    return obj


def publish(pool: DesiredPool) -> list[dict[str, Any]]:
    plan = plan_sync(pool, [], node_uid="node-uid")
    return [stored(w.body) for w in plan.creates]


def sizes(pool: DesiredPool) -> list[tuple[int, int]]:
    return [(len(s.devices), len(s.shared_counters)) for s in pool.slices]


# --- chunking ------------------------------------------------------------------------------------


def test_one_gpu_node_is_one_slice_with_flat_v1_devices() -> None:
    pool = build(NodeDevices(devices=(gpu(0),)))
    (obj,) = to_api_objects(pool, node_uid="node-uid")
    assert obj["spec"]["devices"] == [
        {
            "name": "gpu-0",
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": "GPU-00000000"},
                "cudaComputeCapability": {"version": "9.0.0"},
                "minorNumber": {"int": 0},
                "mig": {"bool": False},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
    ]
    assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert obj["spec"]["nodeName"] == NODE
    assert obj["metadata"]["generateName"] == "00000-gpu.nvidia.com-node1-"
    assert validate_slice(obj) == []


def test_plain_devices_are_split_at_128_per_slice() -> None:
    pool = build(NodeDevices(devices=tuple(gpu(i) for i in range(300))))
    assert sizes(pool) == [(128, 0), (128, 0), (44, 0)]
    names = [d["name"] for s in pool.slices for d in s.devices]
    assert names == [f"gpu-{i}" for i in range(300)]


def test_devices_consuming_counters_are_split_at_64_and_counter_sets_get_own_slices() -> None:
    sets = tuple(counter_set(f"gpu-{i}-counter-set") for i in range(20))
    devices = tuple(gpu(i, counter_set=f"gpu-{i % 20}-counter-set") for i in range(130))
    pool = build(NodeDevices(devices=devices, counter_sets=sets))
    assert sizes(pool) == [(0, 8), (0, 8), (0, 4), (64, 0), (64, 0), (2, 0)]
    for obj in to_api_objects(pool, node_uid="node-uid"):
        assert validate_slice(obj) == []


def test_a_tainted_device_limits_its_slice_to_64() -> None:
    taint = Taint(key="gpu.nvidia.com/xid", value="79", effect="NoSchedule")
    devices = tuple(gpu(i, taints=(taint,) if i == 70 else ()) for i in range(100))
    pool = build(NodeDevices(devices=devices))
    assert sizes(pool) == [(70, 0), (30, 0)]
    for obj in to_api_objects(pool, node_uid="node-uid"):
        assert validate_slice(obj) == []


def test_the_same_devices_always_give_the_same_slices() -> None:
    devices = NodeDevices(devices=tuple(gpu(i) for i in range(200)))
    assert build(devices) == build(devices)


def test_an_empty_node_publishes_one_empty_slice() -> None:
    pool = build(NodeDevices())
    assert pool.slices == (SliceContent(),)
    (obj,) = to_api_objects(pool, node_uid="node-uid")
    assert "devices" not in obj["spec"]
    assert validate_slice(obj) == []


def test_generate_names_carry_the_index_as_five_hex_digits() -> None:
    pool = build(NodeDevices(devices=tuple(gpu(i) for i in range(128 * 17))))
    objs = to_api_objects(pool, node_uid="node-uid")
    assert [o["metadata"]["generateName"] for o in objs][15:17] == [
        "0000f-gpu.nvidia.com-node1-",
        "00010-gpu.nvidia.com-node1-",
    ]
    assert objs[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid", "controller": True}
    ]


# --- validation ----------------------------------------------------------------------------------


def test_duplicate_device_names_are_rejected() -> None:
    with pytest.raises(PublishError, match="'gpu-1' appears twice"):
        build(NodeDevices(devices=(gpu(1), gpu(1))))


def test_duplicate_counter_set_names_are_rejected() -> None:
    with pytest.raises(PublishError, match="counter set 'cs' is defined twice"):
        build(NodeDevices(counter_sets=(counter_set("cs"), counter_set("cs"))))


def test_consuming_an_unknown_counter_set_is_rejected() -> None:
    with pytest.raises(PublishError, match="'gpu-0' consumes from counter set 'nope'"):
        build(NodeDevices(devices=(gpu(0, counter_set="nope"),)))


def test_consuming_an_unknown_counter_is_rejected() -> None:
    device = Device(
        name="gpu-0-mig-1g10gb-19-0",
        attributes={},
        capacity={},
        consumes_counters=(CounterConsumption(counter_set="cs", counters={"engines": "1"}),),
    )
    with pytest.raises(PublishError, match="counter 'engines', which counter set 'cs' does not"):
        build(NodeDevices(devices=(device,), counter_sets=(counter_set("cs"),)))


def test_a_device_name_that_is_not_a_dns_label_is_rejected() -> None:
    device = Device(name="GPU_0", attributes={}, capacity={})
    with pytest.raises(PublishError, match="'GPU_0' is not a DNS label"):
        build(NodeDevices(devices=(device,)))


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
        build(NodeDevices(devices=tuple(gpu(i) for i in range(200)))), existing, node_uid="u"
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
        build(NodeDevices(devices=tuple(gpu(i) for i in range(100)))), existing, node_uid="u"
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
    plan = plan_sync(build(NodeDevices(devices=tuple(devices))), existing, node_uid="u")
    assert plan.generation == 2
    assert plan_sync(build(NodeDevices(devices=tuple(devices))), [], node_uid="u").generation == 1


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
    assert plan_sync(adopted, [obj], node_uid="u").write_count == 0
    obj["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:05Z"
    assert plan_sync(adopted, [obj], node_uid="u").write_count == 1


def test_slice_names_are_matched_by_index_prefix_even_when_truncated() -> None:
    long_node = "n" * 60
    pool = build_slices(NodeDevices(), driver_name=DRIVER, node_name=long_node)
    generated = pool.generate_name(0)[:58] + "abcde"
    assert slice_index(generated, pool) == 0
    assert slice_index("00000-other.driver-" + long_node, pool) is None
    assert slice_index("0000g-gpu.nvidia.com-" + long_node, pool) is None
    assert slice_index("000000-gpu.nvidia.com-", pool) is None


# --- shapes and dropped fields -------------------------------------------------------------------


def test_v1beta1_wraps_device_fields_in_basic_and_converts_back() -> None:
    taint = Taint(key="k", value="v", effect="NoSchedule")
    pool = build(NodeDevices(devices=(gpu(0, taints=(taint,)),)))
    (obj,) = to_api_objects(pool, node_uid="node-uid")
    beta1 = convert_slice(obj, api_version="v1beta1")
    assert beta1["apiVersion"] == "resource.k8s.io/v1beta1"
    device = beta1["spec"]["devices"][0]
    assert set(device) == {"name", "basic"}
    assert device["basic"]["capacity"] == {"memory": {"value": "80Gi"}}
    assert device["basic"]["taints"] == [{"key": "k", "value": "v", "effect": "NoSchedule"}]
    assert slice_to_v1(beta1) == obj
    beta2 = convert_slice(obj, api_version="v1beta2")
    assert beta2["spec"] == obj["spec"]
    assert beta2["apiVersion"] == "resource.k8s.io/v1beta2"


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


def test_content_of_reads_devices_and_counters_of_an_object() -> None:
    pool = build(NodeDevices(devices=(gpu(0),), counter_sets=(counter_set("cs"),)))
    objs = to_api_objects(pool, node_uid="u")
    assert [content_of(o) for o in objs] == list(pool.slices)


# --- real device models against the API's schemas and limits ------------------------------------

KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
# Every 7g device carries all 8 memory slices; addressing=ats adds the last optional attribute.
MIG_NODE = "h100:2:mig=7g.80gb:addressing=ats,h100:2:mig=1g.10gb+me+1g.10gb*6"


def simulated_objects(spec: str) -> list[dict[str, Any]]:
    inventory = discover_simulated(spec, node_name=NODE)
    return publish(build(node_devices(inventory, driver_name=DRIVER)))


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_mig_devices_with_numa_nodes_and_memory_slices_pass_the_strict_schema(
    kubernetes_version: str,
) -> None:
    (obj,) = simulated_objects(MIG_NODE)

    kubernetes_validate.validate(obj, kubernetes_version, strict=True)
    assert validate_slice(obj) == []
    devices = {d["name"]: d for d in obj["spec"]["devices"]}
    big = devices["gpu-0-mig-7g80gb-0-0"]
    assert big["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 0}
    assert big["attributes"]["addressingMode"] == {"string": "ATS"}
    assert {k: v for k, v in big["capacity"].items() if k.startswith("memorySlice")} == {
        f"memorySlice{i}": {"value": "1"} for i in range(8)
    }
    assert len(big["attributes"]) + len(big["capacity"]) == 29
    small = devices["gpu-3-mig-1g10gb-19-6"]
    assert small["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert small["capacity"]["memorySlice6"] == {"value": "1"}
    assert "memorySlice5" not in small["capacity"]


def test_three_more_attributes_on_a_7g_mig_device_would_be_refused_by_the_api() -> None:
    (obj,) = simulated_objects(MIG_NODE)
    device = obj["spec"]["devices"][0]
    assert len(device["attributes"]) + len(device["capacity"]) == 29

    device["attributes"].update({f"extra{i}": {"int": i} for i in range(3)})
    assert validate_slice(obj) == []
    device["attributes"]["extra3"] = {"int": 3}

    assert validate_slice(obj) == ["spec.devices[0]: Too many attributes and capacities (max 32)"]


def health_taints(value: str = "79") -> tuple[Taint, ...]:
    """As many health taints as a device carries at most, in the monitor's spelling."""
    return (
        Taint(key=f"{DRIVER}/gpu-lost", value="", effect="NoExecute"),
        Taint(key=f"{DRIVER}/ecc-double-bit", value="", effect="NoExecute"),
        Taint(key=f"{DRIVER}/remapped-rows-pending", value="", effect="NoSchedule"),
        Taint(key=f"{DRIVER}/xid", value=value, effect="None"),
    )[:MAX_HEALTH_TAINTS]


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_tainted_devices_pass_the_strict_schema_within_the_taint_limits(
    kubernetes_version: str,
) -> None:
    devices = node_devices(discover_simulated(MIG_NODE, node_name=NODE), driver_name=DRIVER)
    # 66 devices: the 64-device limit of a slice with taints splits them into two slices.
    many = NodeDevices(
        devices=devices.devices + tuple(gpu(100 + i) for i in range(66 - len(devices.devices)))
    )
    tainted = with_taints(many, {d.name: health_taints() for d in many.devices})
    objs = publish(build(tainted))
    assert [len(o["spec"]["devices"]) for o in objs] == [64, 2]
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        assert validate_slice(obj) == []
        for device in obj["spec"]["devices"]:
            assert [t["key"] for t in device["taints"]] == [t.key for t in health_taints()]
            assert all(t["timeAdded"] for t in device["taints"])
    untainted = publish(build(many))
    assert [len(o["spec"]["devices"]) for o in untainted] == [66]


def test_the_api_refuses_a_seventeenth_taint() -> None:
    too_many = tuple(Taint(key=f"{DRIVER}/t{i}", value="", effect="NoSchedule") for i in range(17))
    (obj,) = publish(build(NodeDevices(devices=(gpu(0, taints=too_many[:16]),))))
    assert validate_slice(obj) == []
    obj["spec"]["devices"][0]["taints"].append({"key": f"{DRIVER}/t16", "effect": "NoSchedule"})
    assert validate_slice(obj) == ["spec.devices[0].taints: Too many (max 16)"]
