"""GPU and MIG facts -> DRA devices: names, attributes, capacities, counters. Pure.

Input: ``gpus.info.GpuInfo`` values from discovery (NVML or simulated). Output: ``NodeDevices``,
the devices and shared counter sets of this node's pool, already within the API's validation
rules (nvidia-compat.md "Attributes", spec D.1). Nothing here does I/O.

MIG modes (``--mig-mode``): in ``static`` mode a GPU in MIG mode offers the MIG devices that
exist. In ``dynamic`` mode (partitionable devices, KEP-4815; nvidia-compat.md "Dynamic MIG") a GPU
in MIG mode whose existing MIG devices were all created by this driver offers one counter set
``gpu-<minor>-counter-set`` (its largest profile's capacities as counters plus one
``memory-slice-<i>`` counter per memory slice) and one device per GPU-instance profile and
placement (consuming the profile's capacities and the memory slices the placement covers), and
on GPUs that change MIG mode without a reset (Hopper and newer) the whole GPU ``gpu-<minor>``,
consuming every counter: preparing it takes the GPU out of MIG mode (docs/plugin.md "Dynamic
MIG"). A GPU with a MIG device the driver did not create keeps the static behaviour.

- ``model``: the values (Device, NodeDevices, taints, counters); ``names``: device names;
- ``gpu``: whole GPUs and static MIG devices; ``partitionable``: dynamic MIG;
- ``pool``: :func:`node_devices`, the node's pool from them; ``validation``: the API's rules;
- ``classes``: the chart's DeviceClasses; ``table``: the pool as a table (``gpu-dra devices``).

This package re-exports the names the rest of the driver imports.
"""

from __future__ import annotations

from dra_driver.devices.gpu import (
    NUMA_NODE_ATTRIBUTE,
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    STANDARD_DOMAIN,
    semver_cuda_driver_version,
    semver_driver_version,
)
from dra_driver.devices.model import (
    AttributeValue,
    CounterConsumption,
    CounterSet,
    Device,
    NodeDevices,
    RequestPolicy,
    Taint,
    TaintEffect,
    Version,
    with_taints,
)
from dra_driver.devices.names import (
    COUNTER_SET_SUFFIX,
    counter_set_name,
    gpu_device_name,
    memory_slice_capacity,
    memory_slice_counter,
    mig_device_name,
    mig_instance_name,
    mig_profile_slug,
    parse_mig_device_name,
)
from dra_driver.devices.partitionable import (
    MIG_TOGGLE_ARCHITECTURES,
    is_partitionable,
    partitionable_gpu,
    toggles_mig_mode,
    unmanaged_mig_devices,
    whole_gpu_offered,
)
from dra_driver.devices.pool import (
    MIG_MODES,
    MigMode,
    node_devices,
)
from dra_driver.devices.validation import (
    UNSTABLE_ATTRIBUTES,
    request_policy_problem,
    validate_device,
)
from dra_driver.resourceapi import MAX_ATTRIBUTES_AND_CAPACITIES

__all__ = [
    "COUNTER_SET_SUFFIX",
    "MAX_ATTRIBUTES_AND_CAPACITIES",
    "MIG_MODES",
    "MIG_TOGGLE_ARCHITECTURES",
    "NUMA_NODE_ATTRIBUTE",
    "PCIE_ROOT_ATTRIBUTE",
    "PCI_BUS_ID_ATTRIBUTE",
    "STANDARD_DOMAIN",
    "UNSTABLE_ATTRIBUTES",
    "AttributeValue",
    "CounterConsumption",
    "CounterSet",
    "Device",
    "MigMode",
    "NodeDevices",
    "RequestPolicy",
    "Taint",
    "TaintEffect",
    "Version",
    "counter_set_name",
    "gpu_device_name",
    "is_partitionable",
    "memory_slice_capacity",
    "memory_slice_counter",
    "mig_device_name",
    "mig_instance_name",
    "mig_profile_slug",
    "node_devices",
    "parse_mig_device_name",
    "partitionable_gpu",
    "request_policy_problem",
    "semver_cuda_driver_version",
    "semver_driver_version",
    "toggles_mig_mode",
    "unmanaged_mig_devices",
    "validate_device",
    "whole_gpu_offered",
    "with_taints",
]
