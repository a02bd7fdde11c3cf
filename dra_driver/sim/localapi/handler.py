"""The local API server's HTTP side: ``Server`` accepts connections, ``Handler`` answers each
request (authentication, discovery, fault injection, the verbs get/list/create/update/delete
and watch) against the ``FakeKubeApi`` its class is bound to. Paths and verbs come from
routing.py; objects are converted by conversion.py; slices are admitted by slices.py."""

from __future__ import annotations

import json
import random
import socket
import ssl
import sys
import time
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dra_driver.sim.localapi import claimstatus
from dra_driver.sim.localapi.conversion import to_storage, to_version
from dra_driver.sim.localapi.resources import (
    KINDS,
    ApiError,
    JsonDict,
    Route,
    api_version,
    failure_status,
    group_of,
    not_found,
    now,
)
from dra_driver.sim.localapi.routing import discovery, route_of, verb_of
from dra_driver.sim.localapi.selectors import matches
from dra_driver.sim.localapi.slices import admit_slice
from dra_driver.sim.localapi.store import Event, Request, ServedApi

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the real generator's alphabet


class Server(ThreadingHTTPServer):
    """The listening socket; one thread per connection."""

    # socketserver's default listen backlog is 5: sixteen clients connecting at once would see
    # SYNs dropped and retried a second later. Go's net/http, like the real API server, listens
    # with the system maximum.
    request_queue_size = socket.SOMAXCONN

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-handshake or mid-request (an agent being killed, a TLS
        # probe) is normal here; anything else is still printed.
        if not isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    """One connection's requests; ``FakeKubeApi.start`` binds a subclass to its server."""

    api: ServedApi
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes; with Nagle on, the body would wait for the
    # client's delayed ACK (~40 ms a request). Go's net/http turns Nagle off too.
    disable_nagle_algorithm = True
    # Buffered writes, flushed once an answer is whole (and after each watch event): head and
    # body of a small answer leave in one write, as Go's net/http sends them, so a client gets
    # the whole answer at once instead of waking up for each half.
    wbufsize = 64 * 1024

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def parse_request(self) -> bool:
        # Called once the request line is read: the request has arrived.
        self._arrived = time.perf_counter()
        return super().parse_request()

    def setup(self) -> None:
        super().setup()
        with self.api._cond:
            self.api._connections.add(self.connection)
            self.api.connections_accepted += 1

    def finish(self) -> None:
        with self.api._cond:
            self.api._connections.discard(self.connection)
        super().finish()

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    # --- dispatch --------------------------------------------------------------------------------

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        body = self._read_body()
        api = self.api
        try:
            # Like the API server's bearer-token authenticator, the scheme is case-insensitive
            # (the official client's in-cluster loader sends "bearer <token>").
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if api.token and (scheme.lower() != "bearer" or token != api.token):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            found = discovery(url.path, api)
            if found is not None:
                api.requests.append(Request("get", "", "", url.path))
                self._send(200, found)
                return
            route = route_of(url.path, api)
            verb = verb_of(method, route, query)
            api.requests.append(Request(verb, route.logged, route.namespace, route.name))
            fault = api._take_fault(verb, route.logged, route.name)
            if fault is not None and fault.body is not None:
                self._send_bytes(fault.status, fault.body)
                return
            if fault is not None:
                reasons = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Gone"}
                raise ApiError(
                    fault.status, reasons.get(fault.status, "InternalError"), fault.message
                )
            if verb == "watch":
                self._watch(route, query)
                return
            if route.subresource:
                status, out = self._serve_status(verb, route, query, body)
            else:
                status, out = self._serve(verb, route, query, body)
            if verb != "get":
                self._send(status, out)
                return
            data = json.dumps(out).encode()
            # The sleep ends early by what waking up and sending take (the interpreter lock,
            # TLS), learnt as it goes: each answer later than asked moves the end 2 us earlier,
            # each earlier one 2 us later, so half the answers leave later than asked and half
            # earlier (the median of the latency is what was asked).
            left = self._arrived + api.get_latency_s - api._send_s - time.perf_counter()
            if left > 0:
                time.sleep(left)
            self._send_bytes(status, data)
            self.wfile.flush()
            took = time.perf_counter() - self._arrived
            api.get_seconds.append(took)
            api._send_s += 2e-6 if took > api.get_latency_s else -2e-6
        except ApiError as exc:
            self._send(exc.status, failure_status(exc.status, exc.reason, exc.message))

    def _read_body(self) -> JsonDict | None:
        length = int(self.headers.get("Content-Length") or 0)
        if not length:
            return None
        data = self.rfile.read(length)
        return json.loads(data) if data else None

    def _send(self, status: int, payload: Mapping[str, Any]) -> None:
        self._send_bytes(status, json.dumps(payload).encode())

    def _send_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    # --- verbs -----------------------------------------------------------------------------------

    def _serve(
        self, verb: str, route: Route, query: Mapping[str, str], body: JsonDict | None
    ) -> tuple[int, JsonDict]:
        api = self.api
        key = (route.resource, route.namespace, route.name)
        kind = KINDS[route.resource][0]
        with api._cond:
            if verb == "get":
                obj = api._state.objects.get(key)
                if obj is None:
                    raise not_found(route)
                return 200, to_version(route, obj, with_type=True)
            if verb == "list":
                items = [
                    to_version(route, o, with_type=False)
                    for (r, ns, _), o in sorted(api._state.objects.items())
                    if r == route.resource
                    and (not route.namespace or ns == route.namespace)
                    and matches(route.resource, o, query)
                ]
                return 200, {
                    "kind": f"{kind}List",
                    "apiVersion": api_version(route),
                    "metadata": {"resourceVersion": str(api._state.rv)},
                    "items": items,
                }
            if verb == "create":
                return 201, self._create(route, body)
            if verb == "update":
                return 200, self._update(route, body)
            if verb == "delete":
                return 200, self._delete(route, body)
        raise ApiError(405, "MethodNotAllowed", f"{verb} is not supported by the fake API server")

    def _serve_status(
        self, verb: str, route: Route, query: Mapping[str, str], body: JsonDict | None
    ) -> tuple[int, JsonDict]:
        """GET, apply PATCH and PUT of a ResourceClaim's status subresource (claimstatus.py)."""
        api = self.api
        key = (route.resource, route.namespace, route.name)
        with api._cond:
            stored = api._state.objects.get(key)
            if stored is None:
                raise not_found(route)
            if verb == "get":
                return 200, to_version(route, stored, with_type=True)
            owners = api._status_owners.setdefault(key, {})
            if verb == "patch":
                content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
                if content_type != claimstatus.APPLY_PATCH:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        f"the local API server applies only {claimstatus.APPLY_PATCH} to "
                        f"status, not {content_type!r}",
                    )
                if not query.get("fieldManager"):
                    raise ApiError(
                        422,
                        "Invalid",
                        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: '
                        "Required value: is required for apply patch",
                    )
                new = claimstatus.apply_status(
                    stored, to_storage(route, _require_body(body)),
                    manager=query["fieldManager"], force=query.get("force") == "true",
                    owners=owners, enabled=api.device_status,
                )  # fmt: skip
            elif verb == "update":
                sent = to_storage(route, _require_body(body))
                rv = (sent.get("metadata") or {}).get("resourceVersion")
                if rv and rv != stored["metadata"]["resourceVersion"]:
                    raise ApiError(409, "Conflict", "the object has been modified")
                new = claimstatus.replace_status(stored, sent, enabled=api.device_status)
                owners.clear()
            else:
                raise ApiError(405, "MethodNotAllowed", f"{verb} on resourceclaims/status")
            if new != stored:
                new["metadata"] = dict(stored["metadata"])
                api._store(route.resource, key, new, "MODIFIED")
            return 200, to_version(route, new, with_type=True)

    def _create(self, route: Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        obj = to_storage(route, _require_body(body))
        meta = obj.setdefault("metadata", {})
        if route.namespace:
            meta["namespace"] = route.namespace
        if not meta.get("name"):
            prefix = str(meta.get("generateName") or "")
            if not prefix:
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            suffix = "".join(random.choices(_NAME_CHARS, k=5))  # noqa: S311 (names, not secrets)
            meta["name"] = prefix[:58] + suffix
        key = (route.resource, route.namespace, meta["name"])
        if key in api._state.objects:
            raise ApiError(
                409, "AlreadyExists", f'{route.resource} "{meta["name"]}" already exists'
            )
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        meta["generation"] = 1
        if route.resource == "resourceslices":
            self._admit_slice(obj, old=None)
        api._store(route.resource, key, obj, "ADDED")
        return to_version(route, obj, with_type=True)

    def _update(self, route: Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        obj = to_storage(route, _require_body(body))
        key = (route.resource, route.namespace, route.name)
        old = api._state.objects.get(key)
        if old is None:
            raise not_found(route)
        meta = obj.setdefault("metadata", {})
        if meta.get("name") != route.name:
            raise ApiError(400, "BadRequest", "the name of the object does not match the URL")
        if not meta.get("resourceVersion"):
            raise ApiError(
                422, "Invalid", "metadata.resourceVersion: must be specified for an update"
            )
        if meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f"Operation cannot be fulfilled on {route.resource}.{group_of(route.resource)} "
                f'"{route.name}": the object has been modified; please apply your changes to the '
                "latest version and try again",
            )
        for kept in ("uid", "creationTimestamp"):
            meta[kept] = old["metadata"][kept]
        if route.namespace:
            meta["namespace"] = route.namespace
        changed = obj.get("spec") != old.get("spec")
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if changed else 0)
        if route.resource == "resourceslices":
            self._admit_slice(obj, old=old)
        api._store(route.resource, key, obj, "MODIFIED")
        return to_version(route, obj, with_type=True)

    def _delete(self, route: Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        key = (route.resource, route.namespace, route.name)
        old = api._state.objects.get(key)
        if old is None:
            raise not_found(route)
        pre = (body or {}).get("preconditions") or {}
        for field_name in ("uid", "resourceVersion"):
            if pre.get(field_name) and pre[field_name] != old["metadata"][field_name]:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: {field_name}: {pre[field_name]}, "
                    f"object {field_name}: {old['metadata'][field_name]}",
                )
        return to_version(route, api._remove(key), with_type=True)

    def _admit_slice(self, obj: JsonDict, *, old: JsonDict | None) -> None:
        self.api._drop(obj)
        admit_slice(obj, old=old, validate=self.api.validate)

    def _watch(self, route: Route, query: Mapping[str, str]) -> None:
        api = self.api
        rv_text = query.get("resourceVersion", "")
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()  # the client's watch call returns on the headers
        deadline = time.monotonic() + timeout_s
        # A watch that ends on its own (timeout, 410) leaves the connection open for the next
        # request, as a real API server does (Go's net/http keeps it alive after a complete
        # chunked answer); closing it unannounced made a client reuse a dying connection.
        broken = False
        try:
            with api._cond:
                if rv_text in ("", "0"):
                    start = api._state.rv
                    initial = [
                        Event(int(o["metadata"]["resourceVersion"]), r, "ADDED", o)
                        for (r, _, _), o in sorted(api._state.objects.items())
                        if r == route.resource
                    ]
                else:
                    start = int(rv_text)
                    initial = []
                    if start < api._state.compacted_rv:
                        self._chunk(
                            {
                                "type": "ERROR",
                                "object": failure_status(
                                    410, "Expired", f"too old resource version: {start}"
                                ),
                            }
                        )
                        return
            for event in initial:
                self._emit(route, event, query)
            last = start
            while True:
                with api._cond:
                    pending = [e for e in api._state.history if e.rv > last]
                    while not pending and not api._closing:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        api._cond.wait(min(left, 0.5))
                        pending = [e for e in api._state.history if e.rv > last]
                    closing, current = api._closing, api._state.rv
                for event in pending:
                    last = event.rv
                    if event.resource == route.resource:
                        self._emit(route, event, query)
                if closing:
                    return
                if not pending and time.monotonic() >= deadline:
                    if bookmarks:
                        kind = KINDS[route.resource][0]
                        self._chunk(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": kind,
                                    "apiVersion": api_version(route),
                                    "metadata": {"resourceVersion": str(current)},
                                },
                            }
                        )
                    return
        except (BrokenPipeError, ConnectionResetError):
            broken = True
            return
        finally:
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                broken = True
            if broken or api._closing:
                self.close_connection = True

    def _emit(self, route: Route, event: Event, query: Mapping[str, str]) -> None:
        if route.namespace and event.obj["metadata"].get("namespace") != route.namespace:
            return
        if not matches(route.resource, event.obj, query):
            return
        self._chunk({"type": event.type, "object": to_version(route, event.obj, with_type=True)})

    def _chunk(self, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


def _require_body(body: JsonDict | None) -> JsonDict:
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "request body must be a JSON object")
    return body
