"""Pure: an AdmissionReview (admission.k8s.io/v1) of a ResourceClaim or ResourceClaimTemplate ->
the answer, allowed or refused with every bad opaque config of this driver named.

What is checked is what the agent checks when it prepares (prepare/deviceconfig.py ``decode``:
apiVersion, kind, every field, strictly; ``check_supported``: what the agent refuses to carry out,
for the kinds whose device type is known from the kind itself). Configs of other drivers and
requests of other resources are allowed untouched. A config's kind that does not fit the device
is only known once a device is allocated, so that stays the agent's check.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_driver.errors import ConfigDecodeError, ConfigNotSupported
from dra_driver.prepare.deviceconfig import check_supported, decode

REVIEW_VERSION = "admission.k8s.io/v1"
KINDS = ("ResourceClaim", "ResourceClaimTemplate")


def claim_spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """The claim spec of a ResourceClaim, or the one inside a ResourceClaimTemplate."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "ResourceClaimTemplate":
        spec = spec.get("spec") or {}
    return spec if isinstance(spec, Mapping) else {}


def config_problems(obj: Mapping[str, Any], *, driver: str) -> list[str]:
    """Every opaque config of ``driver`` in the object that the agent would refuse."""
    devices = claim_spec(obj).get("devices") or {}
    problems = []
    for i, entry in enumerate(devices.get("config") or ()):
        opaque = (entry or {}).get("opaque") if isinstance(entry, Mapping) else None
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        where = f"spec.devices.config[{i}].opaque.parameters"
        if obj.get("kind") == "ResourceClaimTemplate":
            where = f"spec.{where}"
        requests = ", ".join(entry.get("requests") or ()) or "every request"
        try:
            config = decode(opaque.get("parameters"))
            check_supported(config, device_name="(any)", request=requests)
        except (ConfigDecodeError, ConfigNotSupported) as exc:
            problems.append(f"{where}: {exc}")
    return problems


def review(body: Mapping[str, Any], *, driver: str) -> dict[str, Any]:
    """The AdmissionReview answering ``body``; ValueError when ``body`` is not a v1 review."""
    if body.get("apiVersion") != REVIEW_VERSION or body.get("kind") != "AdmissionReview":
        raise ValueError(f"expected an {REVIEW_VERSION} AdmissionReview")
    request = body.get("request")
    if not isinstance(request, Mapping) or not request.get("uid"):
        raise ValueError("the AdmissionReview has no request uid")
    response: dict[str, Any] = {"uid": request["uid"], "allowed": True}
    obj = request.get("object")
    if isinstance(obj, Mapping) and obj.get("kind") in KINDS:
        problems = config_problems(obj, driver=driver)
        if problems:
            name = (obj.get("metadata") or {}).get("name") or request.get("name") or ""
            response["allowed"] = False
            response["status"] = {
                "status": "Failure",
                "code": 422,
                "reason": "Invalid",
                "message": f"{obj['kind']} {name!r}: invalid {driver} config: "
                + "; ".join(problems),
            }
    return {"apiVersion": REVIEW_VERSION, "kind": "AdmissionReview", "response": response}
