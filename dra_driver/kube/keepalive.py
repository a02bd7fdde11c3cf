"""Keep-alive requests for the API calls made once per claim, on the official client's settings.

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
through the ``email`` package, about 0.5 ms, and this module about 0.2 ms.) Here a request is one
``sendall`` of bytes whose header block is built once per set of headers, and the response is
read by a small HTTP/1.1 reader that frames a body as RFC 9112 says: ``Content-Length``, chunked
(extensions and trailer fields read and ignored), ending with the connection; interim 1xx answers
skipped; keep-alive as HTTP/1.1 and 1.0 state it; anything malformed refused. (``httptools``,
the llhttp parser, was as fast but adds 0.26 MiB to an agent whose memory target has 0.5 MiB to
spare.)

What stays the official client's: the host, the TLS settings (CA file or data, client
certificate, ``verify_ssl``, ``tls_server_name``, ``assert_hostname=False``) and the request
headers, which kube/ asks the client for on every request (so a refreshed ServiceAccount token
is used). A configuration this module does not handle exactly as the official client would (a
proxy in use, custom socket options, a non-boolean ``assert_hostname``) makes
:meth:`KeepAliveGetter.for_configuration` return None, and the caller keeps the official path.

Rotated TLS files: the files the configuration names (``ssl_ca_cert``, which is the in-cluster
ServiceAccount's ``ca.crt`` in a Pod or a kubeconfig's ``certificate-authority``; ``cert_file``
and ``key_file``, the client certificate) are looked at with ``os.stat`` at most once a second,
by the GET that comes due; the paths are read from the configuration each time, since a
kubeconfig's refresh hook may set new ones. When a path, inode (a Secret volume update swaps a
symlink), size or modification time changed, the SSLContext is built again and the idle
connections made with the old one are closed (one still in use is closed when it comes back):
a connection made with the old client certificate would go on presenting it. A rebuild that
fails (a rotation half done: a new certificate beside the old key) keeps the old context, logs a
warning once, and is tried again at the next check. (urllib3 reads the files again for every new
connection, but keeps the connections it pooled with the old ones.) Certificate data given inline
(``ca_cert_data``) cannot change.

The deadline: ``timeout_s`` (10 s by default; kube/ passes its own ``timeout_s``) bounds a
whole GET, connect, TLS handshake, request and the whole answer, a retry included. Every wait on
the socket is given what is left of it, so a server that sends one byte every half second cannot
hold a prepare (the kubelet gives a NodePrepareResources call 45 s in all) past it. Only name
resolution is not bounded (``getaddrinfo`` cannot be interrupted; in a Pod the API server is an
IP address). A passed deadline is ``TimeoutError``, naming the limit.

Transport failures are raised as they come (``OSError``, ``ssl.SSLError``,
``http.client.HTTPException`` for a response that breaks the protocol, ``TimeoutError``); the
caller maps them. There is one retry, the one every HTTP client makes: a GET (or an apply, which
with ``force`` sets the same fields however often it is sent) on a reused connection that the
server closed while it sat idle is sent again on a new connection, within the same deadline. A
timeout is never retried.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import select
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import certifi
from urllib3.exceptions import InsecureRequestWarning

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

# Far above any object the API server stores (etcd refuses requests over 1.5 MiB): a response
# this big is not a ResourceClaim, and reading on would only grow memory.
MAX_RESPONSE_BYTES = 64 * 2**20

_RECV_BYTES = 64 * 1024
_HEADER_BLOCKS = 4  # kept, one per set of headers (a GET's, a PATCH's; per token)
# A request target and header fields must not be able to end the request line or a header early.
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True)
class TlsSource:
    """Where a getter's TLS settings come from. ``context()`` builds them from the files (and
    data) they name; ``files()`` names those files as of now (the paths may change too: a
    kubeconfig's refresh hook sets them again). A getter builds a new context, and drops its
    idle connections, when a file named changes."""

    context: Callable[[], ssl.SSLContext]
    files: Callable[[], tuple[str, ...]] = tuple


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
        self._tls_files_state = _files_state(tls.files()) if tls is not None else ()
        self._tls_failed_state: tuple[_FileState, ...] | None = None
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
        tls = None
        if url.scheme == "https":
            tls = TlsSource(
                context=lambda: _tls_context(configuration),
                files=lambda: _tls_files(configuration),
            )
        return cls(
            host=url.hostname,
            port=url.port or (443 if url.scheme == "https" else 80),
            tls=tls,
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
            status, body, keep = _exchange(sock, request, deadline)
        except _CLOSED_WHILE_IDLE:
            sock.close()
            if not reused:
                raise
            sock, generation = self._connect(deadline)
            try:
                status, body, keep = _exchange(sock, request, deadline)
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
            state = _files_state(self._tls_source.files())
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
        """The request's bytes. ``Accept-Encoding: identity``: a body is never compressed."""
        if not path.startswith("/") or _UNSAFE.search(path):
            raise ValueError(f"not a valid request path: {path!r}")
        key = tuple(headers.items())
        with self._lock:
            block = self._header_blocks.get(key)
            if block is None:
                if len(self._header_blocks) >= _HEADER_BLOCKS:
                    self._header_blocks.clear()  # a rotated token's: not sent again
                block = self._header_blocks[key] = self._encode_headers(key)
        line = b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), path.encode("ascii"))
        length = b"" if method == "GET" else b"Content-Length: %d\r\n" % len(body)
        return line + block + length + b"\r\n" + body

    def _encode_headers(self, headers: tuple[tuple[str, str], ...]) -> bytes:
        lines = [f"Host: {self._host_header}", "Accept-Encoding: identity"]
        for name, value in headers:
            if not name or _UNSAFE.search(name) or ":" in name:
                raise ValueError(f"not a valid header name: {name!r}")
            if _UNSAFE_VALUE.search(str(value)):
                raise ValueError(f"header {name} has a value that is not allowed in HTTP")
            lines.append(f"{name}: {value}")
        # latin-1, as http.client encodes header values; the blank line that ends the head is
        # the caller's (a body's length goes before it)
        return ("\r\n".join(lines) + "\r\n").encode("latin-1")

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
            (self.host, self.port), timeout=min(self._connect_timeout_s, _remaining(deadline))
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
                sock.settimeout(_remaining(deadline))  # bounds the whole handshake
                sock = context.wrap_socket(sock, server_hostname=self._server_hostname)
        except BaseException:
            sock.close()
            raise
        return sock, generation


