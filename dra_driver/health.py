"""HTTP liveness/readiness probes of the kubelet plugin: ``/healthz`` and ``/readyz``.

Both answer 200 only when the two sockets really answer, checked the way the kubelet uses them:
``GetInfo`` over the registration socket and an empty ``NodePrepareResources`` over ``dra.sock``
(through the real gRPC stack, so a wedged server or a deleted socket file fails the probe).
Anything else answers 503 with the reason in the body. Port: ``--healthcheck-port``.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc

from dra_driver._proto.dra_v1 import api_pb2 as v1_pb2
from dra_driver._proto.dra_v1 import api_pb2_grpc as v1_grpc
from dra_driver._proto.pluginregistration_v1 import api_pb2 as reg_pb2
from dra_driver._proto.pluginregistration_v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


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
    """Serves /healthz and /readyz on ``host:port`` in a background thread."""

    def __init__(self, checker: SocketChecker, *, port: int, host: str = "") -> None:
        self.checker = checker

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path not in ("/healthz", "/readyz"):
                    self._answer(404, "not found: use /healthz or /readyz\n")
                    return
                problems = checker.problems()
                if problems:
                    self._answer(503, "".join(f"{p}\n" for p in problems))
                else:
                    self._answer(200, "ok\n")

            def _answer(self, status: int, body: str) -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("probe " + format, *args)

        self._httpd = ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="probes", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self.checker.close()
