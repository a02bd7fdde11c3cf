"""gpu.py: a whole GPU and a static MIG device get NVIDIA's names, attributes and capacities."""

from __future__ import annotations

import dataclasses

import pytest

from dra_driver.devices.gpu import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    semver_cuda_driver_version,
    semver_driver_version,
)
from dra_driver.devices.model import Version
from dra_driver.devices.pool import node_devices
from dra_driver.devices.validation import validate_device
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import Inventory
from dra_driver.resourceapi import MAX_ATTRIBUTES_AND_CAPACITIES
from dra_driver.sim.nvml import discover_simulated
from tests.devicedata import DRIVER, H100, H100_MIG, mig_instance


def test_full_gpu_is_named_by_minor_with_nvidia_attributes_and_memory() -> None:
    (device,) = node_devices(Inventory(gpus=(H100,)), driver_name=DRIVER).devices

    assert device.name == "gpu-3"
    assert device.attributes == {
        "type": "gpu",
        "uuid": "GPU-8f2c1d7e-0b1a-4c55-9e3d-2a6f0c9b7d41",
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("570.124.6"),
        "cudaDriverVersion": Version("12.8.0"),
        "resource.kubernetes.io/pciBusID": "0000:1b:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:15",
        "resource.kubernetes.io/numaNode": 1,
    }
    assert device.capacity == {"memory": "81559Mi"}
    assert device.consumes_counters == ()


def test_pcie_root_numa_node_and_addressing_mode_appear_only_when_known() -> None:
    unknown = dataclasses.replace(H100, pcie_root=None, numa_node=None)
    coherent = dataclasses.replace(H100, minor=4, addressing_mode="ATS", numa_node=0)

    devices = node_devices(Inventory(gpus=(unknown, coherent)), driver_name=DRIVER).devices

    assert PCIE_ROOT_ATTRIBUTE not in devices[0].attributes
    assert NUMA_NODE_ATTRIBUTE not in devices[0].attributes
    assert "addressingMode" not in devices[0].attributes
    assert devices[1].attributes["addressingMode"] == "ATS"
    assert devices[1].attributes[NUMA_NODE_ATTRIBUTE] == 0  # node 0 is a node, not "unknown"
    assert devices[0].attributes[PCI_BUS_ID_ATTRIBUTE] == "0000:1b:00.0"


def test_index_and_minor_are_never_attributes() -> None:
    inventory = Inventory(gpus=(H100, H100_MIG))

    for device in node_devices(inventory, driver_name=DRIVER).devices:
        assert not {"index", "minor"} & set(device.attributes)


def test_gpu_in_mig_mode_publishes_its_mig_devices_instead_of_itself() -> None:
    devices = node_devices(Inventory(gpus=(H100, H100_MIG)), driver_name=DRIVER).devices

    assert [d.name for d in devices] == [
        "gpu-1-mig-1g10gb-me-20-0",
        "gpu-1-mig-3g40gb-9-4",
        "gpu-3",
    ]


def test_mig_device_carries_parent_facts_and_profile_capacities() -> None:
    devices = node_devices(Inventory(gpus=(H100_MIG,)), driver_name=DRIVER).devices
    device = next(d for d in devices if d.name == "gpu-1-mig-3g40gb-9-4")

    assert device.attributes == {
        "type": "mig",
        "uuid": "MIG-00000000-0000-4000-8000-000000000001",
        "parentUUID": H100.uuid,
        "profile": "3g.40gb",
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("570.124.6"),
        "cudaDriverVersion": Version("12.8.0"),
        "resource.kubernetes.io/pciBusID": "0000:1b:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:15",
        "resource.kubernetes.io/numaNode": 1,
    }
    assert device.capacity == {
        "multiprocessors": "60",
        "copyEngines": "3",
        "decoders": "3",
        "encoders": "0",
        "jpegEngines": "3",
        "ofaEngines": "0",
        "memory": "40448Mi",
        "memorySlice4": "1",
        "memorySlice5": "1",
        "memorySlice6": "1",
        "memorySlice7": "1",
    }


def test_each_mig_device_has_a_memory_slice_capacity_per_slice_of_its_placement() -> None:
    devices = node_devices(Inventory(gpus=(H100_MIG,)), driver_name=DRIVER).devices

    slices = {d.name: sorted(c for c in d.capacity if c.startswith("memorySlice")) for d in devices}
    assert slices == {
        "gpu-1-mig-1g10gb-me-20-0": ["memorySlice0"],
        "gpu-1-mig-3g40gb-9-4": ["memorySlice4", "memorySlice5", "memorySlice6", "memorySlice7"],
    }


def test_a_7g_mig_device_with_every_optional_attribute_stays_within_the_api_limit() -> None:
    """8 memory slices + 7 capacities + 14 attributes = 29 of the 32 the API allows."""
    (profile,) = [
        p
        for p in (discover_simulated("h100:1:mig=7g.80gb", node_name="n").gpus[0].mig_profiles)
        if p.name == "7g.80gb"
    ]
    gpu = dataclasses.replace(
        H100_MIG,
        addressing_mode="ATS",
        mig_profiles=(profile,),
        mig_instances=(mig_instance(profile, 0, 0),),
    )

    (device,) = node_devices(Inventory(gpus=(gpu,)), driver_name=DRIVER).devices

    assert device.name == "gpu-1-mig-7g80gb-0-0"
    assert [f"memorySlice{i}" in device.capacity for i in range(8)] == [True] * 8
    assert len(device.attributes) == 14
    assert len(device.capacity) == 15
    assert len(device.attributes) + len(device.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
    validate_device(device)


@pytest.mark.parametrize(
    ("version", "semver"),
    [
        ("570.124.06", "570.124.6"),
        ("535.104.05", "535.104.5"),
        ("550.54.15", "550.54.15"),
        ("470.82", "470.82.0"),
        ("580", "580.0.0"),
        (" 570.124.06\n", "570.124.6"),
    ],
)
def test_driver_version_is_semver_normalised(version: str, semver: str) -> None:
    assert semver_driver_version(version) == semver


@pytest.mark.parametrize("version", ["", "570.124.06.1", "r570", "570.x.1", "570.", "1.2.3.4.5"])
def test_unreadable_driver_version_is_a_device_model_error(version: str) -> None:
    with pytest.raises(DeviceModelError) as caught:
        semver_driver_version(version)

    assert str(caught.value) == f"driver version {version!r} cannot be read as MAJOR.MINOR.PATCH"


@pytest.mark.parametrize(
    ("version", "semver"),
    [(12080, "12.8.0"), (12020, "12.2.0"), (11040, "11.4.0"), (13000, "13.0.0")],
)
def test_cuda_driver_version_integer_becomes_semver(version: int, semver: str) -> None:
    assert semver_cuda_driver_version(version) == semver
