"""partitionable.py, dynamic MIG (--mig-mode dynamic): partitionable GPUs published as NVIDIA's
driver publishes them (counter set names and layout, device names, consumption), and the GPUs
that stay static.

Inventories come from the simulated NVML library through the real discovery code, so the
profiles and placement tables are what ``nvmlDeviceGetGpuInstancePossiblePlacements`` reports.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import kubernetes_validate
import pytest

from dra_driver.devices.model import Device, NodeDevices, Taint, with_taints
from dra_driver.devices.names import (
    counter_set_name,
    mig_device_name,
    mig_instance_name,
    parse_mig_device_name,
)
from dra_driver.devices.partitionable import (
    is_partitionable,
    partitionable_gpu,
    toggles_mig_mode,
    unmanaged_mig_devices,
)
from dra_driver.devices.pool import node_devices
from dra_driver.errors import DeviceModelError, PublishError
from dra_driver.gpus.info import Inventory
from dra_driver.kube.conversion import convert_slice
from dra_driver.publish.slices import build_slices
from dra_driver.publish.syncplan import plan_sync
from dra_driver.resourceapi import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
)
from dra_driver.sim.localapi import validate_slice
from dra_driver.sim.nvml import discover_simulated
from tests.devicedata import H100_MIG

DRIVER = "gpu.nvidia.com"
NODE = "node1"
KUBERNETES_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
# H100 80GB HBM3, largest profile 7g.80gb: what NVIDIA's driver puts in the counter set.
H100_COUNTERS = {
    "multiprocessors": "132",
    "copy-engines": "8",
    "decoders": "7",
    "encoders": "0",
    "jpeg-engines": "7",
    "ofa-engines": "1",
    "memory": "81152Mi",
    **{f"memory-slice-{i}": "1" for i in range(8)},
}


def inventory(spec: str) -> Inventory:
    return discover_simulated(spec, node_name=NODE)


def dynamic(inv: Inventory, managed: frozenset[str] = frozenset()) -> NodeDevices:
    return node_devices(inv, driver_name=DRIVER, mig_mode="dynamic", managed_mig=managed)


def by_name(devices: NodeDevices) -> dict[str, Device]:
    return {d.name: d for d in devices.devices}


def every_instance(inv: Inventory) -> frozenset[str]:
    return frozenset(mig_instance_name(g, m) for g in inv.gpus for m in g.mig_instances)


# --- what a partitionable GPU publishes ------------------------------------------------------


def test_a_gpu_in_mig_mode_gets_one_counter_set_with_nvidias_counters() -> None:
    published = dynamic(inventory("h100:1:mig"))

    (counter_set,) = published.counter_sets
    assert counter_set.name == "gpu-0-counter-set" == counter_set_name(0)
    assert dict(counter_set.counters) == H100_COUNTERS


def test_every_profile_at_every_placement_is_a_device_after_the_whole_gpu() -> None:
    inv = inventory("h100:1:mig")
    (gpu,) = inv.gpus
    expected = {
        mig_device_name(
            parent_minor=0, profile=p.name, profile_id=p.profile_id, placement_start=pl.start
        )
        for p in gpu.mig_profiles
        for pl in p.placements
    }

    names = [d.name for d in dynamic(inv).devices]

    assert names[0] == "gpu-0"  # the whole GPU first, as a GPU not in MIG mode is named
    assert set(names[1:]) == expected and len(names) == len(expected) + 1
    # 7 + 7 (+me) + 4 + 3 + 2 + 1 + 1 placements on an H100, NVML's placement tables
    assert len(expected) == 25
    assert {"gpu-0-mig-1g10gb-me-20-6", "gpu-0-mig-3g40gb-9-4", "gpu-0-mig-7g80gb-0-0"} <= expected
    for name in names[1:]:
        parent, _, start, _ = parse_mig_device_name(name)
        assert (parent, start) == (0, int(name.rpartition("-")[2]))


def test_the_whole_gpu_consumes_every_counter_and_is_published_as_a_gpu() -> None:
    inv = inventory("h100:1:mig,h100:1")
    published = dynamic(inv)
    whole = by_name(published)["gpu-0"]
    # gpu-1 (not in MIG mode) as static mode publishes it: partitionable too in dynamic mode
    plain = by_name(node_devices(inv, driver_name=DRIVER, mig_mode="static"))["gpu-1"]

    (consumption,) = whole.consumes_counters
    assert consumption.counter_set == "gpu-0-counter-set"
    assert dict(consumption.counters) == H100_COUNTERS == dict(published.counter_sets[0].counters)
    # the same attributes a GPU not in MIG mode has (claims select it the same way)
    assert whole.attributes["type"] == "gpu" and whole.attributes["uuid"] == inv.gpus[0].uuid
    assert set(whole.attributes) == set(plain.attributes)
    assert not plain.consumes_counters


# H100 80GB HBM3: the 7g.80gb profile's capacities, what NVIDIA's driver gives the whole GPU of a
# partitionable GPU (PartCapacities: the largest value of each across the MIG profiles).
L4_MEMORY = "23034Mi"  # an L4's NVML total memory: never partitionable

H100_WHOLE_CAPACITY = {
    "multiprocessors": "132",
    "copyEngines": "8",
    "decoders": "7",
    "encoders": "0",
    "jpegEngines": "7",
    "ofaEngines": "1",
    "memory": "81152Mi",
}


def test_the_whole_gpu_of_a_partitionable_gpu_carries_the_largest_profiles_capacities() -> None:
    published = dynamic(inventory("h100:1:mig,a100-80gb:1,h200:1:mig,h100:1"))
    devices = by_name(published)

    assert dict(devices["gpu-0"].capacity) == H100_WHOLE_CAPACITY
    # a Hopper not in MIG mode is partitionable in dynamic mode too (MIG mode on demand)
    assert dict(devices["gpu-3"].capacity) == H100_WHOLE_CAPACITY
    # the largest placement's capacities, without its memorySlice<i> (as NVIDIA's driver has it)
    largest = devices["gpu-0-mig-7g80gb-0-0"].capacity
    assert {n: v for n, v in largest.items() if not n.startswith("memorySlice")} == (
        H100_WHOLE_CAPACITY
    )
    # an Ampere GPU not in MIG mode is a plain GPU: its NVML total memory only, as NVIDIA's driver
    assert set(devices["gpu-1"].capacity) == {"memory"}
    assert not devices["gpu-1"].consumes_counters
    assert devices["gpu-2"].capacity["memory"] == "140Gi"  # H200's 7g.141gb, as the real one
    assert devices["gpu-2"].capacity["multiprocessors"] == "132"


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_the_whole_gpus_capacities_pass_the_strict_schema(kubernetes_version: str) -> None:
    objs = objects(dynamic(inventory("h100:1:mig,l4:1")))

    wholes = [
        d for o in objs for d in o["spec"].get("devices", ()) if d["name"] in ("gpu-0", "gpu-1")
    ]
    assert {d["name"]: d["capacity"] for d in wholes} == {
        "gpu-1": {"memory": {"value": L4_MEMORY}},
        "gpu-0": {n: {"value": v} for n, v in H100_WHOLE_CAPACITY.items()},
    }
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        assert validate_slice(obj) == []
        for version in ("v1beta2", "v1beta1"):  # the publisher's fallbacks
            kubernetes_validate.validate(
                convert_slice(obj, api_version=version), kubernetes_version, strict=True
            )


def test_an_ampere_gpu_is_not_offered_whole_it_cannot_leave_mig_mode_without_a_reset() -> None:
    published = dynamic(inventory("a100-80gb:1:mig"))
    names = [d.name for d in published.devices]

    assert "gpu-0" not in names
    assert names and all("-mig-" in n for n in names)


def test_placements_come_smallest_memory_first_so_first_fit_picks_the_smallest() -> None:
    names = [d.name for d in dynamic(inventory("h100:1:mig")).devices]
    order = [n for n in names if "-mig-" in n and n.endswith("-0")]
    assert order == [
        "gpu-0-mig-1g10gb-19-0",
        "gpu-0-mig-1g10gb-me-20-0",
        "gpu-0-mig-1g20gb-15-0",
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-4g40gb-5-0",
        "gpu-0-mig-7g80gb-0-0",
    ]


def test_the_counter_set_holds_the_largest_profiles_capacities_and_every_memory_slice() -> None:
    published = dynamic(inventory("h100:1:mig"))
    (counter_set,) = published.counter_sets
    counters = dict(counter_set.counters)

    assert counter_set.name == "gpu-0-counter-set"
    assert counters["memory"] == "81152Mi"  # the 7g.80gb profile's, as NVIDIA's driver has it
    assert counters["multiprocessors"] == "132"
    assert [n for n in counters if n.startswith("memory-slice-")] == [
        f"memory-slice-{i}" for i in range(8)
    ]
    # the largest placement consumes it all: nothing else fits next to a 7g.80gb
    (full,) = by_name(published)["gpu-0-mig-7g80gb-0-0"].consumes_counters
    assert {n: v for n, v in full.counters.items() if v != "0"} == {
        n: v for n, v in counters.items() if v != "0"
    }


def test_a_placement_consumes_its_profiles_capacities_and_the_memory_slices_it_covers() -> None:
    device = by_name(dynamic(inventory("h100:1:mig")))["gpu-0-mig-3g40gb-9-4"]
    (consumption,) = device.consumes_counters

    assert dict(consumption.counters) == {
        "multiprocessors": "60",
        "copy-engines": "3",
        "decoders": "3",
        "encoders": "0",
        "jpeg-engines": "3",
        "ofa-engines": "0",
        "memory": "40448Mi",
        "memory-slice-4": "1",
        "memory-slice-5": "1",
        "memory-slice-6": "1",
        "memory-slice-7": "1",
    }
    assert device.attributes["type"] == "mig"
    assert device.attributes["profile"] == "3g.40gb"
    assert "uuid" not in device.attributes  # the MIG device does not exist yet
    assert str(device.attributes["parentUUID"]).startswith("GPU-")
    assert {k for k in device.capacity if k.startswith("memorySlice")} == {
        f"memorySlice{i}" for i in range(4, 8)
    }


def test_a_media_extension_placement_takes_the_gpus_only_ofa_engine() -> None:
    published = by_name(dynamic(inventory("h100:1:mig")))
    me = published["gpu-0-mig-1g10gb-me-20-3"]
    plain = published["gpu-0-mig-1g10gb-19-3"]

    assert me.consumes_counters[0].counters["ofa-engines"] == "1"
    assert plain.consumes_counters[0].counters["ofa-engines"] == "0"
    assert H100_COUNTERS["ofa-engines"] == "1"  # so two +me placements never fit together


def test_ampere_offers_no_whole_gpu_while_in_mig_mode() -> None:
    published = dynamic(inventory("a100-80gb:1:mig"))
    names = [d.name for d in published.devices]

    assert "gpu-0" not in names
    assert published.counter_sets[0].counters["memory"] == "79Gi"  # 80896 MiB (7g.80gb)
    assert "gpu-0-mig-7g80gb-0-0" in names


def test_an_ampere_gpu_not_in_mig_mode_stays_a_plain_gpu_in_dynamic_mode() -> None:
    published = dynamic(inventory("a100-80gb:1"))  # its MIG mode changes only with a reset
    (device,) = published.devices
    assert published.counter_sets == ()
    assert device.name == "gpu-0"
    assert device.consumes_counters == ()
    assert device.capacity == {"memory": "80Gi"}


def test_a_hopper_gpu_not_in_mig_mode_is_partitionable_as_one_in_mig_mode() -> None:
    """MIG mode on demand: the same counter set and devices whatever the MIG mode (prepare of a
    placement turns it on), as NVIDIA's driver publishes a Hopper in dynamic MIG mode."""
    off, on = inventory("h100:1"), inventory("h100:1:mig")
    assert not off.gpus[0].mig_enabled and is_partitionable(off.gpus[0], managed_mig=frozenset())
    assert dynamic(off) == dynamic(on)
    assert dict(dynamic(off).counter_sets[0].counters) == H100_COUNTERS


