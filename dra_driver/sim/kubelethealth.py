"""The kubelet's side of the DRA health stream: a stand-in for where there is no kubelet (tests, the
demo), doing what the real one does with a plugin's health service.

Like a 1.37 kubelet (``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, ``healthinfo.go``):

* asks the registration socket ``GetInfo`` and picks the health service from the plugin's
  ``supported_versions``: ``v1.DRAResourceHealth`` whenever listed, else
  ``v1alpha1.DRAResourceHealth`` (its ``pickHealthService``); no health service, no stream. A
  1.34 to 1.36 kubelet knows only v1alpha1: ``known=KUBELET_1_36``;
* opens ``NodeWatchResources`` on the plugin's endpoint and keeps each device's last report,
  stamped with the time it *arrived*; a device not reported again within its
  ``health_check_timeout_seconds`` (0 or less: the kubelet's default, 30 s) reads Unknown;
* when the stream ends, forgets the driver's health and opens it again after ``retry_s`` (5 s);
  an ``UNIMPLEMENTED`` answer stops it for good.

Like localkubelet.py, this module does not import the driver: it speaks only the wire protocol.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from dra_driver._proto.health_v1 import api_pb2 as v1_pb2
from dra_driver._proto.health_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.health_v1alpha1 import api_pb2 as v1alpha1_pb2
from dra_driver._proto.health_v1alpha1 import api_pb2_grpc as v1alpha1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

V1 = "v1.DRAResourceHealth"
V1ALPHA1 = "v1alpha1.DRAResourceHealth"
KUBELET_1_37 = (V1, V1ALPHA1)  # in the kubelet's order of preference
KUBELET_1_36 = (V1ALPHA1,)
DEFAULT_TIMEOUT_S = 30.0  # healthinfo.go DefaultHealthTimeout
_STUBS: dict[str, tuple[Any, Any]] = {
    V1: (v1_pb2, v1_grpc.DRAResourceHealthStub),
    V1ALPHA1: (v1alpha1_pb2, v1alpha1_grpc.DRAResourceHealthStub),
}


def pick_health_service(advertised: Sequence[str], known: Sequence[str] = KUBELET_1_37) -> str:
    """The health service a kubelet knowing ``known`` (best first) uses with a plugin that
    advertised ``advertised``; "" for none. The plugin's order does not matter."""
    return next((service for service in known if service in advertised), "")


@dataclass(frozen=True)
class ObservedHealth:
    """A device's health as the kubelet shows it (``pod.status...allocatedResourcesStatus``)."""

    status: str  # HEALTHY, UNHEALTHY or UNKNOWN
    message: str = ""
    last_updated_time: int = 0  # as the plugin sent it (Unix seconds)
    timeout_s: float = DEFAULT_TIMEOUT_S
    received_s: float = 0.0  # on the watch's clock


UNKNOWN = ObservedHealth(status="UNKNOWN")


class KubeletHealthWatch:
    """Follows one plugin's health stream, as the kubelet does: ``start()``, ``stop()``.

    ``registration_socket``: the plugin's registration socket (GetInfo names the endpoint).
    ``clock``: monotonic seconds (tests move it to see reports time out).
    """

    def __init__(
        self,
        registration_socket: Path,
        *,
        known: Sequence[str] = KUBELET_1_37,
        retry_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registration_socket = registration_socket
        self.known = tuple(known)
        self.retry_s = retry_s
        self.clock = clock
        self.service = ""  # the service picked at the last GetInfo
        self.arrivals: list[float] = []  # when each report arrived, on ``clock``
        self.unimplemented = False
        self._devices: dict[tuple[str, str], ObservedHealth] = {}
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._stream: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> KubeletHealthWatch:
        self._thread = threading.Thread(target=self._run, name="kubelet-health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        with self._changed:
            stream = self._stream
            self._changed.notify_all()
        if stream is not None:
            stream.cancel()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def health(self, pool: str, device: str) -> ObservedHealth:
        """The device's health now: its last report, or UNKNOWN once that is older than its
        timeout (or if it was never reported)."""
        with self._changed:
            seen = self._devices.get((pool, device))
        if seen is None or self.clock() - seen.received_s > seen.timeout_s:
            return UNKNOWN
        return seen

    def wait_for(self, check: Callable[[], bool], timeout_s: float = 5.0) -> bool:
        """Wait until ``check()`` (called at each report and at the end) holds."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not check():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.1))
        return True

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._watch()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.unimplemented = True
                    return
                if not self._stopping.is_set():
                    log.info("health stream failed; retrying", extra={"error": str(exc)})
            with self._changed:
                self._devices.clear()  # the kubelet forgets the driver's health
                self._stream = None
                self._changed.notify_all()
            self._stopping.wait(self.retry_s)

    def _watch(self) -> None:
        with grpc.insecure_channel(f"unix://{self.registration_socket}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=1)
        self.service = pick_health_service(info.supported_versions, self.known)
        if not self.service:
            self._stopping.wait()  # the plugin has no health service we know: no stream
            return
        pb2, stub = _STUBS[self.service]
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            stream = stub(channel).NodeWatchResources(pb2.NodeWatchResourcesRequest())
            with self._changed:
                if self._stopping.is_set():
                    return
                self._stream = stream
            for report in stream:
                self._update(pb2, report)

    def _update(self, pb2: Any, report: Any) -> None:
        now = self.clock()
        with self._changed:
            self.arrivals.append(now)
            for d in report.devices:
                timeout_s = d.health_check_timeout_seconds
                self._devices[(d.device.pool_name, d.device.device_name)] = ObservedHealth(
                    status=pb2.HealthStatus.Name(d.health),
                    message=d.message,
                    last_updated_time=d.last_updated_time,
                    timeout_s=float(timeout_s) if timeout_s > 0 else DEFAULT_TIMEOUT_S,
                    received_s=now,
                )
            self._changed.notify_all()
