"""Whole GPUs and existing (static) MIG devices as DRA devices: their attributes and capacities.
Pure.

Place in the flow: pool.py asks for one device per GPU not in MIG mode (:func:`gpu_device`) and
one per existing MIG device (:func:`mig_device`); partitionable.py builds the dynamic MIG devices
from the same attributes.
"""

from __future__ import annotations

from dra_driver.devices.model import AttributeValue, Device, Version
from dra_driver.devices.names import gpu_device_name, memory_slice_capacity, mig_device_name
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, MigInstance
from dra_driver.quantity import binary, decimal

STANDARD_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID_ATTRIBUTE = f"{STANDARD_DOMAIN}/pciBusID"
PCIE_ROOT_ATTRIBUTE = f"{STANDARD_DOMAIN}/pcieRoot"
NUMA_NODE_ATTRIBUTE = f"{STANDARD_DOMAIN}/numaNode"


def semver_driver_version(version: str) -> str:
    """NVML's driver version as semver: ``570.124.06`` -> ``570.124.6``, ``470.82`` -> ``470.82.0``.

    The same result as NVIDIA's driver, which parses it leniently (Masterminds/semver).
    """
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise DeviceModelError(f"driver version {version!r} cannot be read as MAJOR.MINOR.PATCH")
    numbers = [int(p) for p in parts] + [0] * (3 - len(parts))
    return ".".join(str(n) for n in numbers)


def semver_cuda_driver_version(version: int) -> str:
    """NVML's CUDA driver version integer as semver: ``12080`` -> ``12.8.0``."""
    return f"{version // 1000}.{version % 1000 // 10}.0"


def common_attributes(gpu: GpuInfo) -> dict[str, AttributeValue]:
    """The attributes a whole GPU and every MIG device on it share."""
    major, minor = gpu.cuda_compute_capability
    attributes: dict[str, AttributeValue] = {
        "productName": gpu.product_name,
        "brand": gpu.brand,
        "architecture": gpu.architecture,
        "cudaComputeCapability": Version(f"{major}.{minor}.0"),
        "driverVersion": Version(semver_driver_version(gpu.driver_version)),
        "cudaDriverVersion": Version(semver_cuda_driver_version(gpu.cuda_driver_version)),
        PCI_BUS_ID_ATTRIBUTE: gpu.pci_bus_id,
    }
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = gpu.pcie_root
    if gpu.numa_node is not None:
        attributes[NUMA_NODE_ATTRIBUTE] = gpu.numa_node
    if gpu.addressing_mode is not None:
        attributes["addressingMode"] = gpu.addressing_mode
    return attributes


def gpu_device(gpu: GpuInfo) -> Device:
    """``gpu`` whole: ``gpu-<minor>``, its uuid and memory."""
    return Device(
        name=gpu_device_name(gpu.minor),
        attributes={"type": "gpu", "uuid": gpu.uuid, **common_attributes(gpu)},
        capacity={"memory": binary(gpu.memory_bytes)},
    )


def mig_device(gpu: GpuInfo, mig: MigInstance) -> Device:
    """An existing MIG device ``mig`` of ``gpu``: its profile's capacities and memory slices."""
    profile = mig.profile
    return Device(
        name=mig_device_name(
            parent_minor=gpu.minor,
            profile=profile.name,
            profile_id=profile.profile_id,
            placement_start=mig.placement.start,
        ),
        attributes={
            "type": "mig",
            "uuid": mig.uuid,
            "parentUUID": gpu.uuid,
            "profile": profile.name,
            **common_attributes(gpu),
        },
        capacity={
            "multiprocessors": decimal(profile.multiprocessors),
            "copyEngines": decimal(profile.copy_engines),
            "decoders": decimal(profile.decoders),
            "encoders": decimal(profile.encoders),
            "jpegEngines": decimal(profile.jpeg_engines),
            "ofaEngines": decimal(profile.ofa_engines),
            "memory": binary(profile.memory_bytes),
            **{
                memory_slice_capacity(i): decimal(1)
                for i in range(mig.placement.start, mig.placement.start + mig.placement.size)
            },
        },
    )
