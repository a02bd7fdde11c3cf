"""Pure: a prepared device -> its ``status.devices`` entry (KEP-4817 AllocatedDeviceStatus).

``data`` says which GPU the device is, in the names the device's attributes use: ``uuid``
(the GPU's, or the MIG device's), ``productName``, ``index`` (the NVML index at the agent's last
discovery: what ``nvidia-smi`` shows; not stable across GPU drains, unlike ``minor``), ``minor``
(``/dev/nvidia<minor>``, the ``gpu-<minor>`` of the device name), ``pciBusID``, and for a MIG
device ``profile``, ``parentUUID`` and ``gpuInstanceID``/``computeInstanceID``. A dynamic MIG
device not yet seen by a discovery has no ``uuid`` yet; the entry says what is known.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dra_driver.devices.names import gpu_device_name, mig_instance_name, parse_mig_device_name
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import GpuInfo, Inventory

READY = "Ready"
REASON = "Prepared"


@dataclass(frozen=True)
class StatusDevice:
    """One prepared device of a claim, as the status entry names it."""

    pool: str
    device: str
    share_id: str | None = None  # a consumable share's ID (DRAConsumableCapacity)


def device_data(inventory: Inventory, device: str) -> dict[str, Any]:
    """What ``device`` (a device name of this node) is; {} when the node does not know it."""
    for gpu in inventory.gpus:
        if gpu_device_name(gpu.minor) == device:
            return _gpu_data(gpu)
        for mig in gpu.mig_instances:
            if mig_instance_name(gpu, mig) == device:
                return {
                    **_gpu_data(gpu),
                    "uuid": mig.uuid,
                    "parentUUID": gpu.uuid,
                    "profile": mig.profile.name,
                    "gpuInstanceID": mig.gpu_instance_id,
                    "computeInstanceID": mig.compute_instance_id,
                }
    try:
        minor, profile_id, _start, _slug = parse_mig_device_name(device)
    except DeviceModelError:
        return {}
    for gpu in inventory.gpus:
        if gpu.minor != minor:
            continue
        data = {**_gpu_data(gpu), "parentUUID": gpu.uuid}
        del data["uuid"]  # the MIG device's own UUID exists once it is created and discovered
        for profile in gpu.mig_profiles:
            if profile.profile_id == profile_id:
                data["profile"] = profile.name
        return data
    return {}


def _gpu_data(gpu: GpuInfo) -> dict[str, Any]:
    return {
        "uuid": gpu.uuid,
        "productName": gpu.product_name,
        "index": gpu.index,
        "minor": gpu.minor,
        "pciBusID": gpu.pci_bus_id,
    }


def status_entries(
    *,
    driver: str,
    devices: Sequence[StatusDevice],
    inventory: Inventory,
    now: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """The ``status.devices`` entries of a claim's prepared ``devices`` (``now``: RFC 3339)."""
    entries = []
    for d in devices:
        condition: dict[str, Any] = {
            "type": READY,
            "status": "True",
            "reason": REASON,
            "message": "prepared on the node by the DRA driver; its CDI devices are ready",
            "lastTransitionTime": now,
        }
        if generation is not None:
            condition["observedGeneration"] = generation
        entry: dict[str, Any] = {
            "driver": driver,
            "pool": d.pool,
            "device": d.device,
            "conditions": [condition],
        }
        if d.share_id:
            entry["shareID"] = d.share_id
        data = device_data(inventory, d.device)
        if data:
            entry["data"] = data
        entries.append(entry)
    return entries
