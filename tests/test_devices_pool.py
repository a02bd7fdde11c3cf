"""pool.py: GPU facts become the node's pool of DRA devices, within the API's rules."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dra_driver.devices.gpu import NUMA_NODE_ATTRIBUTE, gpu_device
from dra_driver.devices.model import Version
from dra_driver.devices.names import mig_instance_name, mig_profile_slug, parse_mig_device_name
from dra_driver.devices.partitionable import partitionable_gpu
from dra_driver.devices.pool import node_devices
from dra_driver.devices.validation import validate_device
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import Inventory
from dra_driver.sim.nvml import discover_simulated
from dra_driver.sim.profiles import HARDWARE_PROFILES
from tests.devicedata import DRIVER, H100


def test_node_devices_refuses_a_device_the_api_would_reject() -> None:
    long_name = dataclasses.replace(H100, product_name="NVIDIA " + "X" * 60)

    with pytest.raises(DeviceModelError, match="device 'gpu-3': attribute 'productName'"):
        node_devices(Inventory(gpus=(long_name,)), driver_name=DRIVER)


def test_node_devices_refuses_duplicate_names() -> None:
    twin = dataclasses.replace(H100, index=1, uuid="GPU-other")

    with pytest.raises(DeviceModelError, match="'gpu-3' would be published twice"):
        node_devices(Inventory(gpus=(H100, twin)), driver_name=DRIVER)


def test_node_devices_refuses_an_invalid_driver_name() -> None:
    with pytest.raises(DeviceModelError, match="driver name"):
        node_devices(Inventory(gpus=(H100,)), driver_name="GPU_nvidia")


def test_simulated_node_publishes_the_expected_devices() -> None:
    inventory = discover_simulated(
        "a100-40gb:1:mig=3g.20gb+2g.10gb+1g.5gb+me,h100:1,l4:1", node_name="node-1"
    )

    devices = node_devices(inventory, driver_name=DRIVER).devices

    assert [d.name for d in devices] == [
        "gpu-0-mig-3g20gb-9-0",
        "gpu-0-mig-2g10gb-14-4",
        "gpu-0-mig-1g5gb-me-20-6",
        "gpu-1",
        "gpu-2",
    ]
    assert devices[2].attributes["profile"] == "1g.5gb+me"
    assert devices[2].capacity["memory"] == "4864Mi"
    assert devices[3].capacity["memory"] == "81559Mi"
    assert devices[4].attributes["architecture"] == "Ada Lovelace"
    assert devices[4].attributes["cudaComputeCapability"] == Version("8.9.0")
    # Three GPUs, two root complexes: the A100 and the H100 on NUMA node 0, the L4 on node 1.
    assert [d.attributes[NUMA_NODE_ATTRIBUTE] for d in devices] == [0, 0, 0, 0, 1]
    assert [sorted(c for c in d.capacity if c.startswith("memorySlice")) for d in devices[:3]] == [
        ["memorySlice0", "memorySlice1", "memorySlice2", "memorySlice3"],
        ["memorySlice4", "memorySlice5"],
        ["memorySlice6"],
    ]
    assert not any(c.startswith("memorySlice") for d in devices[3:] for c in d.capacity)


_MIG_LAYOUTS = {
    "a100-40gb": ["", "3g.20gb+2g.10gb+1g.5gb", "1g.5gb*7", "1g.5gb+me+1g.10gb*3", "7g.40gb"],
    "a100-80gb": ["", "4g.40gb+3g.40gb", "1g.20gb*4", "2g.20gb*3+1g.10gb+me"],
    "h100-80gb": ["", "1g.10gb*7", "3g.40gb*2", "1g.20gb+2g.20gb+4g.40gb"],
    "h200-141gb": ["", "7g.141gb", "1g.18gb+me+1g.35gb*3", "3g.71gb+2g.35gb+1g.18gb*2"],
}


@st.composite
def simulate_specs(draw: st.DrawFn) -> str:
    groups = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        key = draw(st.sampled_from(sorted(HARDWARE_PROFILES)))
        group = f"{key}:{draw(st.integers(min_value=1, max_value=4))}"
        if key in _MIG_LAYOUTS and draw(st.booleans()):
            layout = draw(st.sampled_from(_MIG_LAYOUTS[key]))
            group += f":mig={layout}" if layout else ":mig"
        group += draw(st.sampled_from(["", ":fail", ":addressing=hmm", ":addressing=ats"]))
        group += draw(st.sampled_from(["", ":numa=none", ":numa=3"]))
        groups.append(group)
    return ",".join(groups)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=simulate_specs(), node=st.from_regex(r"[a-z][a-z0-9-]{0,20}[a-z0-9]", fullmatch=True))
def test_every_device_of_a_random_simulated_node_is_valid(spec: str, node: str) -> None:
    inventory = discover_simulated(spec, node_name=node)

    devices = node_devices(inventory, driver_name=DRIVER).devices

    names = [d.name for d in devices]
    assert len(names) == len(set(names))
    for d in devices:
        validate_device(d)
        if d.attributes["type"] == "mig":
            parent, profile_id, start, slug = parse_mig_device_name(d.name)
            assert slug == mig_profile_slug(str(d.attributes["profile"]))
            parent_gpu = next(g for g in inventory.gpus if g.uuid == d.attributes["parentUUID"])
            assert parent_gpu.minor == parent
            mig = next(m for m in parent_gpu.mig_instances if m.uuid == d.attributes["uuid"])
            assert (mig.profile.profile_id, mig.placement.start) == (profile_id, start)
            span = range(mig.placement.start, mig.placement.start + mig.placement.size)
            assert {c: v for c, v in d.capacity.items() if c.startswith("memorySlice")} == {
                f"memorySlice{i}": "1" for i in span
            }
        gpu = next(
            g
            for g in inventory.gpus
            if g.uuid == d.attributes.get("parentUUID", d.attributes["uuid"])
        )
        assert d.attributes.get(NUMA_NODE_ATTRIBUTE) == gpu.numa_node
    published_gpus = {d.attributes.get("parentUUID", d.attributes["uuid"]) for d in devices}
    assert published_gpus <= {g.uuid for g in inventory.gpus}
    for gpu in inventory.gpus:
        if not gpu.mig_enabled:
            assert f"gpu-{gpu.minor}" in names


def test_an_unknown_mig_mode_is_refused_naming_the_modes() -> None:
    with pytest.raises(DeviceModelError) as err:
        node_devices(Inventory(gpus=(H100,)), driver_name=DRIVER, mig_mode="auto")  # type: ignore[arg-type]
    assert str(err.value) == "MIG mode 'auto' is not one of static, dynamic"


_MIXED = "h100:1:mig=3g.40gb*2,l4:1"


def test_static_mig_mode_publishes_the_existing_mig_devices_and_no_counter_sets() -> None:
    inventory = discover_simulated(_MIXED, node_name="node-1")
    h100, _ = inventory.gpus
    managed = frozenset(mig_instance_name(h100, m) for m in h100.mig_instances)

    published = node_devices(inventory, driver_name=DRIVER, managed_mig=managed)

    assert published.counter_sets == ()
    assert [d.name for d in published.devices] == [
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-1",
    ]


def test_dynamic_mig_mode_publishes_a_gpu_whose_mig_devices_are_ours_as_partitions_last() -> None:
    inventory = discover_simulated(_MIXED, node_name="node-1")
    h100, l4 = inventory.gpus
    managed = frozenset(mig_instance_name(h100, m) for m in h100.mig_instances)

    published = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic", managed_mig=managed)

    counter_set, partitions = partitionable_gpu(h100)
    # the plain L4 first: a whole-GPU claim takes it before a GPU that must leave MIG mode
    assert published.devices == (gpu_device(l4), *partitions)
    assert published.counter_sets == (counter_set,)
    assert counter_set.name == "gpu-0-counter-set"


def test_dynamic_mig_mode_keeps_a_gpu_with_a_mig_device_not_ours_static() -> None:
    inventory = discover_simulated(_MIXED, node_name="node-1")
    h100, _ = inventory.gpus
    ours = frozenset({mig_instance_name(h100, h100.mig_instances[0])})

    published = node_devices(inventory, driver_name=DRIVER, mig_mode="dynamic", managed_mig=ours)

    assert published.counter_sets == ()
    assert [d.name for d in published.devices] == [
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-1",
    ]
