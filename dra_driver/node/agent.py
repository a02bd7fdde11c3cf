"""The node agent: starts and supervises discovery, publishing, the kubelet plugin and probes.

Flow: discover GPUs (NVML, or simulated GPUs installed as pynvml's library) -> devices ->
Publisher (ResourceSlices) and NodePlugin (prepare state, registration + DRA sockets) -> probes and
Prometheus metrics (``--metrics-port``, off by default), with per-device telemetry sampled every
``--telemetry-interval`` (telemetry/sampler.py; its health and XID series come from the
HealthMonitor).
The HealthMonitor watches the GPUs through NVML and puts taints on unhealthy devices (through
the Publisher) and their health into the kubelet's health stream (through the plugin). Then it
re-discovers periodically: GPUs appearing or disappearing and MIG layout changes (a MIG device
re-created under the same name with other GPU/compute instance ids too) change, together, what
prepare accepts, what the health stream lists, what the health monitor watches and what is
published; a known GPU that stops answering stays published (tainted gpu-lost) rather than
vanishing under its claims. Background tasks retry on
their own; what cannot be retried ends the process with a non-zero code so the DaemonSet
restarts it. Every loop keeps a heartbeat for ``/healthz``; ``/readyz`` also needs the kubelet's
registration, current slices and NVML answering (probes.py). SIGTERM/SIGINT stop everything and
remove the sockets.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING

from dra_driver import devices
from dra_driver.errors import (
    CdiError,
    ConfigError,
    DiscoveryError,
    DraError,
    NoGpusFound,
    PublishError,
)
from dra_driver.gpus import nvml
from dra_driver.gpus.info import Inventory
from dra_driver.health.decisions import HealthPolicy
from dra_driver.health.monitor import HealthMonitor
from dra_driver.heartbeat import Heartbeat
from dra_driver.kube import KubeClient
from dra_driver.mig.dynamic import ManagedMig
from dra_driver.node import cpuaffinity, log, parts
from dra_driver.node.config import Config
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.shutdown import ShutdownDeadline
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.prepare import recorded_device_names_on_disk
from dra_driver.publish.publisher import Publisher
from dra_driver.sharing import shares

if TYPE_CHECKING:
    from dra_driver.sim.nvml import SimulatedNvmlLibrary
    from dra_driver.telemetry.holders import GetPod
    from dra_driver.telemetry.sampler import Telemetry

logger = logging.getLogger("dra_driver.node.agent")

# A discovery pass takes seconds; one running this long is stuck in NVML (a wedged GPU or
# driver), and only a restart gets the agent going again.
REDISCOVERY_STALL_S = 300.0
# A telemetry pass takes milliseconds; NVML queries that hang this long need a restart too.
TELEMETRY_STALL_S = 300.0


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
class _NodeState:
    """What the last applied discovery found, and the devices published for it."""

    inventory: Inventory
    node_devices: devices.NodeDevices


@contextmanager
def _stop_on_signals(stop: threading.Event, deadline: ShutdownDeadline) -> Iterator[None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        logger.info("stopping on signal", extra={"signal": signal.Signals(signum).name})
        deadline.arm()
        stop.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_agent(config: Config, *, stop: threading.Event | None = None) -> int:
    """Run until ``stop`` is set or SIGTERM/SIGINT arrives; return the process exit code."""
    refuse_unenforced_shares(config)
    _limit_malloc_arenas()
    pinned = _pin(config)  # before the agent starts its threads: they inherit it
    log.configure(log_format=config.log_format, level=config.log_level)
    if isinstance(pinned, OSError):
        logger.warning(
            "cannot keep the agent on one CPU (--cpu-affinity one); it runs on all it may use",
            extra={"error": str(pinned)},
        )
    elif pinned is not None:
        logger.info("the agent runs on one CPU (--cpu-affinity one)", extra={"cpu": pinned})
    stop = stop or threading.Event()
    deadline = ShutdownDeadline(config.shutdown_timeout_s)
    with ExitStack() as stack:
        # From the start: a SIGTERM during start-up stops cleanly too (simulated GPUs' files).
        stack.enter_context(_stop_on_signals(stop, deadline))
        discovery = Discovery(config, stack)
        mig = ManagedMig(mig_mode=config.mig_mode, driver_name=config.driver_name)
        inventory, node_devices = first_devices(config, discovery, mig)
        logger.info(
            "discovered GPUs",
            extra={
                "gpus": len(inventory.gpus),
                "devices": len(node_devices.devices),
                "simulated": bool(config.simulate),
            },
        )
        kube = KubeClient.from_config(kubeconfig=config.kubeconfig)
        report_event = parts.node_events(kube, config)
        publisher = Publisher(
            kube,
            driver_name=config.driver_name,
            node_name=config.node_name,
            node_devices=node_devices,
        )
        monitor = HealthMonitor(
            policy=health_policy(config),
            inventory=inventory,
            taints=publisher,
            events=report_event,
            check_interval_s=config.health_check_interval_s,
        )
        endpoint = parts.metrics_endpoint(config, stack)
        plugin = kubelet_plugin(
            config=config,
            inventory=inventory,
            claims=kube,
            deployments=kube,
            targets=mig.targets,
            report_event=report_event,
            metrics=endpoint.driver if endpoint else None,
            health=monitor.states,
        )
        monitor.subscribe(plugin.health_changed)
        readiness = [part.readiness_problems for part in (plugin, publisher, discovery, monitor)]
        if config.claim_status:
            reporter = parts.claim_status_reporter(
                config, kube, lambda: plugin.state.inventory, endpoint.driver if endpoint else None
            )
            plugin.kubelet.claim_observer = reporter
            stack.callback(reporter.stop)  # after plugin.stop (callbacks run last-in first)
        with _stop_on_signals(stop, deadline):
            # Health first: a GPU already unhealthy is tainted in the first slices written.
            monitor.start()
            stack.callback(monitor.stop)
            publisher.start()
            stack.callback(publisher.stop)
            plugin.start()
            stack.callback(plugin.stop)
            telemetry = None
            if endpoint is not None:
                telemetry = _start_telemetry(
                    config, inventory, plugin, discovery, stack, get_pod=kube.get_pod
                )
                telemetry.set_health_providers(
                    states=lambda: {name: h.status for name, h in monitor.states().items()},
                    xid_counts=monitor.xid_counts,
                )
                endpoint.registry.register_formatted(telemetry)
                parts.register_health_metrics(endpoint, config, monitor, readiness)
                endpoint.driver.set_published_devices(len(node_devices.devices))
                endpoint.server.start()
                stack.callback(endpoint.server.stop)  # before plugin.stop: scrapes read its state
            rediscovery = Heartbeat("rediscovery", stall_s=REDISCOVERY_STALL_S)
            sampling = (telemetry.heartbeat,) if telemetry and telemetry.heartbeat else ()
            parts.start_probes(
                config,
                stack,
                plugin=plugin,
                loops=(
                    *publisher.heartbeats,
                    *plugin.heartbeats,
                    rediscovery,
                    monitor.heartbeat,
                    *sampling,
                ),
                readiness=readiness,
            )
            logger.info(
                "serving",
                extra={
                    "registration_socket": str(plugin.paths.registration),
                    "dra_socket": str(plugin.paths.dra),
                    "healthcheck_port": config.healthcheck_port,
                    "metrics_port": config.metrics_port,
                },
            )
            _release_freed_memory()
            state = _NodeState(inventory, node_devices)
            with rediscovery.running():
                while not stop.wait(config.rediscover_interval_s):
                    with rediscovery.busy():
                        applied = _rediscover(
                            discovery,
                            config,
                            state,
                            publisher=publisher,
                            plugin=plugin,
                            monitor=monitor,
                            mig=mig,
                        )
                    if telemetry is not None and applied.inventory is not state.inventory:
                        telemetry.set_inventory(applied.inventory)
                    state = applied
                    if endpoint is not None:
                        endpoint.driver.set_published_devices(len(state.node_devices.devices))
    logger.info("stopped")
    return 0


_M_ARENA_MAX = -8  # glibc's mallopt() parameter (malloc.h)
MALLOC_ARENAS = 2


def first_devices(
    config: Config, discovery: Discovery, mig: ManagedMig
) -> tuple[Inventory, devices.NodeDevices]:
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
    return inventory, published_devices(mig.node_devices(inventory, recorded=recorded), config)


def published_devices(node_devices: devices.NodeDevices, config: Config) -> devices.NodeDevices:
    """The devices this node publishes: discovery's (``ManagedMig.node_devices``), shareable as
    --consumable-shares says."""
    return shares.shareable(node_devices, config.shares_mode)


def refuse_unenforced_shares(config: Config) -> None:
    """Refuse ``--consumable-shares`` other than disabled without MPS (``--mps-image``): each
    share's memory and compute limits are enforced by its device's shared MPS daemon, and an
    agent must not hand out limits nothing enforces (docs/publishing.md "Consumable shares")."""
    if config.shares_mode.enabled and config.mps_image is None:
        raise ConfigError(
            "--consumable-shares (CONSUMABLE_SHARES)",
            f"{config.consumable_shares!r}: sharing a device needs the MPS daemon that enforces "
            "each share's memory and compute limits, and MPS is off (no --mps-image / "
            "MPS_IMAGE; the chart sets it with mps.enabled); use disabled or turn MPS on",
        )


def _pin(config: Config) -> int | OSError | None:
    """``--cpu-affinity one``: every thread on one CPU (cpuaffinity.py). The CPU, the kernel's
    refusal, or None (``all``, or only one CPU to run on)."""
    if config.cpu_affinity != "one":
        return None
    try:
        return cpuaffinity.pin_to_one_cpu()
    except OSError as exc:
        return exc


def _limit_malloc_arenas() -> None:
    """At most ``MALLOC_ARENAS`` glibc malloc arenas (as ``MALLOC_ARENA_MAX=2`` would), set
    before the agent starts its threads.

    glibc gives threads that allocate at the same time arenas of their own, up to 8 per core,
    and each keeps the memory freed in it: the agent's gRPC, claim and writer threads grew its
    RSS by about 1.2 MiB over a prepare benchmark (bench/bench_prepare.py) for no speed
    gain, since the interpreter lock serialises their allocations anyway. Python objects
    themselves come from the interpreter's own allocator, not these arenas. A no-op where the C
    library has no ``mallopt`` (musl) or refuses the setting.
    """
    with suppress(AttributeError, OSError):
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS)


def _start_telemetry(
    config: Config,
    inventory: Inventory,
    plugin: NodePlugin,
    discovery: Discovery,
    stack: ExitStack,
    *,
    get_pod: GetPod,
) -> Telemetry:
    """Per-device telemetry for ``/metrics``, sampling (unless the interval is 0) until the stack
    closes. The claims come from the plugin's checkpoint, the containers of their pods (DCGM
    series) from ``get_pod``; simulated GPUs are busy while a prepared claim holds them."""
    from dra_driver.gpus.readings import NvmlReader  # noqa: PLC0415
    from dra_driver.telemetry.sampler import Telemetry  # noqa: PLC0415

    reader = NvmlReader() if config.telemetry_interval_s else None
    telemetry = Telemetry(
        node_name=config.node_name,
        inventory=inventory,
        read=reader,
        interval_s=config.telemetry_interval_s,
        holders=plugin.device_holders,
        heartbeat=Heartbeat("telemetry", stall_s=TELEMETRY_STALL_S) if reader else None,
        dcgm=config.dcgm_metrics,
        dcgm_host_label=config.dcgm_host_label,
        driver_name=config.driver_name,
        get_pod=get_pod,
    )
    discovery.simulate_workload(lambda uuid: uuid in telemetry.held_uuids())
    if reader is not None:
        stack.callback(reader.close)  # after the loop stopped (callbacks run last-in first)
    telemetry.start()
    stack.callback(telemetry.stop)
    return telemetry


def health_policy(config: Config) -> HealthPolicy:
    """The health decisions the ``--health-*`` flags ask for."""
    return HealthPolicy(
        driver_name=config.driver_name,
        mig_mode=config.mig_mode,
        ignored_xids=config.health_ignored_xids,
        fatal_xids=config.health_fatal_xids,
        taint_effect=config.health_taint_effect,
        fatal_taint_effect=config.health_fatal_taint_effect,
        xid_quiet_period_s=config.health_xid_quiet_period_s,
        min_change_interval_s=config.health_min_change_interval_s,
    )


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


def _release_freed_memory() -> None:
    """Hand memory freed during start-up (imports, discovery) back to the kernel.

    glibc keeps freed heap pages mapped; a node agent that sits idle for days should not. A no-op
    where the C library has no ``malloc_trim`` (musl).
    """
    with suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


def _rediscover(
    discovery: Discovery,
    config: Config,
    current: _NodeState,
    *,
    publisher: Publisher,
    plugin: NodePlugin,
    monitor: HealthMonitor | None = None,
    mig: ManagedMig | None = None,
) -> _NodeState:
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
        fresh = _NodeState(
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


__all__ = ["Discovery", "health_policy", "keep_unanswering_gpus", "run_agent"]
