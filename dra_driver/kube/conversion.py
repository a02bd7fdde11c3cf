"""resource.k8s.io objects between the version the API server serves and the v1 shape.

Place in the flow: at the API boundary. Everything else in the driver speaks v1 JSON; the calls
of this package convert what they send (:func:`convert_slice`) and what they read
(:func:`slice_to_v1`, :func:`claim_to_v1`) for servers that serve only v1beta2 or v1beta1
(spec D.0). Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.resourceapi import API_VERSIONS, GROUP, JsonDict


def convert_slice(obj: Mapping[str, Any], *, api_version: str) -> JsonDict:
    """A v1 ResourceSlice in the shape of ``api_version`` (v1, v1beta2 or v1beta1).

    v1beta2 has the v1 shape; v1beta1 wraps each device's fields except ``name`` in ``basic``.
    """
    if api_version not in API_VERSIONS:
        raise ValueError(f"unsupported resource.k8s.io version {api_version!r}")
    out = dict(obj)
    out["apiVersion"] = f"{GROUP}/{api_version}"
    spec = obj.get("spec")
    if api_version == "v1beta1" and isinstance(spec, Mapping) and spec.get("devices"):
        out["spec"] = {
            **spec,
            "devices": [
                {"name": d["name"], "basic": {k: v for k, v in d.items() if k != "name"}}
                for d in spec["devices"]
            ],
        }
    return out


def slice_to_v1(obj: Mapping[str, Any], *, api_version: str | None = None) -> JsonDict:
    """A ResourceSlice read in any served version, in v1 shape (``basic`` unwrapped).

    ``api_version`` names the version it was read in; list items carry no ``apiVersion`` of their
    own, so callers converting list items must pass it.
    """
    out = dict(obj)
    version = api_version or str(obj.get("apiVersion", f"{GROUP}/v1")).rpartition("/")[2]
    out["apiVersion"] = f"{GROUP}/v1"
    spec = obj.get("spec")
    if version == "v1beta1" and isinstance(spec, Mapping) and spec.get("devices"):
        out["spec"] = {
            **spec,
            "devices": [{"name": d.get("name"), **(d.get("basic") or {})} for d in spec["devices"]],
        }
    return out


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
