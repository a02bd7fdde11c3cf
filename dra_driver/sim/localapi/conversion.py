"""Version conversion of the local API server: objects are stored in v1 shape and converted per
request. v1beta1 differs where the driver sees it: a ResourceSlice's device attributes sit under
``basic``, and a ResourceClaim's requests are flat instead of under ``exactly``; v1beta2 has the
v1 shape."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from dra_driver.sim.localapi.resources import APPS, CORE, KINDS, JsonDict, Route, api_version


def to_storage(route: Route, obj: JsonDict) -> JsonDict:
    """A request body in the route's version -> v1 storage shape (a copy)."""
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


def to_version(route: Route, obj: Mapping[str, Any], *, with_type: bool) -> JsonDict:
    """A stored v1-shape object -> the route's version (kind/apiVersion only outside lists)."""
    out: JsonDict = json.loads(json.dumps(obj))  # a deep copy (of JSON data: 5x deepcopy)
    if with_type:
        out = {"kind": KINDS[route.resource][0], "apiVersion": api_version(route), **out}
    if route.version != "v1beta1" or route.resource in CORE + APPS:
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