def _remaining(deadline: float) -> float:
    """Seconds left before ``deadline``; TimeoutError when none are."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("deadline passed")
    return remaining


class _Reader:
    """The bytes of one connection, read as a response needs them."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline
        self.buffer = bytearray()
        self.received = 0

    def _fill(self) -> bool:
        """Read what the server sent next; False at the end of the connection. The wait is
        bounded by what is left of the deadline, not by a time per read: a server that sends a
        byte at a time cannot hold the GET past it."""
        self._sock.settimeout(_remaining(self._deadline))
        data = self._sock.recv(_RECV_BYTES)
        self.received += len(data)
        self.buffer += data
        return bool(data)

    def head(self) -> tuple[bytes, int, dict[bytes, list[bytes]]]:
        """Status line and header fields: (version, status, {lower-case name: values})."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD_BYTES:
                raise _malformed(f"a response head longer than {_MAX_HEAD_BYTES} bytes")
            if not self._fill():
                if self.received == 0:
                    raise http.client.RemoteDisconnected(
                        "the API server closed the connection without an answer"
                    )
                raise http.client.IncompleteRead(bytes(self.buffer))
        lines = bytes(self.buffer[:end]).split(b"\r\n")
        del self.buffer[: end + 4]
        version, _, rest = lines[0].partition(b" ")
        code = rest.partition(b" ")[0]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not _STATUS.fullmatch(code):
            raise _malformed(f"status line {lines[0][:80]!r}")
        fields: dict[bytes, list[bytes]] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not _TOKEN.fullmatch(name):
                raise _malformed(f"header line {line[:80]!r}")
            fields.setdefault(name.lower(), []).append(value.strip(b" \t"))
        return version, int(code), fields

    def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            if not self._fill():
                raise http.client.IncompleteRead(bytes(self.buffer), size - len(self.buffer))
        data = bytes(self.buffer[:size])
        del self.buffer[:size]
        return data

    def line(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_LINE_BYTES:
                raise _malformed(f"a line longer than {_MAX_LINE_BYTES} bytes in a chunked body")
            if not self._fill():
                raise http.client.IncompleteRead(bytes(self.buffer))
        data = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return data

    def chunked(self) -> bytes:
        """A chunked body: chunks up to the last (size 0), then trailer fields (ignored)."""
        chunks: list[bytes] = []
        total = 0
        while True:
            size_text = self.line().split(b";", 1)[0].strip(b" \t")
            if not _CHUNK_SIZE.fullmatch(size_text):
                raise _malformed(f"chunk size {size_text[:20]!r}")
            size = int(size_text, 16)
            if size == 0:
                break
            total += size
            _check_size(total)
            chunks.append(self.exactly(size))
            if self.exactly(2) != b"\r\n":
                raise _malformed("a chunk not followed by CRLF")
        while self.line():
            pass
        return b"".join(chunks)

    def until_close(self) -> bytes:
        while self._fill():
            _check_size(len(self.buffer))
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


_STATUS = re.compile(rb"[1-5][0-9][0-9]")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header field name (RFC 9110 token)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")
_MAX_HEAD_BYTES = 64 * 1024
_MAX_LINE_BYTES = 4 * 1024


def _malformed(what: str) -> http.client.HTTPException:
    return http.client.HTTPException(f"malformed response from the API server: {what}")


def _check_size(size: int) -> None:
    if size > MAX_RESPONSE_BYTES:
        raise http.client.HTTPException(
            f"response larger than {MAX_RESPONSE_BYTES} bytes: not a ResourceClaim"
        )


def _exchange(sock: socket.socket, request: bytes, deadline: float) -> tuple[int, bytes, bool]:
    """Send ``request``, read its whole response by ``deadline``: (status, body, whether to
    keep the connection), framed as HTTP/1.1 says (RFC 9112 section 6.3). A close before any
    byte of the answer is ``http.client.RemoteDisconnected``; a malformed, truncated or
    oversized answer is another ``http.client.HTTPException``; a passed deadline is
    ``TimeoutError``."""
    sock.settimeout(_remaining(deadline))  # sendall: a bound on the whole send
    sock.sendall(request)
    reader = _Reader(sock, deadline)
    version, status, fields = reader.head()
    while 100 <= status < 200:  # interim answers (100 Continue, 103 Early Hints)
        if status == 101:
            raise http.client.HTTPException("the API server switched protocols on a plain request")
        version, status, fields = reader.head()
    until_close = False
    codings = [
        c.strip().lower() for v in fields.get(b"transfer-encoding", ()) for c in v.split(b",")
    ]
    if status in (204, 304):
        body = b""
    elif codings and codings[-1] == b"chunked":
        body = reader.chunked()
    elif codings:  # a coding other than chunked last: the body ends with the connection
        body, until_close = reader.until_close(), True
    elif b"content-length" in fields:
        lengths = {n.strip() for v in fields[b"content-length"] for n in v.split(b",")}
        size_text = lengths.pop() if len(lengths) == 1 else b""
        if not size_text.isdigit():
            raise _malformed(f"Content-Length {b', '.join(fields[b'content-length'])[:40]!r}")
        _check_size(int(size_text))
        body = reader.exactly(int(size_text))
    else:
        body, until_close = reader.until_close(), True
    tokens = {t.strip().lower() for v in fields.get(b"connection", ()) for t in v.split(b",")}
    persistent = b"close" not in tokens if version == b"HTTP/1.1" else b"keep-alive" in tokens
    # bytes after the answer: the connection is out of step, never reuse it
    return status, body, persistent and not until_close and not reader.buffer


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


_FileState = tuple[str, int, int, int, int]


def _files_state(paths: tuple[str, ...]) -> tuple[_FileState, ...]:
    """What says a file changed: path, device, inode (a Secret volume swaps a symlink to a new
    file), size and modification time; -1s for a file that cannot be looked at."""
    states = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            states.append((path, -1, -1, -1, -1))
        else:
            states.append((path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(states)


def _tls_files(configuration: Any) -> tuple[str, ...]:
    """The files the TLS settings of a configuration are read from: the CA file
    (``ssl_ca_cert``: a kubeconfig's ``certificate-authority``, or the in-cluster
    ServiceAccount's ``ca.crt``), the client certificate and its key."""
    paths = (configuration.ssl_ca_cert, configuration.cert_file, configuration.key_file)
    return tuple(str(p) for p in paths if p)


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
