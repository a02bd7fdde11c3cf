"""The one place that talks to the Kubernetes API, through the official ``kubernetes`` client.

Place in the flow: publisher.py reads and writes ResourceSlices here; the plugin reads
ResourceClaims (NodePrepareResources), the Node, and records Events on the Node. Everything
crosses this boundary as plain JSON dicts in resource.k8s.io/v1 shape, whichever version the server
serves: discovery picks v1, else v1beta2, else v1beta1, and objects are converted on the way in
and out (spec D.0).

The ResourceClaim GET of every prepare is the one request not sent by the official client: it
goes over keepalive.py's plain keep-alive connections, with this client's host, TLS settings and
headers (keepalive.py says why and what is kept).

Errors are converted here and only here (``raise ... from exc``): HTTP statuses and urllib3
failures become the ``KubeError`` subclasses of errors.py. Timeouts are short and the client does
no retries of its own (urllib3 retries are switched off): callers decide, the publisher with
backoff. :data:`API_PERMISSIONS` lists every (verb, group, resource) a method here can use, so the
chart's RBAC can be checked against it.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Literal
from urllib.parse import quote

import urllib3

from dra_driver.errors import (
    ConfigError,
    KubeConflict,
    KubeError,
    KubeForbidden,
    KubeGone,
    KubeInvalid,
    KubeNotFound,
    KubeUnavailable,
)
from dra_driver.kube.keepalive import KeepAliveGetter
from dra_driver.publish.slices import API_VERSIONS, GROUP, JsonDict, convert_slice, slice_to_v1


def _without_eager_package_imports(*packages: str) -> None:
    """Register ``packages`` without running their ``__init__`` (their submodules still import).

    ``kubernetes/__init__.py`` imports dynamic, stream, watch, leaderelection and informer,
    ``kubernetes/config/__init__.py`` imports the kubeconfig loader with its OIDC stack (oauthlib,
    requests), and ``kubernetes/utils/__init__.py`` the YAML object creator: together about
    20 MiB of a node agent that uses none of them. ``kubernetes/client/__init__.py`` imports
    ``ApiClient``, and with it pydantic, dateutil, multiprocessing's thread pool and the model
    package: 10.5 MiB more (measured: RSS after ``import dra_driver.kube``, 11.7 -> 1.2 MiB over
    grpc/urllib3/ssl), all for its model (de)serialization, which the agent never uses: it speaks
    plain JSON dicts. We import exactly the client modules we call (``Configuration``, the
    ``rest`` transport, the in-cluster loader); any submodule can still be imported explicitly.

    A name the package's ``__init__`` would have defined (``from kubernetes.client import
    ApiClient``, as the kubeconfig loader does) runs that ``__init__`` on first use, so other
    code sees the package it expects, at the full price, only then (``make demo`` with a
    kubeconfig file; never in a Pod).
    """
    for name in packages:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            return  # not installed: let the real import below fail with its own message
        module = importlib.util.module_from_spec(spec)
        module.__getattr__ = _run_init_on_demand(module, spec)  # type: ignore[method-assign]
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def _run_init_on_demand(module: Any, spec: importlib.machinery.ModuleSpec) -> Any:
    """A module ``__getattr__`` (PEP 562) that runs the package's own ``__init__`` the first
    time a name it does not have yet is asked for, then answers from the finished package.
    A submodule not imported yet is not asked of ``__init__``: ``from package import
    submodule`` probes the attribute before it imports the submodule."""
    lock = threading.RLock()

    def getattr_(attr: str) -> Any:
        if importlib.machinery.PathFinder.find_spec(f"{module.__name__}.{attr}", module.__path__):
            raise AttributeError(f"module {module.__name__!r} has no attribute {attr!r}")
        with lock:
            if module.__dict__.get("__getattr__") is getattr_:
                del module.__getattr__  # once: names __init__ does not define stay missing
                assert spec.loader is not None
                spec.loader.exec_module(module)
        return getattr(module, attr)

    return getattr_


_without_eager_package_imports(
    "kubernetes", "kubernetes.client", "kubernetes.config", "kubernetes.utils"
)

from kubernetes.client import rest  # noqa: E402
from kubernetes.client.configuration import Configuration  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

# The loaders import ``Configuration`` from the package (``from kubernetes.client import
# Configuration``), whose __init__ we did not run: give it the one name they take.
vars(sys.modules["kubernetes.client"]).setdefault("Configuration", Configuration)

from kubernetes.config import incluster_config  # noqa: E402
from kubernetes.config.config_exception import ConfigException  # noqa: E402

log = logging.getLogger(__name__)

API_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("get", "", "nodes"),
        ("create", "", "events"),
        ("get", GROUP, "resourceclaims"),
        ("list", GROUP, "resourceslices"),
        ("watch", GROUP, "resourceslices"),
        ("create", GROUP, "resourceslices"),
        ("update", GROUP, "resourceslices"),
        ("delete", GROUP, "resourceslices"),
    }
)
"""Every (verb, API group, resource) the node agent requests across the cluster; "" is the core
group. The chart's ClusterRole grants exactly these. Discovery (``GET /apis/resource.k8s.io``)
is a non-resource URL every authenticated user may read."""

MPS_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("get", "apps", "deployments"),
        ("list", "apps", "deployments"),
        ("create", "apps", "deployments"),
        ("delete", "apps", "deployments"),
    }
)
"""What the node agent requests in its own namespace only: the Deployments that run MPS control
daemons (mpsdaemon.py). The chart's Role grants exactly these."""

