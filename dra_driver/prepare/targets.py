"""The devices a claim may be allocated on this node, as prepare sees them.

Flow position: discovery's Inventory -> the node's :data:`TargetsOf` (:func:`device_targets`
here; under ``--mig-mode=dynamic`` mig/targets.py's, which node/ chooses) -> the preparer (its
:class:`TargetSet`: one version of the devices, their device nodes made once) -> planning and the
steps. Pure: it names devices as devices/ publishes them and computes their CDI device nodes.

A device of a partitionable GPU (``DeviceTarget.partitioned``) is one a step changes when a claim
is prepared (mig/: a MIG instance made at a placement, or the GPU taken out of MIG mode); the
core only knows that its device nodes are those of the target the claim's plan carries then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from dra_driver.cdi.driverfiles import DeviceNode, DriverFiles
from dra_driver.cdi.spec import ClaimDevice, gpu_nodes, mig_nodes
from dra_driver.devices import gpu_device_name, mig_device_name
from dra_driver.gpus.info import GpuInfo, Inventory, MigInstance


@dataclass(frozen=True)
class DeviceTarget:
    """A device of ours that a claim can be allocated: a full GPU or a MIG device (``mig``: the
    MIG instance, None while it does not exist yet).

    ``partitioned``: a device of a partitionable GPU (it consumes the GPU's shared counters,
    KEP-4815), which a step changes when a claim is prepared (mig/targets.py: a placement,
    whose instance is made then, or the whole GPU, taken out of MIG mode). Such a device is
    never shared (shares.shareable), and its nodes are never cached (:class:`TargetSet`)."""

    name: str
    type: Literal["gpu", "mig"]
    gpu: GpuInfo
    mig: MigInstance | None = None
    partitioned: bool = False

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


TargetsOf = Callable[[Inventory], Mapping[str, DeviceTarget]]
"""The devices a claim may be allocated on a node with this inventory: :func:`device_targets`,
or what ``--mig-mode=dynamic`` makes of it (mig/targets.py); node/ chooses."""


def gpu_targets(gpu: GpuInfo) -> dict[str, DeviceTarget]:
    """The devices of ``gpu`` as published without dynamic MIG: the full GPU when it is not in
    MIG mode, else its existing MIG devices."""
    if not gpu.mig_enabled:
        name = gpu_device_name(gpu.minor)
        return {name: DeviceTarget(name, "gpu", gpu)}
    targets = {}
    for mig in gpu.mig_instances:
        name = mig_device_name(
            parent_minor=gpu.minor,
            profile=mig.profile.name,
            profile_id=mig.profile.profile_id,
            placement_start=mig.placement.start,
        )
        targets[name] = DeviceTarget(name, "mig", gpu, mig)
    return targets


def device_targets(inventory: Inventory) -> dict[str, DeviceTarget]:
    """Every device name of this node that a claim may be allocated, with what it is: the same
    names as devices.node_devices publishes in static MIG mode (full GPUs not in MIG mode, the
    existing MIG devices of GPUs in MIG mode)."""
    targets: dict[str, DeviceTarget] = {}
    for gpu in inventory.gpus:
        targets.update(gpu_targets(gpu))
    return targets


@dataclass(frozen=True)
class TargetSet:
    """One version of what prepare accepts: the devices, what a spec says of each (made once:
    the same for every claim that gets it) and the driver files their nodes were made from.
    Never changed once built; Preparer.set_targets replaces it whole.

    ``nodes_checked``: the capability sets whose shared device nodes (the control nodes and the
    driver files' nodes every claim with those capabilities gets, none of them the claim's own)
    a prepare has found or made with this version of the devices; ``own_nodes_checked``: the
    devices' own nodes (container paths) found or made. A prepare checks only what is not in
    these, so that a prepare does no work that does not depend on its claim (a stat per node
    on every prepare was most of the device-node checks' cost). The devices' own nodes that
    exist are looked up ahead, off the prepare path (``Preparer.check_nodes``: when the
    Preparer takes a new version, and on every reconcile pass), so only a missing one costs a
    prepare anything (it is made then). Reconcile empties both on every pass
    (:meth:`recheck_nodes`), and a re-discovery builds a new TargetSet, so a node removed since
    (a driver reload) is made again by the next prepare."""

    targets: Mapping[str, DeviceTarget]
    spec_devices: Mapping[str, ClaimDevice]
    files: DriverFiles
    nodes_checked: set[frozenset[str]] = field(default_factory=set, compare=False, hash=False)
    own_nodes_checked: set[str] = field(default_factory=set, compare=False, hash=False)

    def recheck_nodes(self) -> None:
        """Have the next prepares check (and make) their device nodes again."""
        self.nodes_checked.clear()
        self.own_nodes_checked.clear()

    def own_node_paths(self) -> list[str]:
        """Every device's own nodes (container paths), each once."""
        return sorted({node.path for d in self.spec_devices.values() for node in d.nodes})

    @classmethod
    def build(cls, targets: Mapping[str, DeviceTarget], files: DriverFiles) -> TargetSet:
        return cls(
            targets=MappingProxyType(dict(targets)),
            spec_devices=MappingProxyType(
                {
                    name: ClaimDevice(name=name, nodes=t.nodes(files))
                    for name, t in targets.items()
                    if not t.partitioned  # its nodes: those of the instance a step makes
                }
            ),
            files=files,
        )

    def spec_device(self, target: DeviceTarget) -> ClaimDevice:
        """What a spec says of ``target``: the current version's nodes of its name (after a
        swap since the claim was planned, a MIG device re-created under the same name, these
        are the device's nodes now; a name gone by then gets the target's own nodes). A
        partitioned device's nodes are those of the instance its target carries."""
        device = None if target.partitioned else self.spec_devices.get(target.name)
        return device or ClaimDevice(name=target.name, nodes=target.nodes(self.files))
