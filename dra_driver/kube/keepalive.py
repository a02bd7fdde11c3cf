"""Keep-alive requests for the API calls made once per claim, on the official client's settings:
a small pool of connections to the API server, and when to rebuild their TLS settings.

Place in the flow: kube/ sends the ResourceClaim GET of every NodePrepareResources, and the
status apply claimstatus/ makes per claim (0.7 ms of CPU a write through the official client, 0.2
here), through :class:`KeepAliveGetter`; every other call goes through the official client.

Why these calls do not: the official client's request path (ApiClient, RESTClientObject,
urllib3's PoolManager, connection pool and response object) costs several times the CPU of this
one. bench/bench_claim_get.py measures the whole ``KubeClient.get_resource_claim`` both ways on one
kept-alive connection, the local API server in its own process (2-core development VM, Python
3.11, median of 30 batches of 100 GETs):

    per GET                  CPU, HTTP   wall, HTTP   CPU, HTTPS   wall, HTTPS
    this module              0.075 ms    0.236 ms     0.099 ms     0.272 ms
    official client          0.326 ms    0.504 ms     0.358 ms     0.545 ms
    gain                     0.251 ms    0.268 ms     0.258 ms     0.273 ms

well above the 0.1 ms per GET under which the official client would do (issue 10), out of a 3 ms
budget for the whole prepare. (Inside a prepare on a small node VM, bench/bench_prepare.py, the
official client's path cost about 0.9 ms of CPU, plain ``http.client``, whose header parsing goes
through the ``email`` package, about 0.5 ms, and this path about 0.2 ms.) Here a request is one
``sendall`` of bytes whose header block is built once per set of headers, and the response is
read by a small HTTP/1.1 reader; both are http1.py's, which says what the reader does, what it
leaves out, and why it is not ``http.client`` or ``httptools``.

What stays the official client's: the host, the TLS settings (CA file or data, client
certificate, ``verify_ssl``, ``tls_server_name``, ``assert_hostname=False``; tlssettings.py
builds them as the official client does) and the request
headers, which kube/ asks the client for on every request (so a refreshed ServiceAccount token
is used). A configuration this module does not handle exactly as the official client would (a
proxy in use, custom socket options, a non-boolean ``assert_hostname``) makes
:meth:`KeepAliveGetter.for_configuration` return None, and the caller keeps the official path.

Rotated TLS files: the files the configuration names (the CA file and the client certificate
and key; tlssettings.py says which, and what counts as a change) are looked at with ``os.stat``
at most once a second, by the GET that comes due. When one changed, the SSLContext is built
again and the idle connections made with the old one are closed (one still in use is closed when
it comes back): a connection made with the old client certificate would go on presenting it. A
rebuild that fails (a rotation half done: a new certificate beside the old key) keeps the old
context, logs a warning once, and is tried again at the next check. (urllib3 reads the files
again for every new connection, but keeps the connections it pooled with the old ones.)

The deadline: ``timeout_s`` (10 s by default; kube/ passes its own ``timeout_s``) bounds a
whole GET, connect, TLS handshake, request and the whole answer, a retry included. Every wait on
the socket (here and in http1.py's reader) is given what is left of it, so a server that sends
one byte every half second cannot hold a prepare (the kubelet gives a NodePrepareResources call
45 s in all) past it. Only name resolution is not bounded (``getaddrinfo`` cannot be
interrupted; in a Pod the API server is an IP address). A passed deadline is ``TimeoutError``,
naming the limit.

Transport failures are raised as they come (``OSError``, ``ssl.SSLError``,
``http.client.HTTPException`` for a response that breaks the protocol, ``TimeoutError``); the
caller maps them. There is one retry, the one every HTTP client makes: a GET (or an apply, which
with ``force`` sets the same fields however often it is sent) on a reused connection that the
server closed while it sat idle is sent again on a new connection, within the same deadline. A
timeout is never retried.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from urllib3.exceptions import InsecureRequestWarning

from dra_driver.kube import http1
from dra_driver.kube.tlssettings import FileState, TlsSource, files_state

log = logging.getLogger(__name__)

# The kubelet gives a whole NodePrepareResources call 45 s (and retries it); one GET must fail
# well before, so that the prepare can still answer with an error the kubelet reports.
DEFAULT_TIMEOUT_S = 10.0
# How often, at most, a GET looks at the TLS files (three stat calls, a few microseconds).
TLS_CHECK_INTERVAL_S = 1.0

# What a server that closed an idle keep-alive connection looks like to the next request on it.
# (http.client.RemoteDisconnected, raised for a close before any byte of the answer, is a
# ConnectionResetError.)
_CLOSED_WHILE_IDLE = (ConnectionResetError, BrokenPipeError)

_HEADER_BLOCKS = 4  # kept, one per set of headers (a GET's, a PATCH's; per token)


class KeepAliveGetter:
    """GET and PATCH over a small pool of keep-alive connections to one API server; thread-safe."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        tls: TlsSource | None,
        server_hostname: str | None = None,
        connect_timeout_s: float,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls_check_interval_s: float = TLS_CHECK_INTERVAL_S,
        max_idle: int = 16,
    ) -> None:
        """``timeout_s`` bounds a whole GET: connect, TLS handshake, request, whole answer
        (``connect_timeout_s`` bounds the connect alone). ``tls``: None for plain HTTP; its
        files are looked at (``os.stat``) at most every ``tls_check_interval_s``."""
        self.host = host
        self.port = port
        self._server_hostname = server_hostname or host
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        # (socket, generation of the TLS context it was made with)
        self._idle: list[tuple[socket.socket, int]] = []
        self._lock = threading.Lock()
        self._closed = False
        # TLS: the context and its generation, replaced together (one attribute, read at once)
        self._tls_source = tls
        self._tls_check_interval_s = tls_check_interval_s
        self._tls_lock = threading.Lock()  # one thread at a time looks at the files
        self._tls_files_state = files_state(tls.files()) if tls is not None else ()
        self._tls_failed_state: tuple[FileState, ...] | None = None
        self._tls: tuple[ssl.SSLContext | None, int] = (
            tls.context() if tls is not None else None,
            0,
        )
        self._next_tls_check = time.monotonic() + tls_check_interval_s
        default_port = 443 if tls is not None else 80
        authority = f"[{host}]" if ":" in host else host  # an IPv6 literal goes in brackets
        self._host_header = authority if port == default_port else f"{authority}:{port}"
        # The header block of each set of headers seen: they change only when a token rotates.
        self._header_blocks: dict[tuple[tuple[str, str], ...], bytes] = {}

    @classmethod
    def for_configuration(
        cls,
        configuration: Any,
        *,
        connect_timeout_s: float,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls_check_interval_s: float = TLS_CHECK_INTERVAL_S,
    ) -> KeepAliveGetter | None:
        """A getter for a ``kubernetes.client.Configuration``, or None where this module would
        not connect exactly as the official client does (then the caller keeps that client).
        Its TLS settings are rebuilt from the configuration when a file it names changes."""
        url = urlsplit(configuration.host)
        if url.scheme not in ("http", "https") or not url.hostname:
            return None
        if configuration.proxy and not _bypasses_proxy(configuration):
            return None
        if configuration.socket_options is not None or getattr(configuration, "keep_alive", False):
            return None
        if configuration.assert_hostname not in (None, False):
            return None
        https = url.scheme == "https"
        return cls(
            host=url.hostname,
            port=url.port or (443 if https else 80),
            tls=TlsSource.for_configuration(configuration) if https else None,
            server_hostname=configuration.tls_server_name or None,
            connect_timeout_s=connect_timeout_s,
            timeout_s=timeout_s,
            tls_check_interval_s=tls_check_interval_s,
        )

    def get(self, path: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """``GET path``: the status and the whole body. ``TimeoutError`` when the whole GET
        (a retry included) takes longer than ``timeout_s``."""
        return self.request("GET", path, headers)

    def request(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes = b""
    ) -> tuple[int, bytes]:
        """As :meth:`get`, for ``method`` (GET, or PATCH with ``body``: retried as a GET is, so
        only a request that may be sent twice)."""
        now = time.monotonic()
        deadline = now + self._timeout_s
        request = self._request(method, path, headers, body)
        if self._tls_source is not None and now >= self._next_tls_check:
            self._check_tls_files()
        try:
            return self._get(request, deadline)
        except TimeoutError as exc:
            raise TimeoutError(
                f"no whole answer from the API server within {self._timeout_s:g} s ({exc})"
            ) from exc

    def _get(self, request: bytes, deadline: float) -> tuple[int, bytes]:
        sock, generation, reused = self._checkout(deadline)
        try:
            status, body, keep = http1.exchange(sock, request, deadline)
        except _CLOSED_WHILE_IDLE:
            sock.close()
            if not reused:
                raise
            sock, generation = self._connect(deadline)
            try:
                status, body, keep = http1.exchange(sock, request, deadline)
            except BaseException:
                sock.close()
                raise
        except BaseException:
            sock.close()
            raise
        if keep:
            self._checkin(sock, generation)
        else:
            sock.close()
        return status, body

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    @property
    def idle_connections(self) -> int:
        with self._lock:
            return len(self._idle)

    # -- TLS material -----------------------------------------------------------------------

    def _check_tls_files(self) -> None:
        """Rebuild the TLS context if a file it is read from changed (path, inode, size or
        modification time), and drop the idle connections made with the old one. A rebuild
        that fails (a rotation half done: a new certificate beside the old key) keeps the old
        context and is tried again at the next check."""
        assert self._tls_source is not None
        if not self._tls_lock.acquire(blocking=False):
            return  # another GET is looking; this one goes on with the current context
        try:
            now = time.monotonic()
            if now < self._next_tls_check:
                return
            self._next_tls_check = now + self._tls_check_interval_s
            # the files' state is taken before they are read: a change after this is seen next
            state = files_state(self._tls_source.files())
            if state == self._tls_files_state:
                return
            try:
                context = self._tls_source.context()
            except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
                if state != self._tls_failed_state:
                    self._tls_failed_state = state
                    log.warning(
                        "TLS files of the API server connection changed but cannot be loaded "
                        "(keeping the previous ones, trying again): %s",
                        exc,
                        extra={"files": [s[0] for s in state]},
                    )
                return
            self._tls_files_state = state
            self._tls_failed_state = None
            with self._lock:
                self._tls = (context, self._tls[1] + 1)
                idle, self._idle = self._idle, []
        finally:
            self._tls_lock.release()
        for sock, _ in idle:
            sock.close()
        log.info(
            "reloaded the TLS files of the API server connection",
            extra={"files": [s[0] for s in state]},
        )

    # -- requests ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> bytes:
        """The request's bytes (http1.py encodes them); the header block of each set of
        headers is encoded once."""
        line = http1.request_line(method, path)
        key = tuple(headers.items())
        with self._lock:
            block = self._header_blocks.get(key)
            if block is None:
                if len(self._header_blocks) >= _HEADER_BLOCKS:
                    self._header_blocks.clear()  # a rotated token's: not sent again
                block = http1.header_block(host=self._host_header, fields=key)
                self._header_blocks[key] = block
        return http1.encode_request(line, block, body=None if method == "GET" else body)

    # -- connections ------------------------------------------------------------------------

    def _checkout(self, deadline: float) -> tuple[socket.socket, int, bool]:
        """An idle connection the server has not closed (reused: True), else a new one."""
        while True:
            with self._lock:
                sock, generation = self._idle.pop() if self._idle else (None, 0)
            if sock is None:
                return *self._connect(deadline), False
            if not _closed_by_peer(sock):
                return sock, generation, True
            sock.close()

    def _checkin(self, sock: socket.socket, generation: int) -> None:
        with self._lock:
            # a connection made with TLS files since replaced is not used again
            current = generation == self._tls[1]
            if current and not self._closed and len(self._idle) < self._max_idle:
                self._idle.append((sock, generation))
                return
        sock.close()

    def _connect(self, deadline: float) -> tuple[socket.socket, int]:
        """A new connection (TLS handshake done), and the generation of its TLS context."""
        context, generation = self._tls
        sock = socket.create_connection(
            (self.host, self.port), timeout=min(self._connect_timeout_s, http1.remaining(deadline))
        )
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if context is not None:
                if context.verify_mode == ssl.CERT_NONE:
                    warnings.warn(  # as urllib3 warns the official client's users
                        InsecureRequestWarning(
                            f"Unverified HTTPS request is being made to host '{self.host}'"
                        ),
                        stacklevel=2,
                    )
                sock.settimeout(http1.remaining(deadline))  # bounds the whole handshake
                sock = context.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            raise
        return sock, generation


def _bypasses_proxy(configuration: Any) -> bool:
    """Whether the official client sends to this host directly although a proxy is set (its
    ``no_proxy`` rules; clients too old to have them always use the proxy)."""
    try:
        from kubernetes.client.rest import should_bypass_proxies  # noqa: PLC0415
    except ImportError:
        return False
    return bool(should_bypass_proxies(configuration.host, configuration.no_proxy or ""))


def _closed_by_peer(sock: socket.socket) -> bool:
    """An idle keep-alive connection is readable only if the server closed it (or broke the
    protocol): either way it must not carry the next request."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