EXPLAIN_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("list", GROUP, "resourceslices"),
        ("list", GROUP, "deviceclasses"),
        ("list", GROUP, "resourceclaims"),
        ("list", GROUP, "devicetaintrules"),
    }
)
"""What ``gpu-dra explain --kubeconfig`` reads, with the user's own credentials (never the
agent's ServiceAccount): every node's slices, the cluster's DeviceClasses, the ResourceClaims of
all namespaces (the devices already in use) and the DeviceTaintRules where served."""

STATUS_PERMISSIONS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("list", GROUP, "resourceslices"),
        ("list", GROUP, "resourceclaims"),
        ("list", "", "pods"),
    }
)
"""What ``gpu-dra status --kubeconfig`` reads, with the user's own credentials: every node's
slices, the ResourceClaims of all namespaces (which claim holds which device), and the agent's pods
(where their metrics are served). Without the pods it still shows slices and claims."""

DEVICE_TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")
"""resource.k8s.io versions that can serve DeviceTaintRule, preferred first (spec D.4: v1alpha3
since 1.33, v1beta2 since 1.36, v1 since 1.37; each only with the DRADeviceTaintRules gate on)."""

USER_AGENT = "gpu-dra/kubelet-plugin"
_ACCEPT_JSON: Mapping[str, str] = {"Accept": "application/json"}
_SEND_JSON: Mapping[str, str] = {"Accept": "application/json", "Content-Type": "application/json"}

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 3.0
_WATCH_READ_MARGIN_S = 15.0
_KUBECONFIG_FLAG = "--kubeconfig (KUBECONFIG)"

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class SliceList:
    """Our ResourceSlices (v1 shape) and the list's resourceVersion to start a watch from."""

    items: tuple[JsonDict, ...]
    resource_version: str


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK, with the object in v1 shape."""

    type: str
    object: JsonDict

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


class WatchStream:
    """An open watch. Iterate for events; ``close()`` from any thread ends the iteration.

    Iteration raises KubeGone when the server says the resourceVersion is too old (relist), and
    KubeUnavailable when the connection breaks; it simply ends when the server closes the watch
    (its ``timeoutSeconds`` elapsed) or after ``close()``.
    """

    def __init__(
        self,
        response: Any,
        *,
        resource: str,
        convert: Any,
    ) -> None:
        self._response = response
        self._resource = resource
        self._convert = convert
        self._closed = threading.Event()
        self._close_lock = threading.Lock()

    def __enter__(self) -> WatchStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Unblock a reader in another thread and release the connection. Idempotent."""
        with self._close_lock:  # the reader's cleanup and stop() may close at the same time
            if self._closed.is_set():
                return
            self._closed.set()
            # shutdown() wakes a thread blocked in a socket read; close() alone would not.
            # It refuses when there is nothing to wake: RuntimeError once the stream was read to
            # the end and the connection went back to the pool, ValueError once urllib3 closed
            # the response itself (the server broke the stream mid-chunk).
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                self._response.shutdown()
            self._response.release_conn()

    def __iter__(self) -> Iterator[WatchEvent]:
        try:
            for line in self._lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = str(event.get("type", "")), event.get("object") or {}
                if kind == "ERROR":
                    raise _status_error(
                        int(obj.get("code") or 500), obj, verb="watch", resource=self._resource
                    )
                yield WatchEvent(kind, obj if kind == "BOOKMARK" else self._convert(obj))
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self._closed.is_set():
                return
            raise KubeUnavailable(
                f"watch {self._resource}: connection to the API server broke: {exc}",
                verb="watch",
                resource=self._resource,
            ) from exc
        except ValueError as exc:
            if self._closed.is_set():
                return
            raise KubeUnavailable(
                f"watch {self._resource}: the API server sent an unreadable event: {exc}",
                verb="watch",
                resource=self._resource,
            ) from exc

    def _lines(self) -> Iterator[str]:
        buffer = b""
        for chunk in self._response.stream(amt=None, decode_content=True):
            if self._closed.is_set():
                return
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line.decode("utf-8")
        if buffer.strip() and not self._closed.is_set():
            yield buffer.decode("utf-8")


