"""The node agent: builds every part, starts them in order and supervises them until stopped.

Flow: discover GPUs (discovery.py: NVML, or simulated GPUs installed as pynvml's library) ->
devices -> Publisher (ResourceSlices) and NodePlugin (prepare state, registration + DRA sockets)
-> probes and Prometheus metrics (``--metrics-port``, off by default), with per-device telemetry
sampled every ``--telemetry-interval`` (telemetry/sampler.py; its health and XID series come
from the HealthMonitor). The HealthMonitor watches the GPUs through NVML and puts taints on
unhealthy devices (through the Publisher) and their health into the kubelet's health stream
(through the plugin). Then the agent re-discovers every ``--rediscover-interval``
(discovery.rediscover: a change reaches prepare, the health stream, the monitor and the slices
together). :func:`run_agent` is the wiring list: each part is built by a function of its own
(here, in parts.py for those beside the flow, in wiring.py for prepare's steps and the plugin).

Background tasks retry on their own; what cannot be retried ends the process with a non-zero
code so the DaemonSet restarts it. Every loop keeps a heartbeat for ``/healthz``; ``/readyz``
also needs the kubelet's registration, current slices and NVML answering (probes.py).
SIGTERM/SIGINT stop everything and remove the sockets.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Protocol

from dra_driver.claimstatus.reporter import ClaimStatusReporter
from dra_driver.errors import ConfigError
from dra_driver.gpus.info import Inventory
from dra_driver.health.decisions import HealthPolicy
from dra_driver.health.monitor import HealthMonitor
from dra_driver.heartbeat import Heartbeat
from dra_driver.kube import KubeClient
from dra_driver.kube.events import EventReporter
from dra_driver.mig.dynamic import ManagedMig
from dra_driver.node import cpuaffinity, log, parts
from dra_driver.node.config import Config
from dra_driver.node.discovery import (
    Discovery,
    NodeGpus,
    first_devices,
    rediscover,
)
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.shutdown import ShutdownDeadline
from dra_driver.node.wiring import kubelet_plugin
from dra_driver.publish.publisher import Publisher

if TYPE_CHECKING:
    from dra_driver.telemetry.holders import GetPod
    from dra_driver.telemetry.sampler import Telemetry

logger = logging.getLogger("dra_driver.node.agent")

# A discovery pass takes seconds; one running this long is stuck in NVML (a wedged GPU or
# driver), and only a restart gets the agent going again.
REDISCOVERY_STALL_S = 300.0
# A telemetry pass takes milliseconds; NVML queries that hang this long need a restart too.
TELEMETRY_STALL_S = 300.0


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
    """Run until ``stop`` is set or SIGTERM/SIGINT arrives; return the process exit code.

    The wiring list: each part is built by a function of its own, started in order (health
    first: a GPU already unhealthy is tainted in the first slices written) and stopped in
    reverse by the ExitStack."""
    _set_up_process(config)
    stop = stop or threading.Event()
    deadline = ShutdownDeadline(config.shutdown_timeout_s)
    with ExitStack() as stack:
        # From the start: a SIGTERM during start-up stops cleanly too (simulated GPUs' files).
        stack.enter_context(_stop_on_signals(stop, deadline))
        discovery = Discovery(config, stack)
        mig = ManagedMig(mig_mode=config.mig_mode, driver_name=config.driver_name)
        first = _first_gpus(config, discovery, mig)
        kube = KubeClient.from_config(kubeconfig=config.kubeconfig)
        report_event = parts.node_events(kube, config)
        publisher = parts.publisher(kube, config, first.node_devices)
        monitor = _health_monitor(config, first.inventory, publisher, report_event)
        endpoint = parts.metrics_endpoint(config, stack)
        plugin = kubelet_plugin(
            config=config,
            inventory=first.inventory,
            claims=kube,
            deployments=kube,
            targets=mig.targets,
            report_event=report_event,
            metrics=endpoint.driver if endpoint else None,
            health=monitor.states,
        )
        monitor.subscribe(plugin.health_changed)
        readiness = [part.readiness_problems for part in (plugin, publisher, discovery, monitor)]
        reporter = _claim_status_reporter(config, stack, kube, plugin, endpoint)
        with _stop_on_signals(stop, deadline):
            _start_in_order(stack, monitor, publisher, plugin)
            _start_reporter(reporter, plugin)
            served = _serve_metrics(
                config, stack, endpoint, first=first, plugin=plugin, discovery=discovery,
                monitor=monitor, readiness=readiness, get_pod=kube.get_pod,
            )  # fmt: skip
            rediscovery = Heartbeat("rediscovery", stall_s=REDISCOVERY_STALL_S)
            loops = (*publisher.heartbeats, *plugin.heartbeats, rediscovery, monitor.heartbeat)
            parts.start_probes(
                config, stack, plugin=plugin, loops=(*loops, *served.heartbeats),
                readiness=readiness,
            )  # fmt: skip
            _log_serving(config, plugin)
            _release_freed_memory()
            again = partial(
                rediscover, discovery, config,
                publisher=publisher, plugin=plugin, monitor=monitor, mig=mig,
            )  # fmt: skip
            _rediscover_until(stop, config, first, again=again, heartbeat=rediscovery,
                              changed=served.gpus_changed)  # fmt: skip
    logger.info("stopped")
    return 0


def _set_up_process(config: Config) -> None:
    """What the process needs before any part exists: the configuration's last check, the
    malloc arenas and the CPU pin (before the agent starts its threads: they inherit both),
    the log format."""
    refuse_unenforced_shares(config)
    _limit_malloc_arenas()
    pinned = _pin(config)
    log.configure(log_format=config.log_format, level=config.log_level)
    if isinstance(pinned, OSError):
        logger.warning(
            "cannot keep the agent on one CPU (--cpu-affinity one); it runs on all it may use",
            extra={"error": str(pinned)},
        )
    elif pinned is not None:
        logger.info("the agent runs on one CPU (--cpu-affinity one)", extra={"cpu": pinned})


def _first_gpus(config: Config, discovery: Discovery, mig: ManagedMig) -> NodeGpus:
    """The first publication's GPUs and devices (discovery.first_devices), logged."""
    first = first_devices(config, discovery, mig)
    logger.info(
        "discovered GPUs",
        extra={
            "gpus": len(first.inventory.gpus),
            "devices": len(first.node_devices.devices),
            "simulated": bool(config.simulate),
        },
    )
    return first


