"""HTTP liveness/readiness probes of the node agent: ``/healthz`` and ``/readyz``.

``/healthz`` (liveness: failing restarts the container) says the process and its loops are
alive: both sockets really answer, checked the way the kubelet uses them (``GetInfo`` over the
registration socket, an empty ``NodePrepareResources`` over ``dra.sock``, through the real gRPC
stack, so a wedged server or a deleted socket file fails it), and every background loop
(:class:`Heartbeat`) is running and not stuck in one pass. Nothing outside the process (the API
server, NVML) is part of it: restarting the agent would not bring those back.

``/readyz`` (readiness: a rolling update waits for it before it replaces the next node's pod)
is everything ``/healthz`` checks plus the readiness checks the agent passes in: the kubelet
registered the plugin, the slices are published and current, NVML answered the last discovery.

Each answers 200 ``ok`` or 503 with one line per failing condition. Port:
``--healthcheck-port``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as v1_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from dra_driver.errors import DraError
from dra_driver.node.http_server import Answer, HttpServer

PROBE_TIMEOUT_S = 1.0

Check = Callable[[], Iterable[str]]
"""One probe condition: what is wrong now, one line each; nothing when it passes."""


class SocketChecker:
    """Calls both sockets; keeps one channel per socket open between probes."""

    def __init__(self, *, registration_socket: Path, dra_socket: Path, driver_name: str) -> None:
        self.registration_socket = registration_socket
        self.dra_socket = dra_socket
        self.driver_name = driver_name
        self._reg_channel = grpc.insecure_channel(f"unix://{registration_socket}")
        self._dra_channel = grpc.insecure_channel(f"unix://{dra_socket}")
        self._reg = reg_grpc.RegistrationStub(self._reg_channel)
        self._dra = v1_grpc.DRAPluginStub(self._dra_channel)

    def close(self) -> None:
        self._reg_channel.close()
        self._dra_channel.close()

    def problems(self) -> list[str]:
        """Empty when both sockets answer correctly; otherwise what is wrong with each."""
        found = []
        for path in (self.registration_socket, self.dra_socket):
            if not path.exists():
                found.append(f"socket {path} does not exist")
        if found:
            return found
        try:
            info = self._reg.GetInfo(reg_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
            if info.name != self.driver_name:
                found.append(f"registration socket answers for driver {info.name!r}")
        except grpc.RpcError as exc:
            found.append(f"registration socket: GetInfo failed: {_describe(exc)}")
        try:
            answer = self._dra.NodePrepareResources(
                v1_pb2.NodePrepareResourcesRequest(), timeout=PROBE_TIMEOUT_S
            )
            if answer.claims:
                found.append("dra socket answered claims to an empty request")
        except grpc.RpcError as exc:
            found.append(f"dra socket: NodePrepareResources failed: {_describe(exc)}")
        return found


def _describe(exc: grpc.RpcError) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return f"{getattr(code, 'name', code)}: {details}"


class ProbeServer:
    """Serves /healthz and /readyz on ``host:port`` in a background thread.

    ``/healthz`` fails on the sockets (``checker``) or any ``liveness`` check; ``/readyz`` on
    those or any ``readiness`` check. Checks run on the probe's connection thread, so they
    only read state the loops keep (no API call, no NVML call).
    """

    def __init__(
        self,
        checker: SocketChecker,
        *,
        port: int,
        host: str = "",
        liveness: Sequence[Check] = (),
        readiness: Sequence[Check] = (),
    ) -> None:
        self.checker = checker
        alive: tuple[Check, ...] = (checker.problems, *liveness)
        ready: tuple[Check, ...] = (*alive, *readiness)

        def probe(checks: Sequence[Check]) -> Answer:
            problems = [p for check in checks for p in check()]
            if problems:
                return Answer(503, "".join(f"{p}\n" for p in problems))
            return Answer(200, "ok\n")

        try:
            self._server = HttpServer(
                {"/healthz": lambda: probe(alive), "/readyz": lambda: probe(ready)},
                port=port,
                host=host,
                flag="--healthcheck-port (HEALTHCHECK_PORT)",
                name="probes",
            )
        except DraError:
            checker.close()
            raise

    @property
    def port(self) -> int:
        return self._server.port

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop()
        self.checker.close()
