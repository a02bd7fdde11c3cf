"""One HTTP/1.1 exchange on a connection the caller holds: the request's bytes, and its response
read and framed as RFC 9112 says.

Place in the flow: keepalive.py's :class:`~dra_driver.kube.keepalive.KeepAliveGetter` pools the
connections of the prepare path's claim GET and status apply; it builds each request here
(:func:`request_line`, :func:`header_block`, :func:`encode_request`) and reads its answer with
:func:`exchange`. Nothing here opens, keeps or closes a connection.

Why not a library: plain ``http.client``, whose header parsing goes through the ``email``
package, cost about 0.5 ms of CPU per GET inside a prepare on a small node VM
(bench/bench_prepare.py), the whole keep-alive path with this reader about 0.2 ms (keepalive.py
has the measurements against the official client, and the rule they answer). ``httptools``, the
llhttp parser, was as fast but adds 0.26 MiB to an agent whose memory target has 0.5 MiB to
spare. What this reader does: a response body framed by ``Content-Length``, chunked (extensions
and trailer fields read and ignored), or the end of the connection; interim 1xx answers skipped;
keep-alive as HTTP/1.1 and 1.0 state it; anything malformed refused. What it leaves out, as the
API calls it serves never need it: compressed bodies (every request says
``Accept-Encoding: identity``), protocol switches (101 is an error), answers over
``MAX_RESPONSE_BYTES``.

A request target and header fields are checked so that none can end the request line or a
header early (ValueError). Every wait on the socket is given what is left of the caller's
deadline, so a server that sends one byte every half second cannot hold the exchange past it.
"""

from __future__ import annotations

import http.client
import re
import socket
import time

# Far above any object the API server stores (etcd refuses requests over 1.5 MiB): a response
# this big is not a ResourceClaim, and reading on would only grow memory.
MAX_RESPONSE_BYTES = 64 * 2**20

_RECV_BYTES = 64 * 1024
_MAX_HEAD_BYTES = 64 * 1024
_MAX_LINE_BYTES = 4 * 1024
# A request target and header fields must not be able to end the request line or a header early.
_UNSAFE = re.compile(r"[\x00-\x20\x7f]")
_UNSAFE_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_STATUS = re.compile(rb"[1-5][0-9][0-9]")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # a header field name (RFC 9110 token)
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,15}")


def remaining(deadline: float) -> float:
    """Seconds left before ``deadline`` (a ``time.monotonic()`` value); TimeoutError when none
    are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


# -- the request ------------------------------------------------------------------------------


def request_line(method: str, path: str) -> bytes:
    """``METHOD path HTTP/1.1`` and its CRLF; ValueError for a path that is not an
    origin-form target or could end the line early."""
    if not path.startswith("/") or _UNSAFE.search(path):
        raise ValueError(f"not a valid request path: {path!r}")
    return b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), path.encode("ascii"))


def header_block(*, host: str, fields: tuple[tuple[str, str], ...]) -> bytes:
    """The header lines of a request, ``Host`` and ``Accept-Encoding: identity`` (a body is
    never compressed) first, each ended by CRLF; ValueError for a name or value that could end
    a header early. The blank line that ends the head is :func:`encode_request`'s (a body's
    length goes before it)."""
    lines = [f"Host: {host}", "Accept-Encoding: identity"]
    for name, value in fields:
        if not name or _UNSAFE.search(name) or ":" in name:
            raise ValueError(f"not a valid header name: {name!r}")
        if _UNSAFE_VALUE.search(str(value)):
            raise ValueError(f"header {name} has a value that is not allowed in HTTP")
        lines.append(f"{name}: {value}")
    # latin-1, as http.client encodes header values
    return ("\r\n".join(lines) + "\r\n").encode("latin-1")


def encode_request(line: bytes, block: bytes, *, body: bytes | None) -> bytes:
    """The whole request: ``line``, ``block``, ``Content-Length`` unless ``body`` is None (a
    GET), the blank line, the body."""
    if body is None:
        return line + block + b"\r\n"
    return line + block + b"Content-Length: %d\r\n\r\n" % len(body) + body


# -- the response -----------------------------------------------------------------------------


def exchange(sock: socket.socket, request: bytes, deadline: float) -> tuple[int, bytes, bool]:
    """Send ``request``, read its whole response by ``deadline``: (status, body, whether to
    keep the connection), framed as HTTP/1.1 says (RFC 9112 section 6.3). A close before any
    byte of the answer is ``http.client.RemoteDisconnected``; a malformed, truncated or
    oversized answer is another ``http.client.HTTPException``; a passed deadline is
    ``TimeoutError``."""
    sock.settimeout(remaining(deadline))  # sendall: a bound on the whole send
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
        self._sock.settimeout(remaining(self._deadline))
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


def _malformed(what: str) -> http.client.HTTPException:
    return http.client.HTTPException(f"malformed response from the API server: {what}")


def _check_size(size: int) -> None:
    if size > MAX_RESPONSE_BYTES:
        raise http.client.HTTPException(
            f"response larger than {MAX_RESPONSE_BYTES} bytes: not a ResourceClaim"
        )
