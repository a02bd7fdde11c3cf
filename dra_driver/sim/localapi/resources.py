"""The resources the local API server knows: kind, group and scope of each, where each is
served, the route a request names, and the Status answers of its errors. Every other module of
the server reads its resource facts from here."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

GROUP = "resource.k8s.io"
ALL_VERSIONS = ("v1", "v1beta2", "v1beta1")
KINDS = {
    "resourceslices": ("ResourceSlice", False),
    "resourceclaims": ("ResourceClaim", True),
    "deviceclasses": ("DeviceClass", False),
    "nodes": ("Node", False),
    "events": ("Event", True),
    "pods": ("Pod", True),
    "devicetaintrules": ("DeviceTaintRule", False),
    "deployments": ("Deployment", True),
}
CORE = ("nodes", "events", "pods")  # served under /api/v1
APPS = ("deployments",)  # served under /apis/apps/v1
JsonDict = dict[str, Any]


def group_of(resource: str) -> str:
    """The API group of a resource this server knows ("" is the core group)."""
    if resource in APPS:
        return "apps"
    return "" if resource in CORE else GROUP


@dataclass(frozen=True)
class Route:
    """The object or collection a request names."""

    resource: str
    version: str  # "v1" for core, else the resource.k8s.io version
    namespace: str
    name: str
    subresource: str = ""  # "status" (ResourceClaims only: claimstatus.py)

    @property
    def logged(self) -> str:
        """The resource as RBAC names it: ``resourceclaims/status`` for the subresource."""
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def api_version(route: Route) -> str:
    """The ``apiVersion`` of the objects answered on ``route``."""
    if route.resource in APPS:
        return "apps/v1"
    return "v1" if route.resource in CORE else f"{GROUP}/{route.version}"


def resource_info(resource: str) -> JsonDict:
    """``resource``'s entry in an APIResourceList."""
    kind, namespaced = KINDS[resource]
    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    return {"name": resource, "namespaced": namespaced, "kind": kind, "verbs": verbs}


class ApiError(Exception):
    """A request refused: answered as a Status with ``status`` as the HTTP code."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.message = status, reason, message


def failure_status(code: int, reason: str, message: str) -> JsonDict:
    """A failure Status object, as the API server writes it."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def not_found(route: Route) -> ApiError:
    """The 404 of a named object that is not stored."""
    group = group_of(route.resource)
    qualified = f"{route.resource}.{group}" if group else route.resource
    return ApiError(404, "NotFound", f'{qualified} "{route.name}" not found')


def now() -> str:
    """The current time as the API server writes timestamps (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