def _health_monitor(
    config: Config, inventory: Inventory, publisher: Publisher, report_event: EventReporter
) -> HealthMonitor:
    """The health monitor the ``--health-*`` flags ask for: its taints go on the published
    devices, its Events on the Node."""
    return HealthMonitor(
        policy=health_policy(config),
        inventory=inventory,
        taints=publisher,
        events=report_event,
        check_interval_s=config.health_check_interval_s,
    )


def _claim_status_reporter(
    config: Config,
    stack: ExitStack,
    kube: KubeClient,
    plugin: NodePlugin,
    endpoint: parts.MetricsEndpoint | None,
) -> ClaimStatusReporter | None:
    """With ``--claim-status``: the reporter of prepared claims' devices (not started yet),
    observing the plugin's claims from its first call, stopped after the plugin (callbacks run
    last-in first)."""
    if not config.claim_status:
        return None
    reporter = parts.claim_status_reporter(
        config, kube, lambda: plugin.state.inventory, endpoint.driver if endpoint else None
    )
    plugin.kubelet.claim_observer = reporter
    stack.callback(reporter.stop)
    return reporter


def _start_reporter(reporter: ClaimStatusReporter | None, plugin: NodePlugin) -> None:
    """Start the claim status writer once prepare's state is open: the claims recorded then
    were prepared by an earlier agent, which may have written their entries."""
    if reporter is not None:
        reporter.start(written_before=plugin.prepared_claim_uids())


