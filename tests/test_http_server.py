"""node/http_server.py over real HTTP (http.client): keep-alive, gzip, HEAD, 404 and 405."""

from __future__ import annotations

import gzip
import http.client
import socket
from collections.abc import Iterator

import pytest
from prometheus_client.metrics import Counter

from dra_driver.metrics import CONTENT_TYPE, Registry
from dra_driver.node.http_server import (
    GZIP_MIN_BYTES,
    IDLE_TIMEOUT_S,
    Answer,
    HttpServer,
    metrics_server,
)


@pytest.fixture
def registry() -> Registry:
    registry = Registry()
    errors = Counter("demo_errors_total", "Errors.", ("device",), registry=registry.collectors)
    for i in range(64):  # a body well above GZIP_MIN_BYTES
        errors.labels(f"gpu-{i}").inc(i)
    return registry


@pytest.fixture
def server(registry: Registry) -> Iterator[HttpServer]:
    served = metrics_server(registry, port=0, host="127.0.0.1")
    served.start()
    yield served
    served.stop()


def connect(server: HttpServer) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)


def test_one_connection_serves_several_requests(server: HttpServer) -> None:
    connection = connect(server)
    try:
        ports = set()
        for method in ("GET", "HEAD", "GET", "GET"):
            connection.request(method, "/metrics")
            response = connection.getresponse()
            body = response.read()
            assert response.status == 200
            assert response.version == 11
            assert not response.will_close
            assert connection.sock is not None
            ports.add(connection.sock.getsockname()[1])
            if method == "GET":
                assert b"demo_errors_total" in body
        assert len(ports) == 1, "http.client reconnected: the server closed the connection"
    finally:
        connection.close()


def test_gzip_when_asked_decodes_to_the_same_text(server: HttpServer, registry: Registry) -> None:
    connection = connect(server)
    try:
        connection.request("GET", "/metrics")
        plain = connection.getresponse()
        text = plain.read()
        assert plain.getheader("Content-Encoding") is None
        assert len(text) >= GZIP_MIN_BYTES
        for accept in ("gzip", "deflate, gzip;q=1.0, *;q=0.5", "GZIP"):
            connection.request("GET", "/metrics", headers={"Accept-Encoding": accept})
            zipped = connection.getresponse()
            body = zipped.read()
            assert zipped.status == 200
            assert zipped.getheader("Content-Encoding") == "gzip"
            assert zipped.getheader("Content-Type") == CONTENT_TYPE
            assert zipped.getheader("Vary") == "Accept-Encoding"
            assert int(zipped.getheader("Content-Length", "-1")) == len(body)
            assert len(body) < len(text) / 3
            assert gzip.decompress(body) == text
        connection.request("GET", "/metrics", headers={"Accept-Encoding": "identity"})
        identity = connection.getresponse()
        assert identity.read() == text
        assert identity.getheader("Content-Encoding") is None
    finally:
        connection.close()


def test_a_new_value_is_compressed_again(server: HttpServer, registry: Registry) -> None:
    """A scrape after a change serves the new value: nothing of an earlier body is reused."""
    connection = connect(server)
    try:
        bodies = []
        for _ in range(2):
            connection.request("GET", "/metrics", headers={"Accept-Encoding": "gzip"})
            bodies.append(gzip.decompress(connection.getresponse().read()).decode())
            if len(bodies) == 1:
                Counter("demo_more_total", "More.", registry=registry.collectors).inc(7)
        assert "demo_more_total" not in bodies[0]
        assert "demo_more_total 7.0" in bodies[1]
    finally:
        connection.close()


def test_head_returns_the_headers_and_no_body(server: HttpServer) -> None:
    connection = connect(server)
    try:
        connection.request("GET", "/metrics")
        get = connection.getresponse()
        length = len(get.read())
        connection.request("HEAD", "/metrics")
        head = connection.getresponse()
        assert head.status == 200
        assert head.getheader("Content-Type") == CONTENT_TYPE
        assert int(head.getheader("Content-Length", "-1")) == length
        assert head.read() == b""
        # the connection is still in step: a GET after the HEAD gets its own whole answer
        connection.request("GET", "/metrics")
        assert len(connection.getresponse().read()) == length
    finally:
        connection.close()


def test_probe_paths_answer_head_too() -> None:
    probes = HttpServer(
        {"/healthz": lambda: Answer(200, "ok\n"), "/readyz": lambda: Answer(503, "no\n")},
        port=0,
        host="127.0.0.1",
        flag="--x",
        name="probes",
    )
    probes.start()
    connection = http.client.HTTPConnection("127.0.0.1", probes.port, timeout=5)
    try:
        for path, status in (("/healthz", 200), ("/readyz", 503)):
            connection.request("HEAD", path, headers={"Accept-Encoding": "gzip"})
            response = connection.getresponse()
            assert (response.status, response.read()) == (status, b"")
            assert response.getheader("Content-Length") == "3"
            assert response.getheader("Content-Encoding") is None  # too small to gzip
    finally:
        connection.close()
        probes.stop()


def test_unknown_path_is_404_naming_the_paths(server: HttpServer) -> None:
    connection = connect(server)
    try:
        connection.request("GET", "/metricz")
        response = connection.getresponse()
        assert response.status == 404
        assert response.read() == b"not found: use /metrics\n"
        connection.request("HEAD", "/")
        response = connection.getresponse()
        assert (response.status, response.read()) == (404, b"")
        assert not response.will_close
    finally:
        connection.close()


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "OPTIONS", "BREW"])
def test_other_methods_are_405_with_allow(server: HttpServer, method: str) -> None:
    connection = connect(server)
    try:
        connection.request(method, "/metrics", body=b"x" * 10)
        response = connection.getresponse()
        assert response.status == 405
        assert response.getheader("Allow") == "GET, HEAD"
        assert response.read() == f"method {method} not allowed: use GET, HEAD\n".encode()
        assert response.will_close  # the body it sent was not read
    finally:
        connection.close()


def test_stop_ends_kept_connections() -> None:
    served = metrics_server(Registry(), port=0, host="127.0.0.1")
    served.start()
    connection = connect(served)
    try:
        connection.request("GET", "/metrics")
        connection.getresponse().read()
        assert connection.sock is not None
        sock: socket.socket = connection.sock
        served.stop()
        sock.settimeout(5)  # far below IDLE_TIMEOUT_S: the server, not the timeout, ended it
        assert IDLE_TIMEOUT_S > 5
        assert sock.recv(1) == b""
    finally:
        connection.close()