def test_static_mode_publishes_existing_mig_devices_only() -> None:
    inv = inventory("h100:1:mig=3g.40gb")
    published = node_devices(inv, driver_name=DRIVER)
    (device,) = published.devices
    assert published.counter_sets == ()
    assert device.name == "gpu-0-mig-3g40gb-9-0"
    assert str(device.attributes["uuid"]).startswith("MIG-")


def test_an_unknown_mig_mode_is_refused() -> None:
    with pytest.raises(DeviceModelError, match="MIG mode 'auto'"):
        node_devices(inventory("h100:1"), driver_name=DRIVER, mig_mode="auto")  # type: ignore[arg-type]


# --- GPUs with MIG devices the driver did not create ------------------------------------------


def test_a_gpu_with_a_mig_device_the_driver_did_not_create_stays_static() -> None:
    inv = inventory("h100:1:mig=1g.10gb,h100:1:mig")
    foreign = "gpu-0-mig-1g10gb-19-0"

    published = dynamic(inv)

    assert unmanaged_mig_devices(inv.gpus[0], managed_mig=frozenset()) == (foreign,)
    assert not is_partitionable(inv.gpus[0], managed_mig=frozenset())
    assert [cs.name for cs in published.counter_sets] == ["gpu-1-counter-set"]
    static = by_name(published)[foreign]
    assert str(static.attributes["uuid"]).startswith("MIG-")
    assert static.consumes_counters == ()
    assert not any(d.name.startswith("gpu-0-") and d.name != foreign for d in published.devices)


