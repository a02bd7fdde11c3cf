"""The kubelet's device health stream (spec B.4): ``v1.DRAResourceHealth`` (kubelet >= 1.37,
which prefers it) and ``v1alpha1.DRAResourceHealth`` (kubelets 1.34 to 1.36), both from one feed.

Each message is the full list of our devices (devices missing from a report decay to Unknown),
with each device's health as the health monitor (health/monitor.py) published it: HEALTHY,
UNHEALTHY (with the reasons as ``message``: XIDs, a lost GPU, ECC errors, ...) or UNKNOWN (NVML
does not answer, or the GPU was not checked yet), and ``last_updated_time`` = when that health
last changed.

Why the list is re-sent: the kubelet stamps each device with the time the report *arrived* and
shows it Unknown once ``health_check_timeout_seconds`` passed without another one
(``pkg/kubelet/cm/dra/healthinfo.go``: ``DefaultHealthTimeout`` 30 s, used when the field is 0).
So every open stream sends the whole list every ``interval_s`` (``--health-report-interval``,
10 s by default, at most half the 30 s we announce), and at once when :meth:`HealthFeed.wake` is
called: the monitor calls it on every health change, re-discovery when the devices changed.
Without a health source every device is UNKNOWN: the stream then only tells the kubelet which
devices exist.

The two versions have the same messages (same field numbers, same enum); each servicer only
names its generated module, as dra.py does for the DRA service.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from dra_driver._proto.health_v1 import api_pb2 as v1_pb2
from dra_driver._proto.health_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.health_v1alpha1 import api_pb2 as v1alpha1_pb2
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from dra_driver.plugin.settings import DEFAULT_HEALTH_REPORT_INTERVAL_S, HEALTH_TIMEOUT_S

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = DEFAULT_HEALTH_REPORT_INTERVAL_S
MAX_MESSAGE = 1024  # the kubelet cuts longer messages (spec B.4)
_STATUS = {"Healthy": "HEALTHY", "Unhealthy": "UNHEALTHY", "Unknown": "UNKNOWN"}


class DeviceHealth(Protocol):
    """What the stream reports of one device's health (health.decisions.DeviceHealth has it: the
    plugin serves the health it is fed and imports no wing)."""

    @property
    def status(self) -> str: ...  # Healthy, Unhealthy or Unknown

    @property
    def message(self) -> str: ...

    @property
    def changed_s(self) -> float: ...


@dataclass(frozen=True)
class _Unwatched:
    status: str
    message: str
    changed_s: float


HealthStates = Callable[[], Mapping[str, DeviceHealth]]
"""Device name -> its health (``changed_s`` in Unix seconds): healthmonitor.HealthMonitor.states."""


@dataclass(frozen=True)
class DeviceReport:
    """One device's entry of a report, whatever the API version."""

    device_name: str
    status: str  # Healthy, Unhealthy or Unknown (health.decisions)
    last_updated_s: int
    message: str


class HealthFeed:
    """What every open health stream reports, and when: the version-neutral half of the service.

    ``device_names`` gives the current devices at each report; ``health`` their health (None:
    every device UNKNOWN). ``interval_s`` is held below the timeout by the agent's Config
    (node/config.py); tests use longer ones to see that :meth:`wake` alone sends. Thread-safe:
    streams wait on it in gRPC worker threads while :meth:`wake` is called from the health
    monitor and re-discovery.
    """

    def __init__(
        self,
        *,
        pool: str,
        device_names: Callable[[], Sequence[str]],
        stopping: threading.Event,
        health: HealthStates | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: int = HEALTH_TIMEOUT_S,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"health report interval {interval_s} s must be greater than 0")
        self.pool = pool
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._device_names = device_names
        self._health = health
        self._stopping = stopping
        self._started_s = time.time()
        self._changed = threading.Condition()
        self._version = 0  # bumped by wake()

    def wake(self) -> None:
        """Every open stream reports now (health or devices changed) or sees that we stop."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def report(self) -> list[DeviceReport]:
        """Every current device with its health, in device-name order of ``device_names``."""
        states = self._health() if self._health is not None else {}
        unwatched: DeviceHealth = _Unwatched(
            status="Unknown",
            message="the agent does not watch this device's health",
            changed_s=self._started_s,
        )
        reports = []
        for name in self._device_names():
            state = states.get(name, unwatched)
            reports.append(
                DeviceReport(
                    device_name=name,
                    status=state.status,
                    last_updated_s=int(state.changed_s),
                    message=state.message[:MAX_MESSAGE],
                )
            )
        return reports

    def reports(self, is_active: Callable[[], bool]) -> Iterator[list[DeviceReport]]:
        """A report now, then one each ``interval_s`` or at each :meth:`wake`, until we stop or
        ``is_active`` (the stream's gRPC context) says the kubelet went away."""
        while not self._stopping.is_set() and is_active():
            seen = self._version
            yield self.report()
            with self._changed:
                self._changed.wait_for(partial(self._woken, seen), timeout=self.interval_s)

    def _woken(self, seen: int) -> bool:
        return self._version != seen or self._stopping.is_set()


class _HealthServicer:
    """``NodeWatchResources`` of one version: a subclass names its generated module; ``service``
    is its gRPC service name, which for health is also the name advertised (spec A.4)."""

    _pb2: Any
    service: str

    def __init__(self, feed: HealthFeed) -> None:
        self._feed = feed

    def _message(self, devices: Sequence[DeviceReport]) -> Any:
        pb2 = self._pb2
        return pb2.NodeWatchResourcesResponse(
            devices=[
                pb2.DeviceHealth(
                    device=pb2.DeviceIdentifier(
                        pool_name=self._feed.pool, device_name=d.device_name
                    ),
                    health=pb2.HealthStatus.Value(_STATUS[d.status]),
                    last_updated_time=d.last_updated_s,
                    health_check_timeout_seconds=self._feed.timeout_s,
                    message=d.message,
                )
                for d in devices
            ]
        )

    def NodeWatchResources(self, request: Any, context: object) -> Iterator[Any]:  # noqa: N802
        is_active: Callable[[], bool] = getattr(context, "is_active", lambda: True)
        log.info("kubelet opened the health stream", extra={"service": self.service})
        try:
            for devices in self._feed.reports(is_active):
                yield self._message(devices)
        finally:
            log.info("the health stream ended", extra={"service": self.service})


class V1HealthServicer(_HealthServicer, v1_grpc.DRAResourceHealthServicer):
    _pb2 = v1_pb2
    service = v1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name


class V1alpha1HealthServicer(_HealthServicer, v1alpha1_grpc.DRAResourceHealthServicer):
    _pb2 = v1alpha1_pb2
    service = v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name
