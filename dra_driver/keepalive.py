"""Keep-alive GETs for the one API read on the prepare path, on the official client's settings.

Place in the flow: kube.py sends the ResourceClaim GET of every NodePrepareResources through
:class:`KeepAliveGetter`; every other call (slices, watches, events, discovery) goes through the
official client.

Why this one call does not: the official client's request path (ApiClient, RESTClientObject,
urllib3's PoolManager, connection pool and response object) runs about 0.4 ms more Python per call
than ``http.client`` on the same keep-alive connection, measured inside a prepare on a small node VM
(see bench/bench_prepare.py), out of a 3 ms budget for the whole prepare.

What stays the official client's: the host, the TLS settings (CA file or data, client
certificate, ``verify_ssl``, ``tls_server_name``, ``assert_hostname=False``) and the request
headers, which kube.py asks the client for on every request (so a refreshed ServiceAccount token
is used). A configuration this module does not handle exactly as the official client would (a
proxy in use, custom socket options, a non-boolean ``assert_hostname``) makes
:meth:`KeepAliveGetter.for_configuration` return None, and the caller keeps the official path.

Transport failures are raised as they come (``OSError``, ``ssl.SSLError``,
``http.client.HTTPException``); the caller maps them. There is one retry, the one every HTTP client
makes: a GET on a reused connection that the server closed while it sat idle is sent again on a
new connection. A timeout is never retried.
"""

from __future__ import annotations

import http.client
import select
import socket
import ssl
import threading
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import certifi
from urllib3.exceptions import InsecureRequestWarning

# What a server that closed an idle keep-alive connection looks like to the next request on it.
_CLOSED_WHILE_IDLE = (ConnectionResetError, BrokenPipeError, http.client.BadStatusLine)


class KeepAliveGetter:
    """GET over a small pool of keep-alive connections to one API server. Thread-safe."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        tls: ssl.SSLContext | None,
        server_hostname: str | None = None,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 16,
    ) -> None:
        self.host = host
        self.port = port
        self._tls = tls
        self._server_hostname = server_hostname or host
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def for_configuration(
        cls, configuration: Any, *, connect_timeout_s: float, read_timeout_s: float
    ) -> KeepAliveGetter | None:
        """A getter for a ``kubernetes.client.Configuration``, or None where this module would
        not connect exactly as the official client does (then the caller keeps that client)."""
        url = urlsplit(configuration.host)
        if url.scheme not in ("http", "https") or not url.hostname:
            return None
        if configuration.proxy and not _bypasses_proxy(configuration):
            return None
        if configuration.socket_options is not None or getattr(configuration, "keep_alive", False):
            return None
        if configuration.assert_hostname not in (None, False):
            return None
        tls = _tls_context(configuration) if url.scheme == "https" else None
        return cls(
            host=url.hostname,
            port=url.port or (443 if url.scheme == "https" else 80),
            tls=tls,
            server_hostname=configuration.tls_server_name or None,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
        )

    def get(self, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """``GET path``: the status and the whole body."""
        conn, reused = self._checkout()
        try:
            status, body, keep = _exchange(conn, path, headers)
        except _CLOSED_WHILE_IDLE:
            conn.close()
            if not reused:
                raise
            conn = self._connect()
            try:
                status, body, keep = _exchange(conn, path, headers)
            except BaseException:
                conn.close()
                raise
        except BaseException:
            conn.close()
            raise
        if keep:
            self._checkin(conn)
        else:
            conn.close()
        return status, body

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    @property
    def idle_connections(self) -> int:
        with self._lock:
            return len(self._idle)

    # -- connections ------------------------------------------------------------------------

    def _checkout(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection the server has not closed (True), else a new one (False)."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(), False
            if not _closed_by_peer(conn):
                return conn, True
            conn.close()

    def _checkin(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _connect(self) -> http.client.HTTPConnection:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                if self._tls.verify_mode == ssl.CERT_NONE:
                    warnings.warn(  # as urllib3 warns the official client's users
                        InsecureRequestWarning(
                            f"Unverified HTTPS request is being made to host '{self.host}'"
                        ),
                        stacklevel=2,
                    )
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_hostname)
            sock.settimeout(self._read_timeout_s)
        except BaseException:
            sock.close()
            raise
        conn: http.client.HTTPConnection
        if self._tls is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, context=self._tls)
        else:
            conn = http.client.HTTPConnection(self.host, self.port)
        conn.sock = sock  # connected (and TLS-wrapped) above, with our timeouts
        return conn


def _bypasses_proxy(configuration: Any) -> bool:
    """Whether the official client sends to this host directly although a proxy is set (its
    ``no_proxy`` rules; clients too old to have them always use the proxy)."""
    try:
        from kubernetes.client.rest import should_bypass_proxies  # noqa: PLC0415
    except ImportError:
        return False
    return bool(should_bypass_proxies(configuration.host, configuration.no_proxy or ""))


def _exchange(
    conn: http.client.HTTPConnection, path: str, headers: Mapping[str, str]
) -> tuple[int, bytes, bool]:
    """One request and its whole response; whether the connection may be used again."""
    conn.request("GET", path, headers=dict(headers))
    response = conn.getresponse()
    body = response.read()
    return response.status, body, not response.will_close


def _closed_by_peer(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive connection is readable only if the server closed it (or broke the
    protocol): either way it must not carry the next request."""
    sock = conn.sock
    if sock is None:
        return True
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _tls_context(configuration: Any) -> ssl.SSLContext:
    """TLS settings of the official client (kubernetes.client.rest builds the same ones for
    urllib3): trust only the CA file or data given (the certifi bundle when neither is), client
    certificate, ``verify_ssl``, hostname checks off only for ``assert_hostname=False``."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies certificate and hostname
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # as urllib3
    if configuration.verify_ssl:
        if configuration.ssl_ca_cert or configuration.ca_cert_data:
            if configuration.ssl_ca_cert:
                context.load_verify_locations(cafile=configuration.ssl_ca_cert)
            if configuration.ca_cert_data:
                context.load_verify_locations(cadata=configuration.ca_cert_data)
        else:
            context.load_verify_locations(cafile=certifi.where())
        context.check_hostname = configuration.assert_hostname is not False
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context
