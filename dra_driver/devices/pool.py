"""This node's pool: which devices each GPU offers, in a stable order. Pure.

Place in the flow: the node agent hands discovery's ``Inventory`` to :func:`node_devices`, whose
``NodeDevices`` publish/slices.py splits into ResourceSlices. A GPU not in MIG mode is one device
(gpu.py); a GPU in MIG mode offers its existing MIG devices (``static``) or, in ``dynamic`` mode
when this driver created all of them, its partitions (partitionable.py).
"""

from __future__ import annotations

from typing import Literal

from dra_driver.devices.gpu import gpu_device, mig_device
from dra_driver.devices.model import CounterSet, Device, NodeDevices
from dra_driver.devices.partitionable import is_partitionable, partitionable_gpu
from dra_driver.devices.validation import validate_device, validate_driver_name
from dra_driver.errors import DeviceModelError
from dra_driver.gpus.info import Inventory

MigMode = Literal["static", "dynamic"]
MIG_MODES: tuple[MigMode, ...] = ("static", "dynamic")


def node_devices(
    inventory: Inventory,
    *,
    driver_name: str,
    mig_mode: MigMode = "static",
    managed_mig: frozenset[str] = frozenset(),
) -> NodeDevices:
    """The devices (and counter sets) this node publishes for ``inventory``, in a stable order.

    ``static``: a GPU in MIG mode is not published itself; its existing MIG devices are.
    ``dynamic``: a GPU in MIG mode all of whose existing MIG devices are named in
    ``managed_mig`` (the MIG devices this driver created) is published as partitionable (see the
    module docstring); one with any other MIG device keeps the static behaviour
    (:func:`unmanaged_mig_devices` names them). Pure. Every device passes ``validate_device``;
    names are unique, or DeviceModelError is raised.
    """
    validate_driver_name(driver_name)
    if mig_mode not in MIG_MODES:
        raise DeviceModelError(f"MIG mode {mig_mode!r} is not one of {', '.join(MIG_MODES)}")
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    # Partitionable GPUs after the others: the scheduler takes the first device that fits, so a
    # whole-GPU claim gets a GPU not in MIG mode before one that must leave MIG mode for it.
    partitionable: list[Device] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        if mig_mode == "dynamic" and is_partitionable(gpu, managed_mig=managed_mig):
            counter_set, partitions = partitionable_gpu(gpu)
            counter_sets.append(counter_set)
            partitionable.extend(partitions)
        elif gpu.mig_enabled:
            instances = sorted(gpu.mig_instances, key=lambda m: (m.placement.start, m.uuid))
            devices.extend(mig_device(gpu, mig) for mig in instances)
        else:
            devices.append(gpu_device(gpu))
    devices.extend(partitionable)
    seen: set[str] = set()
    for device in devices:
        validate_device(device)
        if device.name in seen:
            raise DeviceModelError(f"device name {device.name!r} would be published twice")
        seen.add(device.name)
    return NodeDevices(devices=tuple(devices), counter_sets=tuple(counter_sets))
