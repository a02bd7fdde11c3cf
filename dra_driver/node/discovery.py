"""The node's GPUs over time: discovery at start, the devices published for it, and each
re-discovery applied to prepare, the health monitor and the slices.

Flow position: the first part of the node flow, run by node/agent.py. :class:`Discovery` asks
NVML (or the simulated GPUs installed as pynvml's library) for the inventory;
:func:`first_devices` turns it into the devices to publish (``--mig-mode`` through
mig.dynamic.ManagedMig, with the MIG devices prepare's state records; ``--consumable-shares``
through sharing.shares): the pipeline the agent publishes and ``gpu-dra devices`` prints.
:func:`rediscover` runs it again every ``--rediscover-interval`` and applies a change to the
plugin (what prepare accepts, the health stream), the health monitor and the Publisher, in that
order, or to none of them. Discovery itself reads none of prepare's files: the names prepare's
state records come from prepare's face (``recorded_device_names_on_disk`` before the state is
opened, the plugin's state after).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from dra_driver import devices
from dra_driver.errors import CdiError, DiscoveryError, DraError, NoGpusFound, PublishError
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.mig.dynamic import ManagedMig
from dra_driver.node.config import Config
from dra_driver.prepare import recorded_device_names_on_disk
from dra_driver.sharing import shares

if TYPE_CHECKING:
    from dra_driver.health.monitor import HealthMonitor
    from dra_driver.node.nodeplugin import NodePlugin
    from dra_driver.publish.publisher import Publisher
    from dra_driver.sim.nvml import SimulatedNvmlLibrary

logger = logging.getLogger(__name__)


class Discovery:
    """One way to ask the node for its GPUs, repeatable: real NVML or a simulated node."""

    def __init__(self, config: Config, stack: ExitStack) -> None:
        self._driver_root = config.driver_root_in_container
        self._sysfs_root = nvml.DEFAULT_SYSFS_ROOT
        self._discover: Callable[[], Inventory] = self._nvml_inventory
        if config.mig_mode == "dynamic":
            # GPUs taken out of MIG mode for a whole-GPU claim are shown as the partitionable
            # GPUs they were (mig/modeswitch.py: loaded in this mode only, as node/wiring.py
            # loads dynamic MIG's steps).
            from dra_driver.mig import modeswitch  # noqa: PLC0415

            marks = modeswitch.MigOffMarks(
                config.checkpoint_path.parent / modeswitch.MARKS_DIRECTORY
            )
            self._discover = partial(modeswitch.discover_with_marks, self._nvml_inventory, marks)
        self._simulated: SimulatedNvmlLibrary | None = None
        if config.simulate:
            from dra_driver.sim.nvml import simulated_nvml  # noqa: PLC0415

            node = stack.enter_context(
                simulated_nvml(
                    config.simulate,
                    node_name=config.node_name,
                    inbox=config.simulated_faults_path,
                    # where a simulated driver root's stand-in nvidia-smi keeps compute modes
                    compute_modes=config.driver_root_in_container
                    / "usr/bin/nvidia-smi.compute-mode.json",
                    # the node's MIG instances outlive the agent, as real ones do
                    state_path=config.simulated_mig_state_path,
                )
            )
            self._sysfs_root = node.sysfs_root
            self._simulated = node.library
        self.last_error: str | None = None  # why the last pass failed; None after a success

    def simulate_workload(self, busy: Callable[[str], bool]) -> None:
        """With simulated GPUs: which device UUIDs run work (their telemetry reads higher).
        Nothing on real GPUs."""
        if self._simulated is not None:
            self._simulated.workload = busy

    def discover(self) -> Inventory:
        """Run discovery once. NoGpusFound yields an empty inventory (an empty pool is published,
        telling the scheduler the driver runs but has nothing to offer). Other DiscoveryErrors
        are raised, and remembered for readiness until a pass succeeds. In dynamic MIG mode a
        GPU this driver took out of MIG mode is shown as it was (modeswitch.overlay; its mark read
        before and after NVML, so a mark made or removed during the pass is not missed)."""
        try:
            inventory = self._discover()
        except NoGpusFound as exc:
            self.last_error = None  # NVML answered: there are no GPUs
            logger.warning("no GPUs found; publishing an empty pool", extra={"reason": str(exc)})
            return Inventory(gpus=())
        except DiscoveryError as exc:
            self.last_error = str(exc)
            raise
        self.last_error = None
        for failure in inventory.failures:
            logger.error(
                "a GPU failed its NVML queries; a new one is not published, a known one stays "
                "(tainted by the health monitor)",
                extra={"gpu_index": failure.index, "reason": failure.error},
            )
        return inventory

    def _nvml_inventory(self) -> Inventory:
        return nvml.discover(driver_root=self._driver_root, sysfs_root=self._sysfs_root)

    def readiness_problems(self) -> list[str]:
        """Empty when the last discovery pass succeeded (for ``/readyz``). A GPU that alone
        failed its queries does not count: NVML answers, and that GPU is logged and left out."""
        error = self.last_error
        return [] if error is None else [f"NVML: the last discovery failed: {error}"]


@dataclass(frozen=True)
class NodeGpus:
    """What the last applied discovery found, and the devices published for it."""

    inventory: Inventory
    node_devices: devices.NodeDevices


def first_devices(config: Config, discovery: Discovery, mig: ManagedMig) -> NodeGpus:
    """The first publication's pipeline, the agent's and ``gpu-dra devices``'s alike: discovery
    -> the devices ``--mig-mode`` makes of it (dynamic: the MIG devices prepare's state records
    count as the driver's own, read without opening it) -> shareable as
    ``--consumable-shares`` says. Raises DiscoveryError as Discovery.discover does."""
    inventory = discovery.discover()
    recorded = (
        recorded_device_names_on_disk(config.checkpoint_path)
        if config.mig_mode == "dynamic"
        else frozenset()
    )
    return NodeGpus(
        inventory, published_devices(mig.node_devices(inventory, recorded=recorded), config)
    )


def published_devices(node_devices: devices.NodeDevices, config: Config) -> devices.NodeDevices:
    """The devices this node publishes: discovery's (``ManagedMig.node_devices``), shareable as
    --consumable-shares says."""
    return shares.shareable(node_devices, config.shares_mode)


def keep_unanswering_gpus(current: Inventory, fresh: Inventory) -> Inventory:
    """``fresh`` plus the GPUs of ``current`` that NVML still lists but that failed their queries
    in ``fresh`` (a lost GPU: same NVML index, and its UUID not seen elsewhere).

    Such a GPU stays published with its last known facts: the health monitor taints it
    (gpu-lost), the claims holding it keep a device to point at, and it is known again as soon
    as it answers. A GPU NVML no longer lists at all is gone.
    """
    failed = {f.index for f in fresh.failures}
    seen = {g.uuid for g in fresh.gpus}
    kept = tuple(g for g in current.gpus if g.index in failed and g.uuid not in seen)
    if not kept:
        return fresh
    return Inventory(
        gpus=tuple(sorted((*fresh.gpus, *kept), key=lambda g: g.index)),
        failures=tuple(f for f in fresh.failures if f.index not in {g.index for g in kept}),
    )


def rediscover(
    discovery: Discovery,
    config: Config,
    current: NodeGpus,
    *,
    publisher: Publisher,
    plugin: NodePlugin,
    monitor: HealthMonitor | None = None,
    mig: ManagedMig | None = None,
) -> NodeGpus:
    """Re-run discovery; when anything about the GPUs changed, apply it everywhere.

    The whole inventory is compared, not only the published devices: a MIG device re-created
    under the same name has other GPU/compute instance ids, so other device nodes. The plugin
    (what prepare accepts, the health stream) changes first, so a new device is accepted before
    the scheduler can see it; then the publisher. If the publisher refuses the new pool (a bug
    in the device model) the plugin goes back to the current inventory, so both keep agreeing.
    Every failure keeps the current state, and the next pass tries again. A known GPU that
    fails its queries (lost) is kept (:func:`keep_unanswering_gpus`). The health monitor then
    watches the new GPUs. ``mig`` (the agent's, kept across passes) applies ``--mig-mode``.
    """
    mig = mig or ManagedMig(mig_mode=config.mig_mode, driver_name=config.driver_name)
    try:
        inventory = keep_unanswering_gpus(current.inventory, discovery.discover())
        recorded = plugin.recorded_device_names() if mig.mig_mode == "dynamic" else frozenset()
        fresh = NodeGpus(
            inventory, published_devices(mig.node_devices(inventory, recorded=recorded), config)
        )
    except (DiscoveryError, DraError) as exc:
        logger.error(
            "re-discovery failed; keeping the published devices", extra={"reason": str(exc)}
        )
        return current
    if fresh.inventory == current.inventory:
        return current
    logger.info(
        "GPUs changed; updating prepare, the health stream and the slices",
        extra={
            "before": len(current.node_devices.devices),
            "after": len(fresh.node_devices.devices),
        },
    )
    try:
        plugin.set_inventory(fresh.inventory)
    except CdiError as exc:
        logger.error(
            "cannot apply the re-discovered GPUs; keeping the current ones",
            extra={"reason": str(exc)},
        )
        return current
    if monitor is not None:
        monitor.set_inventory(fresh.inventory)
    if fresh.node_devices == current.node_devices:
        return fresh
    try:
        publisher.set_devices(fresh.node_devices)
    except PublishError as exc:
        logger.error(
            "the re-discovered devices cannot be published; keeping the current ones",
            extra={"reason": str(exc)},
        )
        if monitor is not None:
            monitor.set_inventory(current.inventory)
        try:
            plugin.set_inventory(current.inventory)
        except CdiError as undo:
            logger.error(
                "cannot go back to the current GPUs in prepare", extra={"reason": str(undo)}
            )
        return current
    return fresh


__all__ = [
    "Discovery",
    "NodeGpus",
    "first_devices",
    "keep_unanswering_gpus",
    "published_devices",
    "rediscover",
]
