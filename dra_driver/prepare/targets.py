"""The devices a claim may be allocated on this node, as prepare sees them.

Flow position: discovery's Inventory -> :func:`device_targets` here -> the preparer (its
``_TargetSet``: one version of the devices, their device nodes made once) -> planning and the
steps. Pure: it names devices as devices/ publishes them and computes their CDI device nodes.

A dynamic MIG placement (``--mig-mode=dynamic``) is a target whose instance may not exist yet
(:class:`DynamicSlot`: a GPU-instance profile at a placement); mig/ creates it when a claim is
prepared, and the slot is all the core needs to tell such a device from the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from dra_driver.cdi.driverfiles import DeviceNode, DriverFiles
from dra_driver.cdi.spec import ClaimDevice, gpu_nodes, mig_nodes
from dra_driver.devices import (
    gpu_device_name,
    mig_device_name,
    toggles_mig_mode,
    whole_gpu_offered,
)
from dra_driver.gpus.info import GpuInfo, Inventory, MigInstance, MigPlacement, MigProfile


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


@dataclass(frozen=True)
class DeviceTarget:
    """A device of ours that a claim can be allocated: a full GPU, an existing MIG device, or
    (``--mig-mode=dynamic``) a MIG placement, whose instance (``mig``) may not exist yet, or the
    whole GPU of a partitionable GPU (``leaves_mig``: prepared out of MIG mode)."""

    name: str
    type: Literal["gpu", "mig"]
    gpu: GpuInfo
    mig: MigInstance | None = None
    dynamic: DynamicSlot | None = None  # a dynamic MIG device: created on prepare
    leaves_mig: bool = False  # the whole GPU of a GPU in dynamic MIG mode

    @property
    def partitioned(self) -> bool:
        """Whether it is a device of a partitionable GPU (it consumes shared counters): a
        placement or the whole GPU. Such a device is never shared (shares.shareable)."""
        return self.dynamic is not None or self.leaves_mig

    @property
    def uuid(self) -> str:
        """The UUID the device is known by (MPS, share limits): the MIG device's own, else the
        GPU's."""
        return self.gpu.uuid if self.mig is None else self.mig.uuid

    def nodes(self, files: DriverFiles) -> tuple[DeviceNode, ...]:
        if self.mig is None:
            return gpu_nodes(files, minor=self.gpu.minor)
        return mig_nodes(
            files,
            parent_minor=self.gpu.minor,
            gpu_instance_id=self.mig.gpu_instance_id,
            compute_instance_id=self.mig.compute_instance_id,
        )


def device_targets(
    inventory: Inventory,
    mig_mode: Literal["static", "dynamic"] = "static",
    static_gpus: frozenset[str] = frozenset(),
) -> dict[str, DeviceTarget]:
    """Every device name of this node that a claim may be allocated, with what it is.

    Same names as devices.node_devices publishes: full GPUs not in MIG mode, existing MIG
    devices of GPUs in MIG mode; with ``mig_mode`` dynamic, a GPU in MIG mode (or one that
    devices.toggles_mig_mode, whatever its mode) offers instead
    every placement of every GPU-instance profile (an instance that exists
    is the dynamic device of its name, so a re-discovery never adds a second one) and, where
    devices.whole_gpu_offered says so, the whole GPU, which prepare takes out of MIG mode
    (docs/plugin.md "Dynamic MIG"). ``static_gpus`` (GPU device
    names): GPUs in MIG mode that stay static in dynamic mode because they have MIG devices the
    driver did not create (dynamicmig.ManagedMig.left_static): their existing MIG devices are
    targets, as published.
    """
    targets: dict[str, DeviceTarget] = {}
    for gpu in inventory.gpus:
        # A Hopper-or-newer GPU not in MIG mode is partitionable too in dynamic mode: prepare of
        # a placement turns MIG mode on (mig/ondemand_step.py).
        on_demand = mig_mode == "dynamic" and toggles_mig_mode(gpu) and bool(gpu.mig_profiles)
        if not gpu.mig_enabled and not on_demand:
            name = gpu_device_name(gpu.minor)
            targets[name] = DeviceTarget(name, "gpu", gpu)
            continue
        if mig_mode == "dynamic" and gpu_device_name(gpu.minor) not in static_gpus:
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
                targets[name] = DeviceTarget(name, "gpu", gpu, leaves_mig=True)
            for name, slot in dynamic_slots(gpu).items():
                targets[name] = DeviceTarget(name, "mig", gpu, existing.get(name), slot)
            continue
        for mig in gpu.mig_instances:
            name = mig_device_name(
                parent_minor=gpu.minor,
                profile=mig.profile.name,
                profile_id=mig.profile.profile_id,
                placement_start=mig.placement.start,
            )
            targets[name] = DeviceTarget(name, "mig", gpu, mig)
    return targets


@dataclass(frozen=True)
class TargetSet:
    """One version of what prepare accepts: the devices, what a spec says of each (made once:
    the same for every claim that gets it) and the driver files their nodes were made from.
    Never changed once built; Preparer.set_targets replaces it whole.

    ``nodes_checked``: the capability sets whose shared device nodes (the control nodes and the
    driver files' nodes every claim with those capabilities gets, none of them the claim's own)
    a prepare has found or made with this version of the devices; a prepare checks them only
    while its set is not in here, so that per-claim work stays per claim. Reconcile empties it
    on every pass, and a re-discovery builds a new TargetSet, so a node removed since (a driver
    reload) is made again by the next prepare."""

    targets: Mapping[str, DeviceTarget]
    spec_devices: Mapping[str, ClaimDevice]
    files: DriverFiles
    nodes_checked: set[frozenset[str]] = field(default_factory=set, compare=False, hash=False)

    @classmethod
    def build(cls, targets: Mapping[str, DeviceTarget], files: DriverFiles) -> TargetSet:
        return cls(
            targets=MappingProxyType(dict(targets)),
            spec_devices=MappingProxyType(
                {
                    name: ClaimDevice(name=name, nodes=t.nodes(files))
                    for name, t in targets.items()
                    if t.dynamic is None  # its nodes are those of the instance prepare makes
                }
            ),
            files=files,
        )

    def spec_device(self, target: DeviceTarget) -> ClaimDevice:
        """What a spec says of ``target``: the current version's nodes of its name (after a
        swap since the claim was planned, a MIG device re-created under the same name, these
        are the device's nodes now; a name gone by then gets the target's own nodes). A
        dynamic MIG device's nodes are those of the instance its target carries."""
        device = None if target.dynamic else self.spec_devices.get(target.name)
        return device or ClaimDevice(name=target.name, nodes=target.nodes(self.files))
