"""Objects in the real API server, as a user's ``kubectl apply/get/delete`` would handle them
(the admin's client certificate; the driver under test uses its own client)."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

# kind: (API path prefix, plural, namespaced)
KINDS: dict[str, tuple[str, str, bool]] = {
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Pod": ("/api/v1", "pods", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "Event": ("/api/v1", "events", True),
    "Deployment": ("/apis/apps/v1", "deployments", True),
    "DaemonSet": ("/apis/apps/v1", "daemonsets", True),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "ResourceClaimTemplate": ("/apis/resource.k8s.io/v1", "resourceclaimtemplates", True),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
}


class Requester(Protocol):
    def request(self, method: str, path: str, body: Any = None, *, patch: str = "") -> Any: ...


def path(kind: str, namespace: str = "", name: str = "") -> str:
    prefix, plural, namespaced = KINDS[kind]
    out = prefix + (f"/namespaces/{namespace}" if namespaced and namespace else "") + f"/{plural}"
    return out + (f"/{name}" if name else "")


def create(api: Requester, doc: dict[str, Any]) -> dict[str, Any]:
    meta = doc["metadata"]
    result: dict[str, Any] = api.request(
        "POST", path(doc["kind"], meta.get("namespace", "default")), doc
    )
    return result


def get(api: Requester, kind: str, name: str, namespace: str = "default") -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = api.request("GET", path(kind, namespace, name))
        return result
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            return None
        raise


def items(
    api: Requester, kind: str, namespace: str = "", selector: str = ""
) -> list[dict[str, Any]]:
    query = f"?labelSelector={selector}" if selector else ""
    result: list[dict[str, Any]] = api.request("GET", path(kind, namespace) + query)["items"]
    return result


def delete(api: Requester, kind: str, name: str, namespace: str = "default") -> None:
    try:
        api.request("DELETE", path(kind, namespace, name), {"propagationPolicy": "Background"})
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code != 404:
            raise


def wait(
    what: str, probe: Callable[[], T | None], *, timeout_s: float = 60.0, every_s: float = 0.2
) -> T:
    """Until ``probe()`` answers something other than None (or False); its answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = probe()
        if answer is not None and answer is not False:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)


def pod_phase(api: Requester, name: str, namespace: str) -> str:
    pod = get(api, "Pod", name, namespace)
    return "" if pod is None else str(pod.get("status", {}).get("phase", ""))


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None
