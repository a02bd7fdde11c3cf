"""The ``v1alpha1.DRAResourceHealth`` stream (spec B.4): device health for the kubelet.

Each message is the full list of our devices (devices missing from a report decay to Unknown),
re-sent every ``interval_s`` (10 s), well inside the ``health_check_timeout_seconds`` we
announce (30 s), so a healthy device never decays. The list is read at each report, and
:meth:`HealthServicer.wake` sends it at once when re-discovery changed the devices. Every
device present is reported HEALTHY: the agent does not watch NVML health events (XIDs, ECC) yet,
so this stream tells the kubelet which devices exist, not whether they work; a device that
disappears drops out of the list and decays to Unknown.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

from dra_driver._proto.health_v1alpha1 import api_pb2 as health_pb2
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as health_grpc

DEFAULT_INTERVAL_S = 10.0
HEALTH_TIMEOUT_S = 30


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(
        self,
        *,
        pool: str,
        device_names: Callable[[], Sequence[str]],
        stopping: threading.Event,
        interval_s: float = DEFAULT_INTERVAL_S,
    ) -> None:
        self._pool = pool
        self._device_names = device_names
        self._stopping = stopping
        self._interval_s = interval_s
        self._changed = threading.Condition()
        self._version = 0  # bumped by wake()

    def wake(self) -> None:
        """Every open stream reports now (the devices changed) or sees that we are stopping."""
        with self._changed:
            self._version += 1
            self._changed.notify_all()

    def _report(self) -> health_pb2.NodeWatchResourcesResponse:
        now = int(time.time())
        return health_pb2.NodeWatchResourcesResponse(
            devices=[
                health_pb2.DeviceHealth(
                    device=health_pb2.DeviceIdentifier(pool_name=self._pool, device_name=name),
                    health=health_pb2.HEALTHY,
                    last_updated_time=now,
                    health_check_timeout_seconds=HEALTH_TIMEOUT_S,
                )
                for name in self._device_names()
            ]
        )

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
