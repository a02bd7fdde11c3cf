"""The agent's small HTTP servers: the probes (node/probes.py) and Prometheus ``/metrics``.

Each serves a few fixed paths from a background thread (stdlib ``http.server``, one thread per
connection) over HTTP/1.1: connections stay open between requests (every answer has a
``Content-Length``; an idle connection is closed after :data:`IDLE_TIMEOUT_S`), ``GET`` and
``HEAD`` work on every path (``HEAD``: the same status and headers, no body), any other method
answers 405 with ``Allow``, any other path 404 naming the paths there are. A body is gzipped
when the client accepts it (``Accept-Encoding``, read by prometheus_client's
``gzip_accepted``, as its own handlers do): a text answer when it is larger than
:data:`GZIP_MIN_BYTES`; ``/metrics`` always, from the telemetry's exposition as it keeps it
deflated and the rest compressed at the scrape (metrics.Rendered), so a scrape compresses
kilobytes whatever the number of GPUs, and nothing of a body is kept after it is sent. The
port is bound when the server is built, so a port already in use fails the agent at start with
the flag's name in the message, before anything else is served.

Why not prometheus_client's own server: its ``MetricsHandler`` speaks HTTP/1.0 without a
``Content-Length`` (a new connection per scrape), answers 501 to ``HEAD`` and serves metrics on
any path; ``make_wsgi_app`` answers 405 to ``HEAD`` and runs on ``wsgiref``, which closes the
connection after each request. Both render one ``CollectorRegistry``, whereas ``/metrics`` here
also serves the telemetry's exposition formatted once per sample (metrics.Registry), which is
what keeps a 64-GPU scrape near a millisecond; and their content negotiation (``choose_encoder``)
would answer Prometheus in OpenMetrics, which that pre-formatted text is not. What is taken
from the library: the exposition itself, its content type and its ``Accept-Encoding`` parsing.
What is given up: OpenMetrics and ``?name[]=`` filtering, which no scraper of this agent uses.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol

from dra_driver.errors import DraError

if TYPE_CHECKING:
    from dra_driver import metrics

log = logging.getLogger(__name__)

IDLE_TIMEOUT_S = 120.0
"""An open connection with no request for this long is closed. Longer than any scrape interval
(Prometheus' default is 1 min), so a scraper keeps one connection; its thread ends with it."""
GZIP_MIN_BYTES = 1024
"""Smaller bodies (probe answers) go uncompressed: gzip would only add its header."""
GZIP_LEVEL = 6
"""zlib's default, for a text answer (/metrics: metrics.DEFLATE_LEVEL). 64 GPUs' telemetry
(92 KiB) gzips to 7.8 KiB at level 6 and at level 9 (the library's choice), in 0.85 ms of CPU
against 1.8 ms; level 1: 10.8 KiB in 0.4 ms."""
ALLOWED = "GET, HEAD"


class Body(Protocol):
    """An answer's body that knows its bytes, plain or gzipped (metrics.Rendered)."""

    def plain(self) -> bytes: ...

    def gzipped(self) -> bytes: ...


@dataclass(frozen=True)
class Answer:
    status: int
    body: str | Body
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Answer]
"""Computes the answer to a GET or HEAD of one path (called on the connection's thread)."""


class HttpServer:
    """Serves ``routes`` on ``host:port`` (all addresses when ``host`` is empty; port 0 picks
    a free one) in a background thread. ``flag`` names the setting of the port in errors."""

    def __init__(
        self, routes: Mapping[str, Route], *, port: int, flag: str, name: str, host: str = ""
    ) -> None:
        known = " or ".join(sorted(routes))
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = IDLE_TIMEOUT_S
            disable_nagle_algorithm = True  # headers and body are two writes: send both now

            def setup(self) -> None:
                super().setup()
                with server._open_lock:
                    server._open.add(self.connection)

            def finish(self) -> None:
                with server._open_lock:
                    server._open.discard(self.connection)
                super().finish()

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def _answer(self, *, body: bool) -> None:
                route = routes.get(self.path.partition("?")[0])
                answer = route() if route else Answer(404, f"not found: use {known}\n")
                data, encoding = _encoded(answer.body, self.headers.get("Accept-Encoding", ""))
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(data)))
                if route:
                    self.send_header("Vary", "Accept-Encoding")
                if encoding:
                    self.send_header("Content-Encoding", encoding)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _not_allowed(self) -> None:
                data = f"method {self.command} not allowed: use {ALLOWED}\n".encode()
                self.close_connection = True  # its request body, if any, was not read
                self.send_response(405)
                self.send_header("Allow", ALLOWED)
                self.send_header("Connection", "close")
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def send_error(
                self, code: int, message: str | None = None, explain: str | None = None
            ) -> None:
                # The stdlib answers 501 to a method without a do_<METHOD>: here, 405.
                if code == HTTPStatus.NOT_IMPLEMENTED:
                    self._not_allowed()
                else:
                    super().send_error(code, message, explain)

            def log_message(self, format: str, *args: object) -> None:
                log.debug(name + " " + format, *args)

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            where = f"{host}:{port}" if host else f"port {port}"
            raise DraError(f"{flag}: cannot listen on {where}: {exc.strerror or exc}") from exc
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close the port and end the open connections (their threads end when
        they see it). Safe before start() and twice."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for serve_forever: only when it runs
            self._thread.join(timeout=5)
        self._httpd.server_close()
        with self._open_lock:
            connections = list(self._open)
        for connection in connections:
            with suppress(OSError):  # the client closed it already
                connection.shutdown(socket.SHUT_RDWR)


def _encoded(body: str | Body, accept_encoding: str) -> tuple[bytes, str | None]:
    """The bytes to send and their ``Content-Encoding`` (None: as they are)."""
    if not isinstance(body, str):
        if _gzip_accepted(accept_encoding):
            return body.gzipped(), "gzip"
        return body.plain(), None
    data = body.encode()
    if len(data) < GZIP_MIN_BYTES or not _gzip_accepted(accept_encoding):
        return data, None
    import gzip  # noqa: PLC0415  (only for large bodies: the probes never load it)

    return gzip.compress(data, compresslevel=GZIP_LEVEL, mtime=0), "gzip"


def _gzip_accepted(accept_encoding: str) -> bool:
    # prometheus_client loads only here: with metrics off the probes' server never imports it.
    from prometheus_client.exposition import gzip_accepted  # noqa: PLC0415

    return bool(gzip_accepted(accept_encoding))


def metrics_server(registry: metrics.Registry, *, port: int, host: str = "") -> HttpServer:
    """``GET /metrics``: ``registry`` in the Prometheus text format (0.0.4). A metric that
    cannot be read now (the checkpoint is closed) answers 500 with the reason."""
    from dra_driver import metrics  # noqa: PLC0415  (loaded only when metrics are served)

    def scrape() -> Answer:
        try:
            return Answer(200, registry.rendered(), metrics.CONTENT_TYPE)
        except DraError as exc:
            log.warning("metrics could not be collected", extra={"error": str(exc)})
            return Answer(500, f"metrics could not be collected: {exc}\n")

    return HttpServer(
        {"/metrics": scrape},
        port=port,
        host=host,
        flag="--metrics-port (METRICS_PORT)",
        name="metrics",
    )


__all__ = ["Answer", "HttpServer", "Route", "metrics_server"]