def test_a_gpu_whose_mig_devices_the_driver_created_stays_partitionable() -> None:
    inv = inventory("h100:1:mig=3g.40gb+1g.10gb")
    managed = every_instance(inv)
    assert managed == {"gpu-0-mig-3g40gb-9-0", "gpu-0-mig-1g10gb-19-4"}

    published = dynamic(inv, managed)

    assert [cs.name for cs in published.counter_sets] == ["gpu-0-counter-set"]
    device = by_name(published)["gpu-0-mig-3g40gb-9-0"]
    assert "uuid" not in device.attributes
    assert device.consumes_counters


def test_managed_mig_devices_appearing_and_disappearing_change_nothing_published() -> None:
    empty = inventory("h100:2:mig")
    busy = inventory("h100:1:mig=3g.40gb+1g.10gb+me,h100:1:mig=7g.80gb")

    assert dynamic(empty) == dynamic(busy, every_instance(busy))


# --- health taints ---------------------------------------------------------------------------


def test_the_taints_of_a_partitionable_gpu_reach_its_whole_device_and_every_placement() -> None:
    published = dynamic(inventory("h100:2:mig"))
    lost = (Taint(key=f"{DRIVER}/gpu-lost", value="", effect="NoSchedule"),)
    xid = (Taint(key=f"{DRIVER}/xid", value="43", effect="NoSchedule"),)

    tainted = with_taints(published, {"gpu-0": lost, "gpu-0-mig-1g10gb-19-2": xid})

    for device in tainted.devices:
        if device.name == "gpu-0-mig-1g10gb-19-2":
            assert device.taints == xid  # its own taints, which include the GPU's own
        elif device.name.startswith("gpu-0"):
            assert device.taints == lost, device.name
        else:
            assert device.taints == (), device.name


