"""``gpu-dra-webhook``: the HTTPS endpoint the API server calls with AdmissionReviews.

``POST /validate`` answers with review.py; ``GET /healthz`` answers ``ok`` (the Deployment's
probes). TLS from ``--tls-cert-file``/``--tls-private-key-file`` (the chart mounts the Secret
that cert-manager or the chart itself made); when either file changes on disk (cert-manager
renews the certificate, the kubelet updates the mounted Secret) the next connection's handshake
uses the new pair, so a renewal needs no restart. One thread per connection; an answer is a few
milliseconds of decoding.

Run it::

    gpu-dra-webhook --port 8443 --tls-cert-file /tls/tls.crt \\
        --tls-private-key-file /tls/tls.key --driver-name gpu.nvidia.com

and point a ValidatingWebhookConfiguration at ``https://<service>:<port>/validate`` with the
certificate's CA as ``caBundle`` (the chart's templates/webhook.yaml does).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import ssl
import sys
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from dra_driver import __version__
from dra_driver.paths import DEFAULT_DRIVER_NAME
from dra_driver.webhook.review import review

log = logging.getLogger(__name__)

DEFAULT_PORT = 8443
MAX_BODY_BYTES = 3 * 1024 * 1024  # the API server's own request limit is about 3 MiB


class CertificateFiles:
    """A server TLS context that follows its certificate and key files on disk."""

    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key
        self._lock = threading.Lock()
        self._stamp: tuple[float, float] | None = None
        self._context = self._load()

    def _load(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.sni_callback = self._switch
        self._stamp = (self.cert.stat().st_mtime, self.key.stat().st_mtime)
        return context

    @property
    def context(self) -> ssl.SSLContext:
        return self._context

    def _switch(self, sock: ssl.SSLObject | ssl.SSLSocket, name: str | None, _: Any) -> None:
        """At each handshake: the current pair, reloaded if a file changed (a half-written
        pair keeps the old one until both load)."""
        del name
        try:
            stamp = (self.cert.stat().st_mtime, self.key.stat().st_mtime)
        except OSError:
            return
        with self._lock:
            if stamp != self._stamp:
                try:
                    self._context = self._load()
                    log.info("TLS certificate reloaded", extra={"cert": str(self.cert)})
                except (OSError, ssl.SSLError) as exc:
                    log.warning("TLS certificate not reloaded", extra={"error": str(exc)})
            sock.context = self._context


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that fails the handshake or goes away is logged, not a traceback.
        log.info(
            "connection failed",
            extra={"peer": str(client_address), "error": str(sys.exc_info()[1])},
        )


class _Handler(BaseHTTPRequestHandler):
    driver: str
    protocol_version = "HTTP/1.1"
    timeout = 10  # seconds a connection may take for its handshake and each request

    def setup(self) -> None:
        # The handshake runs here, in the connection's own thread, not in the accepting one.
        self.request.settimeout(self.timeout)
        self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?")[0] != "/validate":
            self._send(404, b"not found\n", "text/plain")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY_BYTES:
            self._send(400, b"an AdmissionReview body is required\n", "text/plain")
            return
        try:
            answer = review(json.loads(self.rfile.read(length)), driver=self.driver)
        except (ValueError, AttributeError) as exc:
            self._send(400, f"{exc}\n".encode(), "text/plain")
            return
        response = answer["response"]
        if not response["allowed"]:
            log.info("refused", extra={"uid": response["uid"], "why": response["status"]})
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class WebhookServer:
    """The listening HTTPS server; ``port`` 0 picks a free one (``.port`` says which)."""

    def __init__(
        self, *, cert: Path, key: Path, driver: str, port: int = DEFAULT_PORT, host: str = ""
    ) -> None:
        self._tls = CertificateFiles(cert, key)
        handler = type("Handler", (_Handler,), {"driver": driver})
        self._server = _Server((host, port), handler)
        self._server.socket = self._tls.context.wrap_socket(
            self._server.socket, server_side=True, do_handshake_on_connect=False
        )
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> WebhookServer:
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def parser() -> argparse.ArgumentParser:
    """The command line of ``gpu-dra-webhook`` (each flag with an environment twin)."""
    env = os.environ
    out = argparse.ArgumentParser(
        prog="gpu-dra-webhook",
        description="Validating admission webhook for the opaque GpuConfig/MigDeviceConfig of "
        "ResourceClaims and ResourceClaimTemplates (POST /validate, GET /healthz, over HTTPS).",
    )
    out.add_argument("--port", type=int, default=int(env.get("WEBHOOK_PORT", DEFAULT_PORT)),
                     help="HTTPS port [WEBHOOK_PORT] (default 8443)")  # fmt: skip
    out.add_argument("--bind-address", default=env.get("WEBHOOK_BIND_ADDRESS", ""),
                     help="address to listen on [WEBHOOK_BIND_ADDRESS] (default: all)")  # fmt: skip
    out.add_argument("--tls-cert-file", type=Path, default=env.get("TLS_CERT_FILE"),
                     help="serving certificate, PEM [TLS_CERT_FILE]")  # fmt: skip
    out.add_argument("--tls-private-key-file", type=Path,
                     default=env.get("TLS_PRIVATE_KEY_FILE"),
                     help="its private key, PEM [TLS_PRIVATE_KEY_FILE]")  # fmt: skip
    out.add_argument("--driver-name", default=env.get("DRIVER_NAME", DEFAULT_DRIVER_NAME),
                     help="the DRA driver whose configs are checked [DRIVER_NAME]")  # fmt: skip
    out.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-dra-webhook``: serve until SIGTERM/SIGINT."""
    command = parser()
    args = command.parse_args(argv)
    if args.tls_cert_file is None or args.tls_private_key_file is None:
        command.error("--tls-cert-file and --tls-private-key-file are required (the API server "
                      "calls webhooks over HTTPS only)")  # fmt: skip
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        server = WebhookServer(
            cert=args.tls_cert_file, key=args.tls_private_key_file, driver=args.driver_name,
            port=args.port, host=args.bind_address,
        )  # fmt: skip
    except (OSError, ssl.SSLError) as exc:
        print(f"gpu-dra-webhook: cannot serve: {exc}", file=sys.stderr)
        return 1

    def stop(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        threading.Thread(target=server.stop, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("serving on port %d for driver %s", server.port, args.driver_name)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
