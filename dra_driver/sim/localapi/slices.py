"""ResourceSlice admission on the local API server: what a write of a slice goes through before
it is stored. Taints get ``timeAdded``, the spec D.1 rules the driver must respect are checked,
and the fields the real server keeps immutable stay so; problems are answered with 422, as the
real server answers them."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from dra_driver.sim.localapi.resources import ApiError, JsonDict, now
from dra_driver.sim.localapi.selectors import field_value


def admit_slice(obj: JsonDict, *, old: JsonDict | None, validate: bool) -> None:
    """Stamp ``obj``'s new taints with ``timeAdded`` (in place); with ``validate``, raise a 422
    ApiError for a slice that breaks spec D.1 or changes an immutable field of ``old``."""
    spec = obj.get("spec") or {}
    for device in spec.get("devices") or ():
        for taint in device.get("taints") or ():
            taint.setdefault("timeAdded", now())
    if not validate:
        return
    problems = validate_slice(obj)
    if old is not None:
        for path in (("driver",), ("pool", "name"), ("nodeName",)):
            if field_value(spec, path) != field_value(old.get("spec") or {}, path):
                problems.append(f"spec.{'.'.join(path)}: field is immutable")
    if problems:
        raise ApiError(
            422,
            "Invalid",
            f'ResourceSlice.resource.k8s.io "{obj["metadata"]["name"]}" is invalid: '
            + "; ".join(problems),
        )


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