class _Started(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def _start_in_order(stack: ExitStack, *started: _Started) -> None:
    """Start each part in the order given; ``stack`` stops them in reverse."""
    for part in started:
        part.start()
        stack.callback(part.stop)


@dataclass(frozen=True)
class _Metrics:
    """``/metrics`` as served: the endpoint and the telemetry sampled for it; both None without
    ``--metrics-port``."""

    endpoint: parts.MetricsEndpoint | None = None
    telemetry: Telemetry | None = None

    @property
    def heartbeats(self) -> tuple[Heartbeat, ...]:
        """The sampling loop's heartbeat, for ``/healthz`` (none when it does not sample)."""
        telemetry = self.telemetry
        return (telemetry.heartbeat,) if telemetry and telemetry.heartbeat else ()

    def gpus_changed(self, gpus: NodeGpus) -> None:
        """A re-discovery applied ``gpus``: telemetry samples them, the published count follows."""
        if self.telemetry is not None:
            self.telemetry.set_inventory(gpus.inventory)
        if self.endpoint is not None:
            self.endpoint.driver.set_published_devices(len(gpus.node_devices.devices))


def _serve_metrics(
    config: Config,
    stack: ExitStack,
    endpoint: parts.MetricsEndpoint | None,
    *,
    first: NodeGpus,
    plugin: NodePlugin,
    discovery: Discovery,
    monitor: HealthMonitor,
    readiness: Sequence[Callable[[], list[str]]],
    get_pod: GetPod,
) -> _Metrics:
    """With ``--metrics-port``: telemetry sampling, the health series and the driver's metrics,
    then the endpoint serving them (stopped before the plugin: scrapes read its state)."""
    if endpoint is None:
        return _Metrics()
    telemetry = _start_telemetry(config, first.inventory, plugin, discovery, stack, get_pod=get_pod)
    telemetry.set_health_providers(
        states=lambda: {name: h.status for name, h in monitor.states().items()},
        xid_counts=monitor.xid_counts,
    )
    endpoint.registry.register_formatted(telemetry)
    parts.register_health_metrics(endpoint, config, monitor, readiness)
    endpoint.driver.set_published_devices(len(first.node_devices.devices))
    endpoint.server.start()
    stack.callback(endpoint.server.stop)
    return _Metrics(endpoint, telemetry)


def _log_serving(config: Config, plugin: NodePlugin) -> None:
    logger.info(
        "serving",
        extra={
            "registration_socket": str(plugin.paths.registration),
            "dra_socket": str(plugin.paths.dra),
            "healthcheck_port": config.healthcheck_port,
            "metrics_port": config.metrics_port,
        },
    )


def _rediscover_until(
    stop: threading.Event,
    config: Config,
    first: NodeGpus,
    *,
    again: Callable[[NodeGpus], NodeGpus],
    heartbeat: Heartbeat,
    changed: Callable[[NodeGpus], None],
) -> None:
    """Every ``--rediscover-interval`` until ``stop``: ``again`` (discovery.rediscover with the
    agent's parts) from the GPUs applied so far; ``changed`` with what a pass applied, when it
    applied anything."""
    applied = first
    with heartbeat.running():
        while not stop.wait(config.rediscover_interval_s):
            with heartbeat.busy():
                fresh = again(applied)
            if fresh is not applied:
                changed(fresh)
            applied = fresh


_M_ARENA_MAX = -8  # glibc's mallopt() parameter (malloc.h)
MALLOC_ARENAS = 2


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


def _release_freed_memory() -> None:
    """Hand memory freed during start-up (imports, discovery) back to the kernel.

    glibc keeps freed heap pages mapped; a node agent that sits idle for days should not. A no-op
    where the C library has no ``malloc_trim`` (musl).
    """
    with suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)


__all__ = ["health_policy", "refuse_unenforced_shares", "run_agent"]