# --- slices: limits and the API's schemas -------------------------------------------------------


def objects(published: NodeDevices) -> list[dict[str, Any]]:
    pool = build_slices(published, driver_name=DRIVER, node_name=NODE)
    plan = plan_sync(pool, [], node_uid="node-uid")
    out = []
    for i, write in enumerate(plan.creates):
        body = write.body
        body["metadata"]["name"] = body["metadata"]["generateName"] + f"{i:05d}"
        out.append(body)
    return out


@pytest.mark.parametrize("kubernetes_version", KUBERNETES_VERSIONS)
def test_eight_h100_in_dynamic_mode_fit_the_limits_and_pass_the_strict_schema(
    kubernetes_version: str,
) -> None:
    published = dynamic(inventory("h100:8:mig"))
    objs = objects(published)

    shapes = [
        (len(o["spec"].get("devices", ())), len(o["spec"].get("sharedCounters", ()))) for o in objs
    ]
    assert shapes == [(0, 8), (64, 0), (64, 0), (64, 0), (16, 0)]
    assert sum(d for d, _ in shapes) == 8 * (1 + 25)  # the whole GPU and its 25 placements
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_version, strict=True)
        assert validate_slice(obj) == []
        for version in ("v1beta2", "v1beta1"):  # the publisher's fallbacks
            older = convert_slice(obj, api_version=version)
            kubernetes_validate.validate(older, kubernetes_version, strict=True)