class KubeClient:
    """Typed access to the few API calls the driver makes. Thread-safe.

    Every method raises a KubeError subclass on failure: KubeForbidden names the RBAC rule that is
    missing, KubeUnavailable covers connection problems, timeouts, 429 and 5xx. ``timeout_s`` is
    the read timeout of a call through the official client, and the deadline of the whole claim
    GET (connect, TLS handshake, request and whole answer) on the keep-alive path.

    Requests go through the official client's transport, ``rest.RESTClientObject`` (its urllib3
    pool with the configuration's TLS, proxy and socket settings), with the URL and headers
    ``ApiClient.param_serialize`` would give (a test compares them); ApiClient itself is not
    loaded (see ``_without_eager_package_imports``: its model machinery is 10.5 MiB).
    """

    def __init__(
        self,
        configuration: Configuration,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self._configuration = configuration
        self._rest = rest.RESTClientObject(configuration)
        # The prepare path's claim GET goes over plain keep-alive connections when the
        # configuration allows (keepalive.py says why and what is kept); None: official path.
        # ``timeout_s`` bounds the whole GET there (a server dripping bytes cannot hold a
        # prepare); its TLS files are reloaded when they change.
        self._getter = KeepAliveGetter.for_configuration(
            configuration, connect_timeout_s=connect_timeout_s, timeout_s=timeout_s
        )
        self._timeout = (connect_timeout_s, timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._version: str | None = None
        self._version_lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        *,
        kubeconfig: Path | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> KubeClient:
        """Connect with ``kubeconfig``, else $KUBECONFIG, else the in-cluster ServiceAccount.

        Raises ConfigError naming the flag when none is usable. Nothing is sent yet.
        """
        configuration = Configuration()
        source = str(kubeconfig) if kubeconfig is not None else os.environ.get("KUBECONFIG", "")
        try:
            if source:
                # Loaded only for kubeconfig files: in a Pod the lighter in-cluster path is used.
                from kubernetes.config import kube_config  # noqa: PLC0415

                kube_config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=source, client_configuration=configuration, persist_config=False
                )
            elif os.environ.get("KUBERNETES_SERVICE_HOST"):
                incluster_config.load_incluster_config(  # type: ignore[no-untyped-call]
                    client_configuration=configuration
                )
            else:
                raise ConfigError(
                    _KUBECONFIG_FLAG,
                    "no kubeconfig given and not running in a Pod (KUBERNETES_SERVICE_HOST unset)",
                )
        except (ConfigException, OSError, ValueError) as exc:
            where = source or "in-cluster ServiceAccount"
            raise ConfigError(_KUBECONFIG_FLAG, f"cannot load {where}: {exc}") from exc
        # Retries are the caller's decision (publisher backoff), never hidden in the transport.
        configuration.retries = False
        # The loaders' token-refresh hook re-applies the host before every request, and the
        # host setter re-reads the proxy environment each time (~0.3 ms of a ~1 ms claim GET).
        # The environment of a running process does not change: keep the proxy it gave now.
        configuration.proxy = configuration.proxy
        return cls(configuration, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)

    @property
    def configuration(self) -> Configuration:
        return self._configuration

    def close(self) -> None:
        if self._getter is not None:
            self._getter.close()
        self._rest.close()

    # --- discovery -------------------------------------------------------------------------------

    @property
    def resource_api_version(self) -> str:
        """The resource.k8s.io version in use: v1, else v1beta2, else v1beta1 (discovered once)."""
        with self._version_lock:
            if self._version is None:
                self._version = self._discover()
            return self._version

    def _discover(self) -> str:
        try:
            group = self._request("GET", f"/apis/{GROUP}", verb="get", resource=GROUP)
        except KubeNotFound as exc:
            raise KubeNotFound(
                f"the API server does not serve {GROUP} (DRA needs Kubernetes 1.32 or newer, "
                "with the resource.k8s.io API enabled)",
                verb="get",
                resource=GROUP,
                status=404,
            ) from exc
        served = {str(v.get("version")) for v in group.get("versions") or ()}
        for version in API_VERSIONS:
            if version in served:
                log.info(
                    "using resource.k8s.io/%s",
                    version,
                    extra={"api_version": version, "served": sorted(served)},
                )
                return version
        raise KubeNotFound(
            f"the API server serves {GROUP} only in {sorted(served)}; this driver needs one of "
            f"{list(API_VERSIONS)} (Kubernetes 1.32 or newer)",
            verb="get",
            resource=GROUP,
            status=404,
        )

    # --- ResourceSlices --------------------------------------------------------------------------

    def _slices_path(self, name: str = "") -> str:
        base = f"/apis/{GROUP}/{self.resource_api_version}/resourceslices"
        return f"{base}/{name}" if name else base

    @staticmethod
    def _slice_selector(driver_name: str, node_name: str) -> str:
        return f"spec.driver={driver_name},spec.nodeName={node_name}"

    def list_slices(self, *, driver_name: str, node_name: str) -> SliceList:
        """Our driver's slices on our node (field selector), v1 shape, sorted by name."""
        data = self._request(
            "GET",
            self._slices_path(),
            query={"fieldSelector": self._slice_selector(driver_name, node_name)},
            verb="list",
            resource="resourceslices",
        )
        return SliceList(
            items=tuple(self._v1_slices(data)),
            resource_version=str(data.get("metadata", {}).get("resourceVersion", "")),
        )

    def watch_slices(
        self, *, driver_name: str, node_name: str, resource_version: str, timeout_s: int = 300
    ) -> WatchStream:
        """Open a watch of our slices from ``resource_version``; the server ends it after
        ``timeout_s``. Raises KubeGone at once when the version is already too old."""
        response = self._request(
            "GET",
            self._slices_path(),
            query={
                "fieldSelector": self._slice_selector(driver_name, node_name),
                "watch": "true",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_s),
            },
            verb="watch",
            resource="resourceslices",
            stream=True,
            timeout=(self._connect_timeout_s, timeout_s + _WATCH_READ_MARGIN_S),
        )
        return WatchStream(response, resource="resourceslices", convert=slice_to_v1)

    def create_slice(self, body: Mapping[str, Any]) -> JsonDict:
        """Create a slice (``metadata.generateName`` set); returns what the server stored."""
        stored = self._request(
            "POST",
            self._slices_path(),
            body=convert_slice(body, api_version=self.resource_api_version),
            verb="create",
            resource="resourceslices",
        )
        return slice_to_v1(stored)

    def update_slice(self, body: Mapping[str, Any]) -> JsonDict:
        """Replace a slice; ``metadata.resourceVersion`` must be current (else KubeConflict)."""
        name = str(body["metadata"]["name"])
        stored = self._request(
            "PUT",
            self._slices_path(name),
            body=convert_slice(body, api_version=self.resource_api_version),
            verb="update",
            resource="resourceslices",
            name=name,
        )
        return slice_to_v1(stored)

    def delete_slice(self, *, name: str, uid: str, resource_version: str) -> bool:
        """Delete a slice if it is still the object we saw (uid + resourceVersion preconditions).

        Returns False if it was already gone; a changed object raises KubeConflict.
        """
        preconditions = {
            k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v
        }
        try:
            self._request(
                "DELETE",
                self._slices_path(name),
                body={"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": preconditions},
                verb="delete",
                resource="resourceslices",
                name=name,
            )
        except KubeNotFound:
            return False
        return True

    # --- other objects ---------------------------------------------------------------------------

    def list_all_slices(self) -> list[JsonDict]:
        """Every ResourceSlice of the cluster (all nodes, all drivers), v1 shape, sorted by name:
        what the scheduler sees. For ``gpu-dra explain``; the agent never calls it."""
        data = self._request("GET", self._slices_path(), verb="list", resource="resourceslices")
        return self._v1_slices(data)

    def _v1_slices(self, listing: Mapping[str, Any]) -> list[JsonDict]:
        """The items of a ResourceSlice list in v1 shape, sorted by name."""
        version = self.resource_api_version
        return sorted(
            (slice_to_v1(item, api_version=version) for item in listing.get("items") or ()),
            key=lambda s: str(s.get("metadata", {}).get("name", "")),
        )

    def list_device_classes(self) -> list[JsonDict]:
        """Every DeviceClass of the cluster as served (v1beta1 classes have the v1 shape)."""
        return self._list_typed(self.resource_api_version, "deviceclasses", "DeviceClass")

    def _list_typed(self, version: str, resource: str, kind: str) -> list[JsonDict]:
        """Every ``resource`` of the cluster as ``version`` serves it, each with the
        ``apiVersion`` and ``kind`` a list's items leave out."""
        data = self._request(
            "GET", f"/apis/{GROUP}/{version}/{resource}", verb="list", resource=resource
        )
        items: list[JsonDict] = list(data.get("items") or ())
        for item in items:
            item.setdefault("apiVersion", f"{GROUP}/{version}")
            item.setdefault("kind", kind)
        return items

    def list_resource_claims(self) -> list[JsonDict]:
        """Every ResourceClaim of the cluster (all namespaces), v1 shape, sorted by (namespace,
        name), status included: what the scheduler counts as in use. For ``gpu-dra explain``;
        the agent never calls it."""
        version = self.resource_api_version
        data = self._request(
            "GET", f"/apis/{GROUP}/{version}/resourceclaims", verb="list", resource="resourceclaims"
        )
        claims = []
        for item in data.get("items") or ():
            claim = claim_to_v1(item, api_version=version)
            claim.setdefault("kind", "ResourceClaim")
            claims.append(claim)
        return sorted(
            claims,
            key=lambda c: (
                str(c.get("metadata", {}).get("namespace", "")),
                str(c.get("metadata", {}).get("name", "")),
            ),
        )

    def list_device_taint_rules(self) -> list[JsonDict] | None:
        """Every DeviceTaintRule of the cluster, sorted by name, or None when the cluster serves
        none (the DRADeviceTaintRules gate is off, or Kubernetes < 1.33). The served version is
        found by discovery (:data:`DEVICE_TAINT_RULE_VERSIONS`); the fields explain uses
        (``spec.deviceSelector``, ``spec.taint``) have the same shape in all of them. For
        ``gpu-dra explain``; the agent never calls it."""
        group = self._request("GET", f"/apis/{GROUP}", verb="get", resource=GROUP)
        served = {str(v.get("version")) for v in group.get("versions") or ()}
        for version in DEVICE_TAINT_RULE_VERSIONS:
            if version not in served:
                continue
            resources = self._request("GET", f"/apis/{GROUP}/{version}", verb="get", resource=GROUP)
            names = {str(r.get("name")) for r in resources.get("resources") or ()}
            if "devicetaintrules" not in names:
                continue
            items = self._list_typed(version, "devicetaintrules", "DeviceTaintRule")
            return sorted(items, key=lambda r: str(r.get("metadata", {}).get("name", "")))
        return None

    def list_pods(self, *, label_selector: str, namespace: str = "") -> list[JsonDict]:
        """The pods matching ``label_selector``, in ``namespace`` or (empty) all namespaces,
        sorted by (namespace, name). For ``gpu-dra status`` (the agent's pods, for their metrics
        endpoints); the agent never calls it."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        data = self._request(
            "GET",
            path,
            query={"labelSelector": label_selector},
            verb="list",
            resource="pods",
            namespace=namespace,
        )
        items: list[JsonDict] = list(data.get("items") or ())
        return sorted(
            items,
            key=lambda p: (
                str(p.get("metadata", {}).get("namespace", "")),
                str(p.get("metadata", {}).get("name", "")),
            ),
        )

    def get_node(self, name: str) -> JsonDict:
        """The Node object; KubeNotFound if it does not exist."""
        node: JsonDict = self._request(
            "GET", f"/api/v1/nodes/{name}", verb="get", resource="nodes", name=name
        )
        return node

    def get_resource_claim(self, *, namespace: str, name: str) -> JsonDict | None:
        """The ResourceClaim in v1 shape, or None if it does not exist."""
        version = self.resource_api_version
        try:
            claim = self._get(
                f"/apis/{GROUP}/{version}/namespaces/{namespace}/resourceclaims/{name}",
                resource="resourceclaims",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return claim_to_v1(claim, api_version=version)

    def create_event(
        self,
        *,
        node_name: str,
        node_uid: str,
        reason: str,
        message: str,
        event_type: EventType = "Warning",
        component: str = "gpu-dra-kubelet-plugin",
        namespace: str = "default",
    ) -> JsonDict:
        """Record a core/v1 Event about the Node (shown by ``kubectl describe node``)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{node_name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Node",
                "name": node_name,
                "uid": node_uid,
            },
            "reason": reason,
            "message": message,
            "type": event_type,
            "source": {"component": component, "host": node_name},
            "reportingComponent": component,
            "reportingInstance": node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        event: JsonDict = self._request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body=body,
            verb="create",
            resource="events",
            namespace=namespace,
        )
        return event

    # --- MPS control daemon Deployments (mpsdaemon.py) --------------------------------------------

    def get_deployment(self, *, namespace: str, name: str) -> JsonDict | None:
        """The apps/v1 Deployment, or None when it does not exist."""
        try:
            found: JsonDict = self._request(
                "GET",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
                verb="get",
                resource="deployments",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return None
        return found

    def list_deployments(self, *, namespace: str, label_selector: str) -> list[JsonDict]:
        data = self._request(
            "GET",
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            query={"labelSelector": label_selector},
            verb="list",
            resource="deployments",
            namespace=namespace,
        )
        return list(data.get("items") or ())

    def create_deployment(self, *, namespace: str, body: Mapping[str, Any]) -> JsonDict:
        created: JsonDict = self._request(
            "POST",
            f"/apis/apps/v1/namespaces/{namespace}/deployments",
            body=body,
            verb="create",
            resource="deployments",
            namespace=namespace,
            name=str(body.get("metadata", {}).get("name", "")),
        )
        return created

    def delete_deployment(self, *, namespace: str, name: str) -> bool:
        """Delete the Deployment and its pods (in the background); False when it was gone."""
        try:
            self._request(
                "DELETE",
                f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}",
                body={"propagationPolicy": "Background"},
                verb="delete",
                resource="deployments",
                namespace=namespace,
                name=name,
            )
        except KubeNotFound:
            return False
        return True

    # --- transport -------------------------------------------------------------------------------

    def _get(self, path: str, *, resource: str, namespace: str, name: str) -> Any:
        """A GET over the keep-alive connections, with the official client's headers (auth
        included, refreshed as that client would); the official path when there is no getter."""
        if self._getter is None:
            return self._request(
                "GET", path, verb="get", resource=resource, namespace=namespace, name=name
            )
        try:
            status, data = self._getter.get(path, self._get_headers())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _get_failed(exc, resource=resource, namespace=namespace, name=name) from exc
        return _decoded(status, data, verb="get", resource=resource, namespace=namespace, name=name)

    def _get_headers(self, accept: Mapping[str, str] = _ACCEPT_JSON) -> dict[str, str]:
        """The headers the official client sends (``ApiClient.param_serialize`` gives the same;
        a test compares). The token is asked for on every request, so the loaders' refresh hook
        runs as it would for the official client."""
        headers = {**accept, "User-Agent": USER_AGENT}
        auth = self._configuration.auth_settings().get("BearerToken")  # always a header
        if auth and auth["value"] is not None:
            headers[auth["key"]] = auth["value"]
        return headers

    def _request(
        self,
        method: str,
        path: str,
        *,
        verb: str,
        resource: str,
        query: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        namespace: str = "",
        name: str = "",
        stream: bool = False,
        timeout: tuple[float, float] | None = None,
    ) -> Any:
        """One HTTP request through the official client's transport; JSON in, JSON (or a
        stream) out."""
        url = self._configuration.host + path
        if query:
            url += "?" + "&".join(f"{key}={quote(value)}" for key, value in query.items())
        what = _describe(verb, resource, namespace=namespace, name=name)
        try:
            response = self._rest.request(  # type: ignore[no-untyped-call]
                method,
                url,
                headers=self._get_headers(_SEND_JSON),
                body=dict(body) if body is not None else None,
                _request_timeout=timeout or self._timeout,
            )
            if stream and 200 <= response.status < 300:
                return response.response
            response.read()
        except ApiException as exc:
            # The client reports TLS failures as ApiException with status 0.
            raise KubeUnavailable(
                f"{what}: cannot talk to the API server: {exc.reason}",
                verb=verb,
                resource=resource,
            ) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeUnavailable(
                f"{what}: API server unreachable: {_root_cause(exc)}", verb=verb, resource=resource
            ) from exc
        return _decoded(
            int(response.status),
            response.data,
            verb=verb,
            resource=resource,
            namespace=namespace,
            name=name,
        )


