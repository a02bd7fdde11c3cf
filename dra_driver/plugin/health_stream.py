"""The ``v1alpha1.DRAResourceHealth`` stream (spec B.4): device health for the kubelet.

Each message is the full list of our devices (devices missing from a report decay to Unknown),
with each device's health as the health monitor (health/monitor.py) published it: HEALTHY,
UNHEALTHY (with the reasons as ``message``: XIDs, a lost GPU, ECC errors, ...) or UNKNOWN (NVML
does not answer, or the GPU was not checked yet), and ``last_updated_time`` = when that health
last changed. The list is re-sent every ``interval_s`` (10 s), well inside the
``health_check_timeout_seconds`` we announce (30 s), so a device never decays; and at once when
:meth:`HealthServicer.wake` is called: the monitor calls it on every health change, re-discovery
when the devices changed. Without a health source every device is UNKNOWN: the stream then only
tells the kubelet which devices exist.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

from dra_driver._proto.health_v1alpha1 import api_pb2 as health_pb2
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_grpc
from dra_driver.health.decisions import DeviceHealth

DEFAULT_INTERVAL_S = 10.0
HEALTH_TIMEOUT_S = 30
MAX_MESSAGE = 1024  # the kubelet cuts longer messages (spec B.4)
_STATUS = {
    "Healthy": health_pb2.HEALTHY,
    "Unhealthy": health_pb2.UNHEALTHY,
    "Unknown": health_pb2.UNKNOWN,
}

HealthStates = Callable[[], Mapping[str, DeviceHealth]]
"""Device name -> its health (``changed_s`` in Unix seconds): healthmonitor.HealthMonitor.states."""


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(
        self,
        *,
        pool: str,
        device_names: Callable[[], Sequence[str]],
        stopping: threading.Event,
        health: HealthStates | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._pool = pool
        self._device_names = device_names
        self._health = health
        self._stopping = stopping
        self._interval_s = interval_s
        self._started_s = time.time()
        self._changed = threading.Condition()
        self._version = 0  # bumped by wake()

    def wake(self) -> None:
        """Every open stream reports now (health or devices changed) or sees that we stop."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _report(self) -> health_pb2.NodeWatchResourcesResponse:
        states = self._health() if self._health is not None else {}
        unwatched = DeviceHealth(
            status="Unknown",
            taints=(),
            message="the agent does not watch this device's health",
            changed_s=self._started_s,
        )
        devices = []
        for name in self._device_names():
            state = states.get(name, unwatched)
            devices.append(
                health_pb2.DeviceHealth(
                    device=health_pb2.DeviceIdentifier(pool_name=self._pool, device_name=name),
                    health=_STATUS[state.status],
                    last_updated_time=int(state.changed_s),
                    health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                    message=state.message[:MAX_MESSAGE],
                )
            )
        return health_pb2.NodeWatchResourcesResponse(devices=devices)

    def NodeWatchResources(  # noqa: N802
        self, request: health_pb2.NodeWatchResourcesRequest, context: object
    ) -> Iterator[health_pb2.NodeWatchResourcesResponse]:
        is_active: Callable[[], bool] = getattr(context, "is_active", lambda: True)
        while not self._stopping.is_set() and is_active():
            seen = self._version
            yield self._report()
            with self._changed:
                self._changed.wait_for(partial(self._woken, seen), timeout=self._interval_s)

    def _woken(self, seen: int) -> bool:
        return self._version != seen or self._stopping.is_set()
