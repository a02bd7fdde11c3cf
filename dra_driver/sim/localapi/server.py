"""The local API server's object: ``FakeKubeApi`` starts and stops the HTTP server (handler.py
answers its requests), holds the state (store.py) under one lock, and offers the tests their
controls: injected faults, dropped fields, compaction, and direct reads and writes of objects."""

from __future__ import annotations

import contextlib
import copy
import json
import random
import socket
import threading
import uuid
from collections.abc import Iterable, Mapping
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from dra_driver.sim.localapi import clientconfig
from dra_driver.sim.localapi.handler import Handler, Server
from dra_driver.sim.localapi.resources import ALL_VERSIONS, KINDS, JsonDict, group_of, now
from dra_driver.sim.localapi.store import Event, Fault, Request, State


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
        device_status: bool = True,
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
        such GET as answered. ``device_status``: the DRAResourceClaimDeviceStatus feature (on by
        default, GA in 1.37); off, ``status.devices`` written to a claim is dropped silently."""
        self.versions = tuple(versions)
        self.get_latency_s = get_latency_s
        self.get_seconds: list[float] = []
        self._send_s = 0.0  # how much earlier than asked the sleep before a GET's answer ends
        self.device_taint_rule_versions = tuple(device_taint_rule_versions)
        self.tls_dir = tls_dir
        self.token = token
        self.validate = validate
        self.device_status = device_status
        # field manager of each status.devices entry per claim (server-side apply, claimstatus.py)
        self._status_owners: dict[tuple[str, str, str], dict[tuple[str, str, str, str], str]] = {}
        self.requests: list[Request] = []
        self.kubeconfig_path: Path | None = None  # set by write_kubeconfig
        self._port = port
        self._state = State()
        self._cond = threading.Condition()
        self._faults: dict[tuple[str, str], list[Fault]] = {}
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

    # The certificate of a ``tls_dir`` (tests read its CA through the class).
    _certificate = staticmethod(clientconfig.certificate)

    def start(self) -> FakeKubeApi:
        """Listen on 127.0.0.1:<port> (kept across stop/start, state too)."""
        handler = type("Handler", (Handler,), {"api": self})
        server = Server(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        if self.tls_dir is not None:
            server.socket = clientconfig.tls_context(self.tls_dir).wrap_socket(
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
        config = clientconfig.kubeconfig(
            url=self.url, tls_dir=self.tls_dir, token=token or self.token or "test-token"
        )
        path.write_text(json.dumps(config, indent=2))
        self.kubeconfig_path = path
        return path

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
        return clientconfig.in_cluster_command(
            argv,
            workdir=workdir,
            port=self.port,
            token=self.token or "test-token",
            tls_dir=self.tls_dir,
        )

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
                Fault(status, message or f"injected {status}", times)
            )

    def answer_raw(
        self,
        verb: str,
        resource: str,
        body: bytes,
        *,
        name: str = "",
        status: int = 200,
        times: int | None = None,
    ) -> None:
        """Answer ``verb`` on ``resource`` (the object ``name`` only, when given) with ``body``
        as it is, under ``status``: a broken proxy, a truncated answer, JSON no client decodes."""
        with self._cond:
            self._faults.setdefault((verb, resource), []).append(
                Fault(status, "", times, body=body, name=name)
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
            meta.setdefault("creationTimestamp", now())
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
            (r.verb, group_of(r.resource.split("/")[0]), r.resource)
            for r in self.requests
            if r.resource.split("/")[0] in KINDS
        }

    # --- storage (call with self._cond held) -----------------------------------------------------

    def _next_rv(self) -> int:
        self._state.rv += 1
        return self._state.rv

    def _store(self, resource: str, key: tuple[str, str, str], obj: JsonDict, kind: str) -> None:
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        self._state.objects[key] = obj
        self._state.history.append(Event(rv, resource, kind, copy.deepcopy(obj)))
        self._cond.notify_all()

    def _remove(self, key: tuple[str, str, str]) -> JsonDict:
        obj = self._state.objects.pop(key)
        rv = self._next_rv()
        obj["metadata"]["resourceVersion"] = str(rv)
        self._state.history.append(Event(rv, key[0], "DELETED", copy.deepcopy(obj)))
        self._cond.notify_all()
        return obj

    def _take_fault(self, verb: str, resource: str, name: str = "") -> Fault | None:
        with self._cond:
            faults = self._faults.get((verb, resource))
            fault = next((f for f in faults or () if f.name in ("", name)), None)
            if faults is None or fault is None:
                return None
            if fault.times is not None:
                fault.times -= 1
                if fault.times <= 0:
                    faults.remove(fault)
            return fault

    def _drop(self, obj: JsonDict) -> None:
        spec = obj.get("spec") or {}
        for name in self._dropped_slice_fields:
            spec.pop(name, None)
        for device in spec.get("devices") or ():
            for name in self._dropped_device_fields:
                device.pop(name, None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server started later.

    Picked below the kernel's ephemeral range (``ip_local_port_range``), where ``bind(0)`` would
    pick it: there the port of an outgoing connection made meanwhile (a kubelet's, a client's)
    could take it before the server binds it, which failed a real-node test's agent with
    "Address already in use". Below the range only another listener can, and a port that one
    holds now is skipped."""
    low = _ephemeral_low()
    start = max(1024, low - 12000)
    for _ in range(200 if start < low else 0):  # none below a range that starts that low
        port = random.randrange(start, low)  # noqa: S311  (not a secret)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))  # every port tried was taken: the kernel's choice
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default