def test_nine_gpus_need_a_second_counter_set_slice() -> None:
    published = dynamic(inventory("h100:9:mig"))
    objs = objects(published)
    counter_slices = [o for o in objs if o["spec"].get("sharedCounters")]

    assert [len(o["spec"]["sharedCounters"]) for o in counter_slices] == [
        MAX_COUNTER_SETS_PER_SLICE,
        1,
    ]
    for obj in objs:
        spec = obj["spec"]
        assert not (spec.get("devices") and spec.get("sharedCounters"))
        assert len(spec.get("devices", ())) <= MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        assert validate_slice(obj) == []


def test_the_api_refuses_a_ninth_counter_set_in_one_slice() -> None:
    objs = objects(dynamic(inventory("h100:9:mig")))
    first, second = (o for o in objs if o["spec"].get("sharedCounters"))
    first["spec"]["sharedCounters"].extend(second["spec"]["sharedCounters"])

    assert validate_slice(first) != []


def test_a_counter_set_with_more_than_32_counters_is_refused_before_it_is_sent() -> None:
    published = dynamic(inventory("h100:1:mig"))
    (counter_set,) = published.counter_sets
    assert len(counter_set.counters) == 15  # 7 capacities and 8 memory slices
    too_many = replace(
        counter_set, counters={**counter_set.counters, **{f"extra-{i}": "1" for i in range(18)}}
    )
    with pytest.raises(PublishError, match="has 33 counters; the API allows 1 to 32"):
        build_slices(
            replace(published, counter_sets=(too_many,)), driver_name=DRIVER, node_name=NODE
        )
    (obj,) = (o for o in objects(published) if o["spec"].get("sharedCounters"))
    obj["spec"]["sharedCounters"][0]["counters"].update(
        {f"extra-{i}": {"value": "1"} for i in range(18)}
    )
    assert validate_slice(obj) != []  # the fake API server's own check agrees


# --- the model on hand-made GPUs ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("architecture", "compute_capability", "mig_capable", "toggles"),
    [
        ("Hopper", (9, 0), True, True),
        ("Blackwell", (10, 0), True, True),
        ("Hopper", (8, 9), True, True),  # a known architecture needs no compute capability
        ("Rubin", (9, 0), True, True),  # unknown to us: compute capability 9 or more decides
        ("Rubin", (10, 0), True, True),
        ("Ampere", (8, 9), True, False),
        ("Ampere", (8, 0), True, False),
        ("Hopper", (9, 0), False, False),
    ],
)
def test_hopper_and_newer_toggle_mig_mode_without_a_reset(
    architecture: str, compute_capability: tuple[int, int], mig_capable: bool, toggles: bool
) -> None:
    gpu = replace(
        H100_MIG,
        architecture=architecture,
        cuda_compute_capability=compute_capability,
        mig_capable=mig_capable,
    )

    assert toggles_mig_mode(gpu) is toggles


def test_a_gpu_reporting_no_mig_profiles_is_not_partitioned() -> None:
    with pytest.raises(DeviceModelError) as caught:
        partitionable_gpu(replace(H100_MIG, mig_profiles=()))

    assert str(caught.value) == "GPU gpu-1 reports no MIG profiles"


def test_counts_are_decimal_quantities_and_memory_a_binary_one() -> None:
    """2048 multiprocessors are ``2048`` (DecimalSI, as the API server stores a count), not
    ``2Ki``; memory is BinarySI."""
    profile = replace(
        H100_MIG.mig_profiles[1], multiprocessors=2048, copy_engines=1024, memory_bytes=2**30
    )

    counter_set, devices = partitionable_gpu(replace(H100_MIG, mig_profiles=(profile,)))

    assert counter_set.counters["multiprocessors"] == "2048"
    assert counter_set.counters["copy-engines"] == "1024"
    assert counter_set.counters["memory"] == "1Gi"
    assert devices[0].capacity["multiprocessors"] == "2048"
    assert devices[-1].capacity["multiprocessors"] == "2048"
    assert devices[-1].capacity["memory"] == "1Gi"


def test_a_profile_without_placements_adds_no_memory_slice_counter() -> None:
    profile = replace(H100_MIG.mig_profiles[1], placements=())

    counter_set, devices = partitionable_gpu(replace(H100_MIG, mig_profiles=(profile,)))

    assert not [c for c in counter_set.counters if c.startswith("memory-slice-")]
    assert [d.name for d in devices] == ["gpu-1"]
