"""The agent's small HTTP servers: the probes (node/probes.py) and Prometheus ``/metrics``.

Each serves a few fixed ``GET`` paths from a background thread (stdlib ``http.server``, one
thread per connection); any other path answers 404 naming the paths there are. The port is
bound when the server is built, so a port already in use fails the agent at start with the
flag's name in the message, before anything else is served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from dra_driver.errors import DraError

if TYPE_CHECKING:
    from dra_driver import metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    status: int
    body: str
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[], Answer]
"""Computes the answer to a GET of one path (called on the connection's thread)."""


class HttpServer:
    """Serves ``routes`` on ``host:port`` (all addresses when ``host`` is empty; port 0 picks
    a free one) in a background thread. ``flag`` names the setting of the port in errors."""

    def __init__(
        self, routes: Mapping[str, Route], *, port: int, flag: str, name: str, host: str = ""
    ) -> None:
        known = " or ".join(sorted(routes))

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.partition("?")[0])
                answer = route() if route else Answer(404, f"not found: use {known}\n")
                data = answer.body.encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", answer.content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
        """Stop serving and close the port. Safe before start() and twice."""
        if self._thread.is_alive():
            self._httpd.shutdown()  # waits for serve_forever: only when it runs
            self._thread.join(timeout=5)
        self._httpd.server_close()


def metrics_server(registry: metrics.Registry, *, port: int, host: str = "") -> HttpServer:
    """``GET /metrics``: ``registry`` in the Prometheus text format (0.0.4). A metric that
    cannot be read now (the checkpoint is closed) answers 500 with the reason."""
    from dra_driver import metrics  # noqa: PLC0415  (loaded only when metrics are served)

    def scrape() -> Answer:
        try:
            return Answer(200, registry.render(), metrics.CONTENT_TYPE)
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
