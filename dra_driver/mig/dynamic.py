"""Dynamic MIG in the node agent: which MIG devices are the driver's own, pass after pass.

Place in the flow: node/discovery.py runs discovery (at start, then every
``--rediscover-interval``) and asks :class:`ManagedMig` for the devices to publish; it calls
``devices.node_devices`` with the MIG mode and the set of MIG devices the driver created
(``managed_mig``), and logs the GPUs that dynamic mode leaves static because a MIG device on them
was made by someone else.

Which MIG devices count as the driver's own (``managed_mig``):

* every device name recorded in the checkpoint, in either phase (node/ passes them in as
  ``recorded``, from prepare/state: ``recorded_device_names``): prepare records a claim before
  it creates its MIG device and unprepare destroys it before the record goes;
* and, so that the window between dropping a record and the MIG device disappearing does not flip
  a GPU to static and back, a MIG device that counted as the driver's own in the previous pass
  and still exists keeps counting until it is gone.

Published devices of a partitionable GPU do not depend on which of its placements exist (a
placement device has no ``uuid``), so MIG devices appearing and disappearing change nothing that
is published: no slice is written.

What prepare accepts follows the same pass: :meth:`ManagedMig.targets` (node/ hands it to
prepare's state) gives targets.dynamic_targets with the GPUs this pass left static.

Discovery reads none of prepare's files: before the state is opened (the first publication),
node/ has prepare/state's ``recorded_device_names_on_disk`` read them without changing anything.
"""

from __future__ import annotations

import logging

from dra_driver.devices import (
    MigMode,
    NodeDevices,
    gpu_device_name,
    is_partitionable,
    mig_instance_name,
    node_devices,
    unmanaged_mig_devices,
)
from dra_driver.gpus.info import Inventory
from dra_driver.prepare import DeviceTarget, device_targets

log = logging.getLogger(__name__)


class ManagedMig:
    """The devices to publish for each discovery pass under ``--mig-mode``. One per agent; called
    from one thread at a time (start, then the re-discovery loop)."""

    def __init__(self, *, mig_mode: MigMode, driver_name: str, warn: bool = True) -> None:
        self.mig_mode = mig_mode
        self.driver_name = driver_name
        self._warn = warn  # False: the caller reports left_static() itself
        self._kept: frozenset[str] = frozenset()
        self._left_static: dict[str, tuple[str, ...]] = {}

    def node_devices(self, inventory: Inventory, *, recorded: frozenset[str]) -> NodeDevices:
        """``devices.node_devices`` for ``inventory``; ``recorded``: the device names the
        checkpoint records now (ignored in static mode). Logs a warning when the set of GPUs
        left static, or their foreign MIG devices, changed. Raises DeviceModelError as
        ``node_devices`` does."""
        if self.mig_mode == "static":
            return node_devices(inventory, driver_name=self.driver_name)
        existing = {mig_instance_name(g, m) for g in inventory.gpus for m in g.mig_instances}
        managed = recorded | (self._kept & existing)
        published = node_devices(
            inventory, driver_name=self.driver_name, mig_mode="dynamic", managed_mig=managed
        )
        self._kept = frozenset(
            mig_instance_name(g, m)
            for g in inventory.gpus
            if is_partitionable(g, managed_mig=managed)
            for m in g.mig_instances
        )
        left_static = {
            gpu_device_name(g.minor): foreign
            for g in sorted(inventory.gpus, key=lambda g: g.minor)
            if g.mig_enabled and (foreign := unmanaged_mig_devices(g, managed_mig=managed))
        }
        for gpu, foreign in left_static.items():
            if self._warn and self._left_static.get(gpu) != foreign:
                log.warning(
                    "MIG mode is dynamic, but this GPU has MIG devices the driver did not create: "
                    "it keeps offering them as static MIG devices and is not partitionable until "
                    "they are deleted (gpu-dra devices lists what is published)",
                    extra={"gpu": gpu, "mig_devices": list(foreign)},
                )
        self._left_static = left_static
        return published

    def left_static(self) -> dict[str, tuple[str, ...]]:
        """GPU name -> the foreign MIG devices that keep it static, as of the last pass."""
        return dict(self._left_static)

    def targets(self, inventory: Inventory) -> dict[str, DeviceTarget]:
        """The devices prepare accepts of ``inventory`` under ``--mig-mode`` (prepare's
        TargetsOf): in dynamic mode those of targets.dynamic_targets, the GPUs the last pass
        left static (:meth:`left_static`) as static ones."""
        if self.mig_mode == "static":
            return device_targets(inventory)
        from dra_driver.mig.targets import dynamic_targets  # noqa: PLC0415  (dynamic mode only)

        return dynamic_targets(inventory, static_gpus=frozenset(self._left_static))
