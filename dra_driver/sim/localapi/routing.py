"""Request paths of the local API server: the discovery documents, a resource path -> the
``Route`` it names (404 for what the server does not serve), and method -> Kubernetes verb."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import unquote

from dra_driver.sim.localapi.resources import (
    APPS,
    CORE,
    GROUP,
    KINDS,
    ApiError,
    JsonDict,
    Route,
    resource_info,
)
from dra_driver.sim.localapi.store import ServedApi


def discovery(path: str, api: ServedApi) -> JsonDict | None:
    """The discovery document at ``path``; None when ``path`` is not a discovery path."""
    versions = api.served_versions
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
            "resources": [resource_info(r) for r in api.resources_served(version)],
        }
    return None


def route_of(path: str, api: ServedApi) -> Route:
    """The resource (and object, if named) that ``path`` names; 404 ApiError for a path this
    server does not serve."""
    parts = [unquote(p) for p in path.strip("/").split("/")]
    not_found = ApiError(404, "NotFound", "the server could not find the requested resource")
    if parts[:2] == ["api", "v1"]:
        version, rest = "v1", parts[2:]
    elif parts[:3] == ["apis", "apps", "v1"]:
        version, rest = "v1", parts[3:]
        if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] in APPS:
            namespace = rest[1]
            if len(rest) > 4:
                raise not_found
            return Route(rest[2], version, namespace, rest[3] if len(rest) == 4 else "")
        raise not_found
    elif parts[:2] == ["apis", GROUP] and len(parts) > 2 and parts[2] in api.served_versions:
        version, rest = parts[2], parts[3:]
    else:
        raise not_found
    namespace = ""
    if len(rest) >= 2 and rest[0] == "namespaces":
        namespace, rest = rest[1], rest[2:]
    subresource = ""
    if len(rest) == 3 and rest[0] == "resourceclaims" and rest[2] == "status":
        subresource, rest = "status", rest[:2]
    if not rest or rest[0] not in KINDS or len(rest) > 2:
        raise not_found
    resource = rest[0]
    if parts[0] == "apis" and resource not in api.resources_served(version):
        raise not_found
    if (version == "v1" and resource not in CORE) and parts[0] == "api":
        raise not_found
    if parts[0] == "apis" and resource in CORE + APPS:
        raise not_found
    namespaced = KINDS[resource][1]
    # A namespaced resource may be listed across namespaces, but not read by name without one.
    if (namespace and not namespaced) or (namespaced and not namespace and len(rest) == 2):
        raise not_found
    return Route(resource, version, namespace, rest[1] if len(rest) == 2 else "", subresource)


def verb_of(method: str, route: Route, query: Mapping[str, str]) -> str:
    """The Kubernetes verb of an HTTP ``method`` on ``route``; 405 ApiError for none."""
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
