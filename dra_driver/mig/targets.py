"""What prepare accepts under ``--mig-mode=dynamic``: the devices of partitionable GPUs, each
placement of each GPU-instance profile (its :class:`DynamicSlot`) and, where it can leave MIG mode
without a reset, the whole GPU.

Flow position: discovery's Inventory -> :func:`dynamic_targets` here (node/ hands it to prepare's
state as its ``TargetsOf``, through dynamic.ManagedMig.targets) -> the preparer -> the MIG steps,
which tell their devices apart with :func:`is_placement` and :func:`leaves_mig`; instances.py
names a placement's slot again from its device name. Pure: it names devices as devices/
publishes them in dynamic mode.
"""

from __future__ import annotations

from dataclasses import dataclass

from dra_driver.devices import (
    gpu_device_name,
    mig_device_name,
    toggles_mig_mode,
    whole_gpu_offered,
)
from dra_driver.gpus.info import GpuInfo, Inventory, MigPlacement, MigProfile
from dra_driver.prepare.targets import DeviceTarget, gpu_targets


@dataclass(frozen=True)
class DynamicSlot:
    """What a dynamic MIG device stands for: a GPU-instance profile at a placement."""

    profile: MigProfile
    placement: MigPlacement

    @property
    def memory_slices(self) -> frozenset[int]:
        return frozenset(range(self.placement.start, self.placement.start + self.placement.size))


def dynamic_slots(gpu: GpuInfo) -> dict[str, DynamicSlot]:
    """Device name -> slot, for every placement of every GPU-instance profile of ``gpu``."""
    return {
        mig_device_name(
            parent_minor=gpu.minor,
            profile=profile.name,
            profile_id=profile.profile_id,
            placement_start=placement.start,
        ): DynamicSlot(profile, placement)
        for profile in gpu.mig_profiles
        for placement in profile.placements
    }


def dynamic_targets(
    inventory: Inventory, *, static_gpus: frozenset[str] = frozenset()
) -> dict[str, DeviceTarget]:
    """Every device name of this node that a claim may be allocated under dynamic MIG, with
    what it is; the same names as devices.node_devices publishes in dynamic mode.

    A GPU in MIG mode (or one that devices.toggles_mig_mode, whatever its mode) offers every
    placement of every GPU-instance profile (an instance that exists is the device of its name,
    so a re-discovery never adds a second one) and, where devices.whole_gpu_offered says so,
    the whole GPU, which prepare takes out of MIG mode (docs/plugin.md "Dynamic MIG"); all of
    them ``partitioned``. Other GPUs are as in static mode (prepare.gpu_targets), and so are
    ``static_gpus`` (GPU device names): GPUs in MIG mode that stay static because they have MIG
    devices the driver did not create (dynamic.ManagedMig.left_static): their existing MIG
    devices are targets, as published.
    """
    targets: dict[str, DeviceTarget] = {}
    for gpu in inventory.gpus:
        # A Hopper-or-newer GPU not in MIG mode is partitionable too: prepare of a placement
        # turns MIG mode on (ondemand_step.py).
        on_demand = toggles_mig_mode(gpu) and bool(gpu.mig_profiles)
        if (not gpu.mig_enabled and not on_demand) or gpu_device_name(gpu.minor) in static_gpus:
            targets.update(gpu_targets(gpu))
            continue
        existing = {
            mig_device_name(
                parent_minor=gpu.minor,
                profile=mig.profile.name,
                profile_id=mig.profile.profile_id,
                placement_start=mig.placement.start,
            ): mig
            for mig in gpu.mig_instances
        }
        if whole_gpu_offered(gpu):
            name = gpu_device_name(gpu.minor)
            targets[name] = DeviceTarget(name, "gpu", gpu, partitioned=True)
        for name in dynamic_slots(gpu):
            targets[name] = DeviceTarget(name, "mig", gpu, existing.get(name), partitioned=True)
    return targets


def is_placement(target: DeviceTarget) -> bool:
    """Whether ``target`` is a placement of a partitionable GPU: its MIG instance is made when a
    claim is prepared and destroyed when it is unprepared (instance_step.py)."""
    return target.partitioned and target.type == "mig"


def leaves_mig(target: DeviceTarget) -> bool:
    """Whether ``target`` is the whole GPU of a partitionable GPU: prepared out of MIG mode
    (modeswitch_step.py)."""
    return target.partitioned and target.type == "gpu"