def _decoded(
    status: int, data: bytes | None, *, verb: str, resource: str, namespace: str, name: str
) -> Any:
    """A response body as JSON; a KubeError for an error status."""
    data = data or b"{}"
    try:
        decoded = json.loads(data)
    except ValueError:
        decoded = {"message": data[:200].decode("utf-8", "replace")}
    if status >= 400:
        raise _status_error(
            status, decoded, verb=verb, resource=resource, namespace=namespace, name=name
        )
    return decoded


def _get_failed(exc: Exception, *, resource: str, namespace: str, name: str) -> KubeError:
    """The KubeError for a keep-alive GET that got no usable answer."""
    what = _describe("get", resource, namespace=namespace, name=name)
    if isinstance(exc, TimeoutError):  # never retried: the deadline was the whole GET's
        return KubeUnavailable(
            f"{what}: API server timed out: {exc}", verb="get", resource=resource
        )
    if isinstance(exc, OSError):  # ssl.SSLError is one, and so is a connection closed under us
        return KubeUnavailable(
            f"{what}: API server unreachable: {exc}", verb="get", resource=resource
        )
    if isinstance(exc, http.client.HTTPException):
        return KubeUnavailable(
            f"{what}: broken answer from the API server: {exc}", verb="get", resource=resource
        )
    # a ValueError: a header the configuration gave cannot be sent
    return KubeError(f"{what}: {exc}", verb="get", resource=resource)


