"""A small Kubernetes API server on 127.0.0.1 for `make demo` and tests, used by the real client.

It implements just what the driver uses, with the semantics the driver relies on:

* discovery: ``/api``, ``/apis``, ``/apis/resource.k8s.io``, ``/apis/resource.k8s.io/<v>``; the
  served resource.k8s.io versions are configurable (``versions=("v1beta1",)`` mimics 1.32);
* ResourceSlices (cluster-scoped; v1, v1beta2 and v1beta1, whose devices are wrapped in ``basic``),
  ResourceClaims (namespaced; v1beta1 requests flat instead of under ``exactly``), DeviceClasses,
  Nodes, Events, Pods (as given; ``gpu-dra status`` lists the agent's), apps/v1 Deployments
  (stored as given; localkubelet.py runs the pods of those pinned to a node); DeviceTaintRules
  only in the versions given as ``device_taint_rule_versions``
  (none by default, as on a cluster whose DRADeviceTaintRules gate is off; ``("v1alpha3",)``
  mimics 1.33-1.35 with the gate on);
* list with ``fieldSelector`` (``spec.driver``, ``spec.nodeName``, ``spec.pool.name``,
  ``metadata.name``) and ``labelSelector`` (``k=v``, ``k!=v``, ``k``); watch as a chunked JSON event
  stream from a resourceVersion (ADDED/MODIFIED/DELETED, BOOKMARK when asked, an ERROR event with
  410 when the version is older than the compacted history, see :meth:`FakeKubeApi.compact`);
* create with ``generateName`` (random suffix, truncated like the real name generator), update
  with resourceVersion conflicts (409), delete with uid/resourceVersion preconditions;
* a ResourceSlice validation subset (limits of spec D.1), answered with 422 like the real server;
  taints get ``timeAdded`` on write, as the real server does;
* fault injection per (verb, resource): :meth:`FakeKubeApi.fail` and :meth:`FakeKubeApi.forbid`;
  :meth:`FakeKubeApi.drop_fields` simulates a feature gate being off (fields silently not stored);
* a request log of (verb, resource, namespace, name) in :attr:`FakeKubeApi.requests`, and a count
  of the connections clients opened in :attr:`FakeKubeApi.connections_accepted`.

Objects are stored in v1 shape and converted per request. This module does not import the
driver: conversions and checks here are written independently, so tests compare two readings of
the API rather than one with itself.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import shutil
import socket
import ssl
import string
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

GROUP = "resource.k8s.io"
ALL_VERSIONS = ("v1", "v1beta2", "v1beta1")
_KINDS = {
    "resourceslices": ("ResourceSlice", False),
    "resourceclaims": ("ResourceClaim", True),
    "deviceclasses": ("DeviceClass", False),
    "nodes": ("Node", False),
    "events": ("Event", True),
    "pods": ("Pod", True),
    "devicetaintrules": ("DeviceTaintRule", False),
    "deployments": ("Deployment", True),
}
_SLICE_FIELDS = ("spec.driver", "spec.nodeName", "spec.pool.name", "metadata.name")
_CORE = ("nodes", "events", "pods")  # served under /api/v1
_APPS = ("deployments",)  # served under /apis/apps/v1
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the real generator's alphabet
JsonDict = dict[str, Any]


class Request(NamedTuple):
    """One logged request. ``verb`` is the Kubernetes verb (get/list/watch/create/...)."""

    verb: str
    resource: str
    namespace: str
    name: str


def group_of(resource: str) -> str:
    """The API group of a resource this server knows ("" is the core group)."""
    if resource in _APPS:
        return "apps"
    return "" if resource in _CORE else GROUP


@dataclass
class _Fault:
    status: int
    message: str
    times: int | None  # None = until cleared


@dataclass
class _Event:
    rv: int
    resource: str
    type: str
    obj: JsonDict


@dataclass
class _State:
    objects: dict[tuple[str, str, str], JsonDict] = field(default_factory=dict)
    history: list[_Event] = field(default_factory=list)
    rv: int = 100
    compacted_rv: int = 0


# The interpreter settings the chart's DaemonSet gives the agent's container (a chart test checks
# they are the same), for the benchmarks that run the agent as in the Pod: no docstrings
# (PYTHONOPTIMIZE=2, as ``python -OO``; the agent reads none, and its asserts only narrow types).
AGENT_INTERPRETER_ENV = {"PYTHONOPTIMIZE": "2"}


class FakeKubeApi:
    """The server. ``start()`` it (or use the ``kubeapi`` fixture), point a kubeconfig at it."""

    def __init__(
        self,
        *,
        versions: Iterable[str] = ALL_VERSIONS,
        port: int = 0,
        token: str | None = None,
        validate: bool = True,
        tls_dir: Path | None = None,
        device_taint_rule_versions: Iterable[str] = (),
        get_latency_s: float = 0.0,
    ) -> None:
        """``tls_dir``: serve HTTPS with a fresh self-signed certificate written there
        (``ca.crt``; needed by clients that insist on TLS, like the in-cluster configuration).
        ``device_taint_rule_versions``: the resource.k8s.io versions that serve DeviceTaintRules
        (a version only listed here, like v1alpha3, serves nothing else). ``get_latency_s``:
        the time from a GET of one object arriving (its request line read) to its answer being
        sent, as a real API server's request latency for it counts (the benchmarks' stand-in for
        a cluster): this server's own work on the request (headers, routing, encoding) counts
        toward it, and a sleep makes up the rest, so the latency is what was asked for, not
        that plus the work of a Python server. ``get_seconds`` collects the latency of every
        such GET as answered."""
        self.versions = tuple(versions)
        self.get_latency_s = get_latency_s
        self.get_seconds: list[float] = []
        self._send_s = 0.0  # how much earlier than asked the sleep before a GET's answer ends
        self.device_taint_rule_versions = tuple(device_taint_rule_versions)
        self.tls_dir = tls_dir
        self.token = token
        self.validate = validate
        self.requests: list[Request] = []
        self.kubeconfig_path: Path | None = None  # set by write_kubeconfig
        self._port = port
        self._state = _State()
        self._cond = threading.Condition()
        self._faults: dict[tuple[str, str], list[_Fault]] = {}
        self._dropped_device_fields: set[str] = set()
        self._dropped_slice_fields: set[str] = set()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._connections: set[socket.socket] = set()
        self.connections_accepted = 0  # every connection a client opened, closed ones included

    # --- lifecycle -------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port == 0:
            self._port = free_port()
        return self._port

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_dir is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    def _tls_context(self, tls_dir: Path) -> ssl.SSLContext:
        cert, key = self._certificate(tls_dir)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        return context

    @staticmethod
    def _certificate(tls_dir: Path) -> tuple[Path, Path]:
        """A self-signed certificate for 127.0.0.1 in ``tls_dir`` (made once)."""
        cert, key = tls_dir / "ca.crt", tls_dir / "tls.key"
        if not cert.exists():
            tls_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                 "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                 "-keyout", str(key), "-out", str(cert)],
                check=True, capture_output=True,
            )  # fmt: skip
        return cert, key

    def start(self) -> FakeKubeApi:
        """Listen on 127.0.0.1:<port> (kept across stop/start, state too)."""
        handler = type("Handler", (_Handler,), {"api": self})
        server = _Server(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        if self.tls_dir is not None:
            server.socket = self._tls_context(self.tls_dir).wrap_socket(
                server.socket, server_side=True
            )
        with self._cond:
            self._closing = False
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="kubeapi", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and end open watches; objects are kept for a later ``start()``."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            # Keep-alive connections would otherwise go on being served by their threads.
            self.kill_connections()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def kill_connections(self) -> None:
        """Cut every open connection (watches included) mid-stream, as a crashing API server
        or a dropped network would; the server goes on listening."""
        with self._cond:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def write_kubeconfig(self, path: Path, *, token: str | None = None) -> Path:
        """Write a kubeconfig for this server to ``path`` and return it."""
        user: JsonDict = {"token": token or self.token or "test-token"}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": self._cluster_entry()}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config, indent=2))
        self.kubeconfig_path = path
        return path

    def _cluster_entry(self) -> JsonDict:
        entry: JsonDict = {"server": self.url}
        if self.tls_dir is not None:
            entry["certificate-authority"] = str(self.tls_dir / "ca.crt")
        return entry

    def in_cluster_command(
        self, argv: list[str], *, workdir: Path
    ) -> tuple[list[str], dict[str, str]]:
        """``argv`` wrapped to run as in a Pod: the ServiceAccount files at their fixed path,
        KUBERNETES_SERVICE_HOST/PORT pointing here, and the interpreter settings the chart's
        DaemonSet gives the agent (``AGENT_INTERPRETER_ENV``). Needs root and a TLS server; the
        files live in a tmpfs over /run inside a private mount namespace, so the host is not
        touched."""
        if self.tls_dir is None:
            raise ValueError("in-cluster clients need TLS: create FakeKubeApi(tls_dir=...)")
        account = workdir / "serviceaccount"
        account.mkdir(parents=True, exist_ok=True)
        (account / "token").write_text(self.token or "test-token")
        (account / "namespace").write_text("gpu-dra")
        shutil.copyfile(self._certificate(self.tls_dir)[0], account / "ca.crt")
        target = "/run/secrets/kubernetes.io/serviceaccount"
        script = (
            f'mount -t tmpfs tmpfs /run && mkdir -p {target} && cp "$0"/* {target}/ && exec "$@"'
        )
        env = {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.port),
            **AGENT_INTERPRETER_ENV,
        }
        return ["unshare", "--mount", "sh", "-c", script, str(account), *argv], env

    @property
    def served_versions(self) -> tuple[str, ...]:
        """Every resource.k8s.io version served, preferred first; DeviceTaintRule-only ones last."""
        extra = tuple(v for v in self.device_taint_rule_versions if v not in self.versions)
        return self.versions + extra

    def resources_served(self, version: str) -> tuple[str, ...]:
        """The resource.k8s.io resources served in ``version``."""
        out: tuple[str, ...] = ()
        if version in self.versions:
            out = ("resourceslices", "resourceclaims", "deviceclasses")
        if version in self.device_taint_rule_versions:
            out += ("devicetaintrules",)
        return out

    # --- test controls ---------------------------------------------------------------------------

    def fail(
        self, verb: str, resource: str, status: int, *, times: int | None = None, message: str = ""
    ) -> None:
        """Answer ``verb`` on ``resource`` with ``status`` (``times`` times, or until cleared)."""
        with self._cond:
            self._faults.setdefault((verb, resource), []).append(
                _Fault(status, message or f"injected {status}", times)
            )

    def forbid(self, verb: str, resource: str) -> None:
        """Deny ``verb`` on ``resource`` the way RBAC does (403 with the real message)."""
        group = group_of(resource)
        qualified = f"{resource}.{group}" if group else resource
        self.fail(
            verb,
            resource,
            403,
            message=(
                f'{qualified} is forbidden: User "system:serviceaccount:gpu-dra:gpu-dra" cannot '
                f'{verb} resource "{resource}" in API group "{group}" at the cluster scope'
            ),
        )

    def clear_faults(self) -> None:
        with self._cond:
            self._faults.clear()

    def drop_fields(
        self, *, device_fields: Iterable[str] = (), slice_fields: Iterable[str] = ()
    ) -> None:
        """Silently drop these ResourceSlice fields on write, as a server with the governing
        feature gate off does (e.g. ``device_fields=["taints"]``)."""
        with self._cond:
            self._dropped_device_fields = set(device_fields)
            self._dropped_slice_fields = set(slice_fields)

    def compact(self) -> None:
        """Forget the event history: watches from any earlier resourceVersion get 410."""
        with self._cond:
            self._state.history.clear()
            self._state.compacted_rv = self._state.rv

    def add_node(self, name: str, *, labels: Mapping[str, str] | None = None) -> JsonDict:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {},
        }
        return self.put("nodes", node)

    def add_claim(self, claim: Mapping[str, Any]) -> JsonDict:
        """Store a v1 ResourceClaim (with ``status.allocation`` if the test wants one)."""
        return self.put("resourceclaims", claim)

    def put(self, resource: str, obj: Mapping[str, Any]) -> JsonDict:
        """Create or replace an object directly (v1 shape), producing the watch event."""
        new: JsonDict = copy.deepcopy(dict(obj))
        meta = new.setdefault("metadata", {})
        key = (resource, meta.get("namespace", ""), meta["name"])
        with self._cond:
            old = self._state.objects.get(key)
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
            self._store(resource, key, new, "MODIFIED" if old else "ADDED")
        return copy.deepcopy(new)

    def objects(self, resource: str) -> list[JsonDict]:
        """Stored objects of ``resource`` in v1 shape, sorted by (namespace, name)."""
        with self._cond:
            return [
                copy.deepcopy(o)
                for (r, _, _), o in sorted(self._state.objects.items())
                if r == resource
            ]

    def slices(self, *, node_name: str | None = None) -> list[JsonDict]:
        return [
            s
            for s in self.objects("resourceslices")
            if node_name is None or s["spec"].get("nodeName") == node_name
        ]

    def count_slice_devices(self, *, node_name: str) -> int:
        """How many devices the node's stored slices hold (cheap: no copies, for polling)."""
        with self._cond:
            return sum(
                len(o["spec"].get("devices") or ())
                for (r, _, _), o in self._state.objects.items()
                if r == "resourceslices" and o["spec"].get("nodeName") == node_name
            )

    def delete_slices(self, *, node_name: str) -> int:
        """Delete every slice of a node, as the kubelet does at start-up (spec C.6)."""
        with self._cond:
            keys = [
                k
                for k, o in self._state.objects.items()
                if k[0] == "resourceslices" and o["spec"].get("nodeName") == node_name
            ]
            for key in keys:
                self._remove(key)
        return len(keys)

    def wait_for_change(self, after: int, timeout_s: float) -> int:
        """Wait until an object changes after resourceVersion ``after`` (at most ``timeout_s``);
        the current resourceVersion (for localkubelet.py, which follows Deployments)."""
        with self._cond:
            self._cond.wait_for(lambda: self._state.rv > after, timeout_s)
            return self._state.rv

    def writes(self) -> list[Request]:
        """Logged create/update/patch/delete requests."""
        return [r for r in self.requests if r.verb in ("create", "update", "patch", "delete")]

    def permissions_used(self) -> set[tuple[str, str, str]]:
        """(verb, group, resource) of every logged resource request (discovery excluded)."""
        return {
            (r.verb, group_of(r.resource), r.resource)
            for r in self.requests
            if r.resource in _KINDS
        }

    # --- storage (call with self._cond held) -----------------------------------------------------

    def _next_rv(self) -> int:
        self._state.rv += 1
        return self._state.rv

    def _store(self, resource: str, key: tuple[str, str, str], obj: JsonDict, kind: str) -> None:
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        self._state.objects[key] = obj
        self._state.history.append(_Event(rv, resource, kind, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _remove(self, key: tuple[str, str, str]) -> JsonDict:
        obj = self._state.objects.pop(key)
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        self._state.history.append(_Event(rv, key[0], "DELETED", copy.deepcopy(obj)))
        self._cond.notify_all()
        return obj

    def _take_fault(self, verb: str, resource: str) -> _Fault | None:
        with self._cond:
            faults = self._faults.get((verb, resource))
            if not faults:
                return None
            fault = faults[0]
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    faults.pop(0)
            return fault

    def _drop(self, obj: JsonDict) -> None:
        spec = obj.get("spec") or {}
        for name in self._dropped_slice_fields:
            spec.pop(name, None)
        for device in spec.get("devices") or ():
            for name in self._dropped_device_fields:
                device.pop(name, None)


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


@dataclass(frozen=True)
class _Route:
    resource: str
    version: str  # "v1" for core, else the resource.k8s.io version
    namespace: str
    name: str


class _Server(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: sixteen clients connecting at once would see
    # SYNs dropped and retried a second later. Go's net/http, like the real API server, listens
    # with the system maximum.
    request_queue_size = socket.SOMAXCONN

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away mid-handshake or mid-request (an agent being killed, a TLS
        # probe) is normal here; anything else is still printed.
        if not isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    api: FakeKubeApi
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
            discovery = self._discovery(url.path)
            if discovery is not None:
                api.requests.append(Request("get", "", "", url.path))
                self._send(200, discovery)
                return
            route = self._route(url.path)
            verb = _verb(method, route, query)
            api.requests.append(Request(verb, route.resource, route.namespace, route.name))
            fault = api._take_fault(verb, route.resource)
            if fault is not None:
                reasons = {403: "Forbidden", 404: "NotFound", 409: "Conflict", 410: "Gone"}
                raise ApiError(
                    fault.status, reasons.get(fault.status, "InternalError"), fault.message
                )
            if verb == "watch":
                self._watch(route, query)
                return
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
            self._send(exc.status, _status(exc.status, exc.reason, exc.message))

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

    def _discovery(self, path: str) -> JsonDict | None:
        versions = self.api.served_versions
        group_versions = [{"groupVersion": f"{GROUP}/{v}", "version": v} for v in versions]
        group = {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": GROUP,
            "versions": group_versions,
            "preferredVersion": group_versions[0] if group_versions else {},
        }
        if path == "/api":
            return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []}
        if path == "/apis":
            groups = [group] if versions else []
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}
        if path == f"/apis/{GROUP}":
            if not versions:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return group
        prefix = f"/apis/{GROUP}/"
        if path.startswith(prefix) and path[len(prefix) :].strip("/") in versions:
            version = path[len(prefix) :].strip("/")
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{GROUP}/{version}",
                "resources": [_resource_info(r) for r in self.api.resources_served(version)],
            }
        return None

    def _route(self, path: str) -> _Route:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        not_found = ApiError(404, "NotFound", "the server could not find the requested resource")
        if parts[:2] == ["api", "v1"]:
            version, rest = "v1", parts[2:]
        elif parts[:3] == ["apis", "apps", "v1"]:
            version, rest = "v1", parts[3:]
            if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in _APPS:
                namespace = rest[1]
                if len(rest) > 4:
                    raise not_found
                return _Route(rest[2], version, namespace, rest[3] if len(rest) == 4 else "")
            raise not_found
        elif (
            parts[:2] == ["apis", GROUP] and len(parts) > 2 and parts[2] in self.api.served_versions
        ):
            version, rest = parts[2], parts[3:]
        else:
            raise not_found
        namespace = ""
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or rest[0] not in _KINDS or len(rest) > 2:
            raise not_found
        resource = rest[0]
        if parts[0] == "apis" and resource not in self.api.resources_served(version):
            raise not_found
        if (version == "v1" and resource not in _CORE) and parts[0] == "api":
            raise not_found
        if parts[0] == "apis" and resource in _CORE + _APPS:
            raise not_found
        namespaced = _KINDS[resource][1]
        # A namespaced resource may be listed across namespaces, but not read by name without one.
        if (namespace and not namespaced) or (namespaced and not namespace and len(rest) == 2):
            raise not_found
        return _Route(resource, version, namespace, rest[1] if len(rest) == 2 else "")

    # --- verbs -----------------------------------------------------------------------------------

    def _serve(
        self, verb: str, route: _Route, query: Mapping[str, str], body: JsonDict | None
    ) -> tuple[int, JsonDict]:
        api = self.api
        key = (route.resource, route.namespace, route.name)
        kind = _KINDS[route.resource][0]
        with api._cond:
            if verb == "get":
                obj = api._state.objects.get(key)
                if obj is None:
                    raise _not_found(route)
                return 200, _out(route, obj, with_type=True)
            if verb == "list":
                items = [
                    _out(route, o, with_type=False)
                    for (r, ns, _), o in sorted(api._state.objects.items())
                    if r == route.resource
                    and (not route.namespace or ns == route.namespace)
                    and _matches(route.resource, o, query)
                ]
                return 200, {
                    "kind": f"{kind}List",
                    "apiVersion": _api_version(route),
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

    def _create(self, route: _Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        obj = _in(route, _require_body(body))
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
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        if route.resource == "resourceslices":
            self._admit_slice(obj, old=None)
        api._store(route.resource, key, obj, "ADDED")
        return _out(route, obj, with_type=True)

    def _update(self, route: _Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        obj = _in(route, _require_body(body))
        key = (route.resource, route.namespace, route.name)
        old = api._state.objects.get(key)
        if old is None:
            raise _not_found(route)
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
        return _out(route, obj, with_type=True)

    def _delete(self, route: _Route, body: JsonDict | None) -> JsonDict:
        api = self.api
        key = (route.resource, route.namespace, route.name)
        old = api._state.objects.get(key)
        if old is None:
            raise _not_found(route)
        pre = (body or {}).get("preconditions") or {}
        for field_name in ("uid", "resourceVersion"):
            if pre.get(field_name) and pre[field_name] != old["metadata"][field_name]:
                raise ApiError(
                    409,
                    "Conflict",
                    f"Precondition failed: {field_name}: {pre[field_name]}, "
                    f"object {field_name}: {old['metadata'][field_name]}",
                )
        return _out(route, api._remove(key), with_type=True)

    def _admit_slice(self, obj: JsonDict, *, old: JsonDict | None) -> None:
        self.api._drop(obj)
        spec = obj.get("spec") or {}
        for device in spec.get("devices") or ():
            for taint in device.get("taints") or ():
                taint.setdefault("timeAdded", _now())
        if not self.api.validate:
            return
        problems = validate_slice(obj)
        if old is not None:
            for path in (("driver",), ("pool", "name"), ("nodeName",)):
                if _get(spec, path) != _get(old.get("spec") or {}, path):
                    problems.append(f"spec.{'.'.join(path)}: field is immutable")
        if problems:
            raise ApiError(
                422,
                "Invalid",
                f'ResourceSlice.resource.k8s.io "{obj["metadata"]["name"]}" is invalid: '
                + "; ".join(problems),
            )

    def _watch(self, route: _Route, query: Mapping[str, str]) -> None:
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
                        _Event(int(o["metadata"]["resourceVersion"]), r, "ADDED", o)
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
                                "object": _status(
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
                        kind = _KINDS[route.resource][0]
                        self._chunk(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": kind,
                                    "apiVersion": _api_version(route),
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

    def _emit(self, route: _Route, event: _Event, query: Mapping[str, str]) -> None:
        if route.namespace and event.obj["metadata"].get("namespace") != route.namespace:
            return
        if not _matches(route.resource, event.obj, query):
            return
        self._chunk({"type": event.type, "object": _out(route, event.obj, with_type=True)})

    def _chunk(self, payload: Mapping[str, Any]) -> None:
        data = json.dumps(payload).encode() + b"\n"
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


# --- helpers of the handler ----------------------------------------------------------------------


def _verb(method: str, route: _Route, query: Mapping[str, str]) -> str:
    if method == "GET":
        if route.name:
            return "get"
        return "watch" if query.get("watch") in ("true", "1") else "list"
    if method == "POST" and not route.name:
        return "create"
    if method == "PUT" and route.name:
        return "update"
    if method == "PATCH" and route.name:
        return "patch"
    if method == "DELETE":
        return "delete" if route.name else "deletecollection"
    raise ApiError(405, "MethodNotAllowed", f"{method} {route.resource} is not allowed")


def _api_version(route: _Route) -> str:
    if route.resource in _APPS:
        return "apps/v1"
    return "v1" if route.resource in _CORE else f"{GROUP}/{route.version}"


def _require_body(body: JsonDict | None) -> JsonDict:
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "request body must be a JSON object")
    return body


def _not_found(route: _Route) -> ApiError:
    group = group_of(route.resource)
    qualified = f"{route.resource}.{group}" if group else route.resource
    return ApiError(404, "NotFound", f'{qualified} "{route.name}" not found')


def _status(code: int, reason: str, message: str) -> JsonDict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _resource_info(resource: str) -> JsonDict:
    kind, namespaced = _KINDS[resource]
    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    return {"name": resource, "namespaced": namespaced, "kind": kind, "verbs": verbs}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get(obj: Mapping[str, Any], path: Iterable[str]) -> Any:
    cur: Any = obj
    for part in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(part)
    return cur


def _matches(resource: str, obj: Mapping[str, Any], query: Mapping[str, str]) -> bool:
    for term in filter(None, (query.get("fieldSelector") or "").split(",")):
        negate = "!=" in term
        key, _, value = term.replace("!=", "=").replace("==", "=").partition("=")
        allowed = _SLICE_FIELDS if resource == "resourceslices" else ("metadata.name",)
        if key not in allowed:
            raise ApiError(400, "BadRequest", f"field label not supported: {key} for {resource}")
        actual = str(_get(obj, key.split(".")) or "")
        if (actual == value) == negate:
            return False
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, (query.get("labelSelector") or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _in(route: _Route, obj: JsonDict) -> JsonDict:
    """A request body in the route's version -> v1 storage shape."""
    obj = copy.deepcopy(obj)
    obj.pop("apiVersion", None)
    obj.pop("kind", None)
    if route.version != "v1beta1":
        return obj
    spec = obj.get("spec") or {}
    if route.resource == "resourceslices":
        for device in spec.get("devices") or ():
            device.update(device.pop("basic", {}) or {})
    if route.resource == "resourceclaims":
        for request in (spec.get("devices") or {}).get("requests") or ():
            if "firstAvailable" not in request:
                exact = {k: request.pop(k) for k in list(request) if k != "name"}
                request["exactly"] = exact
    return obj


def _out(route: _Route, obj: Mapping[str, Any], *, with_type: bool) -> JsonDict:
    """A stored v1-shape object -> the route's version (kind/apiVersion only outside lists)."""
    out: JsonDict = json.loads(json.dumps(obj))  # a deep copy (of JSON data: 5x deepcopy)
    if with_type:
        out = {"kind": _KINDS[route.resource][0], "apiVersion": _api_version(route), **out}
    if route.version != "v1beta1" or route.resource in _CORE + _APPS:
        return out
    spec = out.get("spec") or {}
    if route.resource == "resourceslices" and spec.get("devices"):
        spec["devices"] = [
            {"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}}
            for d in spec["devices"]
        ]
    if route.resource == "resourceclaims":
        for request in (spec.get("devices") or {}).get("requests") or ():
            request.update(request.pop("exactly", {}) or {})
    return out


def validate_slice(obj: Mapping[str, Any]) -> list[str]:
    """The ResourceSlice rules of spec D.1 the driver must respect, as problem strings."""
    problems: list[str] = []
    spec = obj.get("spec") or {}
    if not spec.get("driver"):
        problems.append("spec.driver: Required value")
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        problems.append("spec.pool.name: Required value")
    if int(pool.get("generation", -1)) < 0:
        problems.append("spec.pool.generation: must be >= 0")
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        problems.append("spec.pool.resourceSliceCount: must be > 0")
    selectors = [
        k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection") if spec.get(k)
    ]
    if len(selectors) != 1:
        problems.append(
            "spec: exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection "
            f"must be set (got {selectors})"
        )
    devices = spec.get("devices") or []
    counters = spec.get("sharedCounters") or []
    if devices and counters:
        problems.append("spec: only one of devices or sharedCounters may be set")
    limited = any(d.get("taints") or d.get("consumesCounters") for d in devices)
    limit = 64 if limited else 128
    if len(devices) > limit:
        problems.append(f"spec.devices: Too many: {len(devices)}: must have at most {limit} items")
    if len(counters) > 8:
        problems.append(
            f"spec.sharedCounters: Too many: {len(counters)}: must have at most 8 items"
        )
    names: set[str] = set()
    label_chars = set(string.ascii_lowercase + string.digits + "-")
    for i, device in enumerate(devices):
        name = str(device.get("name", ""))
        if (
            not name
            or len(name) > 63
            or set(name) - label_chars
            or name[0] == "-"
            or name[-1] == "-"
        ):
            problems.append(f"spec.devices[{i}].name: Invalid value: {name!r}: not a DNS label")
        if name in names:
            problems.append(f"spec.devices[{i}].name: Duplicate value: {name!r}")
        names.add(name)
        attrs = device.get("attributes") or {}
        if len(attrs) + len(device.get("capacity") or {}) > 32:
            problems.append(f"spec.devices[{i}]: Too many attributes and capacities (max 32)")
        for attr_name, value in attrs.items():
            members = [k for k in ("int", "bool", "string", "version") if k in value]
            if len(members) != 1:
                problems.append(
                    f"spec.devices[{i}].attributes[{attr_name}]: exactly one value required"
                )
            if "string" in value and len(str(value["string"])) > 64:
                problems.append(
                    f"spec.devices[{i}].attributes[{attr_name}].string: too long (max 64)"
                )
        if len(device.get("consumesCounters") or []) > 2:
            problems.append(f"spec.devices[{i}].consumesCounters: Too many (max 2)")
        if len(device.get("taints") or []) > 16:
            problems.append(f"spec.devices[{i}].taints: Too many (max 16)")
    set_names = [c.get("name") for c in counters]
    if len(set(set_names)) != len(set_names):
        problems.append("spec.sharedCounters: Duplicate counter set name")
    for i, counter_set in enumerate(counters):
        n = len(counter_set.get("counters") or {})
        if n == 0:
            problems.append(f"spec.sharedCounters[{i}].counters: Required value")
        elif n > 32:
            problems.append(
                f"spec.sharedCounters[{i}].counters: Too many: {n}: must have at most 32"
            )
    return problems


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
