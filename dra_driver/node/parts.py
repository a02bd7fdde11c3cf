"""How each of the agent's parts beside the node flow is built from its Config: Events on the
Node, the Prometheus endpoint with the driver's metrics, the health series, the probes.

Flow position: node/agent.py's ``run_agent`` is the wiring list; it calls these to build each
part, starts them in order and stops them in reverse (its ExitStack). Nothing here starts a
part the caller did not ask for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dra_driver.claimstatus.reporter import ClaimStatusReporter
from dra_driver.devices import NodeDevices
from dra_driver.errors import KubeError
from dra_driver.heartbeat import Heartbeat, heartbeat_problems
from dra_driver.kube import EventType, KubeClient
from dra_driver.kube.events import EventReporter
from dra_driver.node.config import Config
from dra_driver.node.http_server import HttpServer, metrics_server
from dra_driver.node.nodeplugin import NodePlugin
from dra_driver.node.probes import ProbeServer, SocketChecker
from dra_driver.prepare import ERROR_TYPES
from dra_driver.publish.publisher import Publisher

if TYPE_CHECKING:
    from dra_driver import metrics
    from dra_driver.gpus.info import Inventory
    from dra_driver.health.monitor import HealthMonitor

logger = logging.getLogger("dra_driver.node.agent")


def node_events(kube: KubeClient, config: Config) -> EventReporter:
    """Post an Event on our Node (in ``--pod-namespace``); a failure is logged, never raised."""

    def report_event(reason: str, message: str, *, event_type: EventType = "Warning") -> None:
        try:
            node = kube.get_node(config.node_name)
            kube.create_event(
                node_name=config.node_name,
                node_uid=str(node.get("metadata", {}).get("uid", "")),
                reason=reason,
                message=message,
                event_type=event_type,
                namespace=config.pod_namespace,
            )
        except KubeError as exc:
            logger.warning("could not post an Event on the Node", extra={"reason": str(exc)})

    return report_event


@dataclass(frozen=True)
class MetricsEndpoint:
    """``/metrics``: the registry, the driver's own metrics and the server (bound, not yet
    serving)."""

    registry: metrics.Registry
    driver: metrics.DriverMetrics
    server: HttpServer


def metrics_endpoint(config: Config, stack: ExitStack) -> MetricsEndpoint | None:
    """With ``--metrics-port``: the endpoint, its port bound now (before anything is served: a
    port in use fails the start with a clear error) and released when ``stack`` closes; None
    without it (prometheus_client is then never imported)."""
    if not config.metrics_port:
        return None
    from dra_driver import metrics  # noqa: PLC0415  (prometheus_client only when on)

    registry = metrics.Registry()
    driver = metrics.DriverMetrics(
        registry,
        driver_name=config.driver_name,
        node_name=config.node_name,
        error_types=ERROR_TYPES,
    )
    server = metrics_server(registry, port=config.metrics_port)
    stack.callback(server.stop)
    return MetricsEndpoint(registry=registry, driver=driver, server=server)


def register_health_metrics(
    endpoint: MetricsEndpoint,
    config: Config,
    monitor: HealthMonitor,
    readiness: Sequence[Callable[[], list[str]]],
) -> None:
    """The health series (conditions, states, readiness) on ``endpoint``."""
    from dra_driver.node.healthmetrics import HealthMetrics  # noqa: PLC0415

    endpoint.registry.register_formatted(
        HealthMetrics(
            node_name=config.node_name,
            conditions=monitor.conditions,
            states=monitor.states,
            readiness=list(readiness),
        )
    )


def start_probes(
    config: Config,
    stack: ExitStack,
    *,
    plugin: NodePlugin,
    loops: Sequence[Heartbeat],
    readiness: Sequence[Callable[[], list[str]]],
) -> None:
    """``/healthz`` (every loop's heartbeat, both sockets answering) and ``/readyz`` on
    ``--healthcheck-port``, until ``stack`` closes; nothing without the flag."""
    if not config.healthcheck_port:
        return
    probes = ProbeServer(
        SocketChecker(
            registration_socket=plugin.paths.registration,
            dra_socket=plugin.paths.dra,
            driver_name=config.driver_name,
        ),
        port=config.healthcheck_port,
        liveness=[lambda: heartbeat_problems(loops)],
        readiness=list(readiness),
    )
    probes.start()
    stack.callback(probes.stop)


def publisher(kube: KubeClient, config: Config, node_devices: NodeDevices) -> Publisher:
    """The writer of this node's ResourceSlices (publish/), from the first discovery's devices;
    not started."""
    return Publisher(
        kube,
        driver_name=config.driver_name,
        node_name=config.node_name,
        node_devices=node_devices,
    )


def claim_status_reporter(
    config: Config,
    kube: KubeClient,
    inventory: Callable[[], Inventory],
    driver_metrics: metrics.DriverMetrics | None,
) -> ClaimStatusReporter:
    """The writer of prepared claims' status.devices (claimstatus/, --claim-status), not
    started (the agent starts it once prepare's state is open); ``inventory`` gives the node's
    GPUs now (the entries' data)."""

    def count(result: str) -> None:
        if driver_metrics is not None:
            writes = driver_metrics.claim_status_writes
            writes.labels(config.node_name, config.driver_name, result).inc()

    return ClaimStatusReporter(
        client=kube, driver_name=config.driver_name, inventory=inventory, count=count
    )