def _describe(verb: str, resource: str, *, namespace: str = "", name: str = "") -> str:
    target = f"{resource}/{name}" if name else resource
    return f"{verb} {target}" + (f" in namespace {namespace}" if namespace else "")


def _root_cause(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason) if isinstance(reason, BaseException) else str(exc)


def _qualified(resource: str) -> str:
    if resource == "deployments":
        return "deployments.apps"
    return resource if resource in ("nodes", "events", "pods", GROUP) else f"{resource}.{GROUP}"


def _status_error(
    status: int,
    body: Mapping[str, Any],
    *,
    verb: str,
    resource: str,
    namespace: str = "",
    name: str = "",
) -> KubeError:
    """The KubeError subclass for an HTTP status (or a watch ERROR event's Status object)."""
    message = str(body.get("message") or body.get("reason") or f"HTTP {status}")
    what = _describe(verb, resource, namespace=namespace, name=name)
    kw: dict[str, Any] = {"verb": verb, "resource": resource, "status": status}
    if status == 403:
        where = f" in namespace {namespace!r}" if namespace else ""
        return KubeForbidden(
            f"forbidden: the ServiceAccount may not {verb!r} {_qualified(resource)}{where}; "
            f"grant it in the ClusterRole (API server: {message})",
            **kw,
        )
    if status == 401:
        return KubeError(
            f"unauthorized: the API server rejected our credentials for {what} "
            f"(expired token or wrong kubeconfig): {message}",
            **kw,
        )
    if status == 404:
        return KubeNotFound(f"{what}: not found: {message}", **kw)
    if status == 409:
        return KubeConflict(f"{what}: conflict: {message}", **kw)
    if status == 410:
        return KubeGone(f"{what}: gone (resourceVersion too old): {message}", **kw)
    if status == 422:
        return KubeInvalid(f"{what}: the API server rejected the object: {message}", **kw)
    if status == 429 or status >= 500:
        return KubeUnavailable(f"{what}: API server answered {status}: {message}", **kw)
    return KubeError(f"{what}: API server answered {status}: {message}", **kw)


def claim_to_v1(claim: Mapping[str, Any], *, api_version: str | None = None) -> JsonDict:
    """A ResourceClaim read in any served version, in v1 shape.

    v1beta1 requests carry the ``exactly`` fields inline; v1beta2 and v1 nest them. Status is the
    same in all three.
    """
    out = dict(claim)
    version = api_version or str(claim.get("apiVersion", "")).rpartition("/")[2]
    out["apiVersion"] = f"{GROUP}/v1"
    devices = (claim.get("spec") or {}).get("devices")
    if version != "v1beta1" or not devices or not devices.get("requests"):
        return out
    requests = []
    for request in devices["requests"]:
        if "firstAvailable" in request:
            requests.append(
                {"name": request.get("name"), "firstAvailable": request["firstAvailable"]}
            )
        else:
            requests.append(
                {
                    "name": request.get("name"),
                    "exactly": {k: v for k, v in request.items() if k != "name"},
                }
            )
    out["spec"] = {**claim["spec"], "devices": {**devices, "requests": requests}}
    return out
