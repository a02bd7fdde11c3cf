"""slices.py: chunking, API shapes and validation. Pure: no server involved;
the slice limits are checked with the fake API server's independent validator, and the slices of a
simulated MIG node against Kubernetes' strict OpenAPI schemas."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest

from dra_driver.devices import (
    CounterConsumption,
    Device,
    NodeDevices,
    RequestPolicy,
    Taint,
    node_devices,
    with_taints,
)
from dra_driver.errors import PublishError
from dra_driver.health.decisions import MAX_HEALTH_TAINTS
from dra_driver.publish.slices import (
    SliceContent,
    build_slices,
    content_of,
    device_json,
    slice_index,
    to_api_objects,
)
from dra_driver.sim.localapi import validate_slice
from dra_driver.sim.nvml import discover_simulated
from tests.slicedata import DRIVER, NODE, build, counter_set, gpu, publish, sizes

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


def test_equal_values_of_many_devices_are_one_object_and_the_json_is_unchanged() -> None:
    """What every GPU of a node has alike (type, memory) is built once, not per device; a
    capacity with a request policy keeps its own object; bool and int never mix (True is 1)."""
    policy = RequestPolicy(default="1", valid_values=("1", "2"))
    a = Device(
        name="gpu-0",
        attributes={"type": "gpu", "minor": 1, "mig": True},
        capacity={"memory": "80Gi", "shares": "2"},
        request_policies={"shares": policy},
    )
    b = Device(
        name="gpu-1",
        attributes={"type": "gpu", "minor": 2, "mig": True},
        capacity={"memory": "80Gi", "shares": "2"},
    )
    ja, jb = device_json(a), device_json(b)
    assert ja["attributes"]["type"] is jb["attributes"]["type"]
    assert ja["attributes"]["mig"] is jb["attributes"]["mig"] == {"bool": True}
    assert ja["attributes"]["minor"] == {"int": 1}  # not the shared {"bool": True}
    assert ja["capacity"]["memory"] is jb["capacity"]["memory"]
    assert ja["capacity"]["shares"] == {
        "value": "2",
        "requestPolicy": {"default": "1", "validValues": ["1", "2"]},
    }
    assert jb["capacity"]["shares"] == {"value": "2"}  # the policy stayed on gpu-0
    assert json.loads(json.dumps([ja, jb])) == [ja, jb]


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


def test_slice_names_are_matched_by_index_prefix_even_when_truncated() -> None:
    long_node = "n" * 60
    pool = build_slices(NodeDevices(), driver_name=DRIVER, node_name=long_node)
    generated = pool.generate_name(0)[:58] + "abcde"
    assert slice_index(generated, pool) == 0
    assert slice_index("00000-other.driver-" + long_node, pool) is None
    assert slice_index("0000g-gpu.nvidia.com-" + long_node, pool) is None
    assert slice_index("000000-gpu.nvidia.com-", pool) is None


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
