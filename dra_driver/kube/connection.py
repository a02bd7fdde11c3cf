"""The one connection to the Kubernetes API server, and the conversion of every failure.

Place in the flow: the base of :class:`~dra_driver.kube.client.KubeClient`; the per-resource
calls (resourceslices.py, resourceclaims.py, nodes.py, deployments.py, clusterreads.py) send
through :meth:`ApiConnection._request` (the official ``kubernetes`` client's transport) or, for the
claim GET of every prepare and the status apply of every claim, :meth:`ApiConnection._get` and
:meth:`ApiConnection._apply` (keepalive.py's plain keep-alive connections, with this client's
host, TLS settings and headers; keepalive.py says why). It also
finds which resource.k8s.io version the server serves: v1, else v1beta2, else v1beta1.

Errors are converted here and only here (``raise ... from exc``): HTTP statuses and urllib3
failures become the ``KubeError`` subclasses of errors.py. Timeouts are short and the client does
no retries of its own (urllib3 retries are switched off): callers decide, the publisher with
backoff.
"""

from __future__ import annotations

import http.client
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Self
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
from dra_driver.resourceapi import API_VERSIONS, GROUP


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

# Named as when this was one module: log lines keep their logger.
log = logging.getLogger("dra_driver.kube")

USER_AGENT = "gpu-dra/kubelet-plugin"
_ACCEPT_JSON: Mapping[str, str] = {"Accept": "application/json"}
_SEND_JSON: Mapping[str, str] = {"Accept": "application/json", "Content-Type": "application/json"}

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 3.0
_KUBECONFIG_FLAG = "--kubeconfig (KUBECONFIG)"


class ApiConnection:
    """The connection every API call of :class:`~dra_driver.kube.client.KubeClient` goes
    through. Thread-safe.

    Every call raises a KubeError subclass on failure: KubeForbidden names the RBAC rule that is
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
    ) -> Self:
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

    def _apply(
        self,
        path: str,
        *,
        query: Mapping[str, str],
        body: Mapping[str, Any],
        content_type: str,
        resource: str,
        namespace: str,
        name: str,
    ) -> Any:
        """A PATCH (a server-side apply: sending it twice does no harm) over the keep-alive
        connections, as ``_request`` would send it; the official path when there is no getter.
        Made once per claim (its status), where the official path's CPU showed."""
        if self._getter is None:
            return self._request(
                "PATCH", path, verb="patch", resource=resource, query=query, body=body,
                namespace=namespace, name=name, content_type=content_type,
            )  # fmt: skip
        path += "?" + "&".join(f"{key}={quote(value)}" for key, value in query.items())
        headers = {**self._get_headers(_SEND_JSON), "Content-Type": content_type}
        try:
            status, data = self._getter.request("PATCH", path, headers, json.dumps(body).encode())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _get_failed(
                exc, verb="patch", resource=resource, namespace=namespace, name=name
            ) from exc
        return _decoded(
            status, data, verb="patch", resource=resource, namespace=namespace, name=name
        )

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
        content_type: str = "application/json",
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
                headers={**self._get_headers(_SEND_JSON), "Content-Type": content_type},
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
    """A response body as JSON; a KubeError for an error status, and KubeUnavailable for a
    success whose body is not a JSON object (a proxy's HTML page, a truncated body, JSON nested
    deeper than the decoder's recursion limit): never a made-up object in its place."""
    data = data or b"{}"
    problem = ""
    try:
        decoded = json.loads(data)
    except ValueError as exc:
        problem = f"the body is not JSON ({exc})"
    except RecursionError:  # the C decoder's own depth limit (about 1,000 levels here)
        problem = "the body is JSON nested deeper than this agent decodes"
    if status >= 400:
        body = (
            decoded
            if not problem and isinstance(decoded, Mapping)
            else {"message": data[:200].decode("utf-8", "replace")}
        )
        raise status_error(
            status, body, verb=verb, resource=resource, namespace=namespace, name=name
        )
    if not problem and not isinstance(decoded, dict):
        problem = f"the body is a JSON {type(decoded).__name__}, not an object"
    if problem:
        what = _describe(verb, resource, namespace=namespace, name=name)
        raise KubeUnavailable(
            f"{what}: broken answer from the API server (HTTP {status}): {problem}",
            verb=verb,
            resource=resource,
            status=status,
        )
    return decoded


def _get_failed(
    exc: Exception, *, verb: str = "get", resource: str, namespace: str, name: str
) -> KubeError:
    """The KubeError for a keep-alive request that got no usable answer."""
    what = _describe(verb, resource, namespace=namespace, name=name)
    if isinstance(exc, TimeoutError):  # never retried: the deadline was the whole request's
        return KubeUnavailable(f"{what}: API server timed out: {exc}", verb=verb, resource=resource)
    if isinstance(exc, OSError):  # ssl.SSLError is one, and so is a connection closed under us
        return KubeUnavailable(
            f"{what}: API server unreachable: {exc}", verb=verb, resource=resource
        )
    if isinstance(exc, http.client.HTTPException):
        return KubeUnavailable(
            f"{what}: broken answer from the API server: {exc}", verb=verb, resource=resource
        )
    # a ValueError: a header the configuration gave cannot be sent
    return KubeError(f"{what}: {exc}", verb=verb, resource=resource)


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


def status_error(
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
