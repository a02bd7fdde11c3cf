"""This node's pool as ResourceSlice bodies, and the plan that makes the API server match. Pure.

Place in the flow: ``devices.NodeDevices`` -> :func:`build_slices` -> :class:`DesiredPool` ->
:func:`plan_sync` (against the slices the server has) -> :class:`SyncPlan`, which publisher.py
carries out through kube.py. Nothing here does I/O; every object is resource.k8s.io/v1 JSON, and
:func:`convert_slice` / :func:`slice_to_v1` translate at the kube.py boundary for servers that
only serve v1beta2 or v1beta1.

How the pool is split into slices (spec D.1, nvidia-compat.md "API limits"):

* Since 1.35 a ResourceSlice carries either ``devices`` or ``sharedCounters``, never both, and
  counter-set names are unique in the whole pool. So the counter sets go into slices of their own,
  at most 8 per slice, and come first (indices ``0..k-1``); the devices follow in their given order
  (devices.py emits them GPU by GPU), packed greedily: at most 128 per slice, at most 64 once any
  device in that slice consumes counters or carries taints. The same NodeDevices always gives the
  same slices at the same indices, which is what lets a restart write nothing.
* A pool with neither devices nor counter sets is still published as one empty slice: it tells the
  scheduler the driver runs but has nothing to offer (spec G.1).
* On a 1.34 server with DRAPartitionableDevices (alpha) the old model wanted counter sets beside
  the devices in the same slice; that combination is not supported (the gate is off by default
  there, and the API server then drops the counter fields, which the publisher reports).

Identity and generations follow the 1.36 helper (spec G.3/G.4): slice ``i`` is created with
``generateName = "<i as 5+ hex digits>-<driver>-<node>-"`` and existing slices are matched to
indices by that prefix; the pool generation is kept when at most one slice changes and none is
created, bumped otherwise, so restarting with unchanged devices plans zero writes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from dra_driver.devices import CounterSet, Device, NodeDevices, RequestPolicy, Version
from dra_driver.errors import PublishError

JsonDict = dict[str, Any]

GROUP = "resource.k8s.io"
API_VERSIONS = ("v1", "v1beta2", "v1beta1")
"""Versions of resource.k8s.io this driver can publish with, most preferred first."""

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS = 64
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
_INDEX_MIN_DIGITS = 5
# names.SimpleNameGenerator keeps at most 63 - 5 characters of a generateName before it appends
# its five random characters; matching must look at that same truncated prefix.
_GENERATED_PREFIX_MAX = 58
_TAINT_TIME_TOLERANCE_S = 1.0
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_PROBLEMS_SHOWN = 10


@dataclass(frozen=True)
class SliceContent:
    """What one ResourceSlice carries besides its identity: v1 JSON devices or counter sets."""

    devices: tuple[JsonDict, ...] = ()
    shared_counters: tuple[JsonDict, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DesiredPool:
    """The slices this node should have, in index order. The pool is named after the node.

    ``generation`` is the driver's minimum pool generation (G.3 step 6): a value above the one
    found on the server is used as is; otherwise :func:`plan_sync` decides.
    """

    driver_name: str
    node_name: str
    slices: tuple[SliceContent, ...]
    generation: int = 1

    @property
    def pool_name(self) -> str:
        return self.node_name

    def generate_name(self, index: int) -> str:
        """``generateName`` of slice ``index``: ``00000-gpu.nvidia.com-node1-``."""
        return f"{index:0{_INDEX_MIN_DIGITS}x}-{self.driver_name}-{self.node_name}-"

    def with_slice(self, index: int, content: SliceContent) -> DesiredPool:
        """A copy with slice ``index`` replaced (used to adopt what the server stored)."""
        slices = list(self.slices)
        slices[index] = content
        return replace(self, slices=tuple(slices))

    @property
    def device_count(self) -> int:
        return sum(len(s.devices) for s in self.slices)


@dataclass(frozen=True)
class SliceRef:
    """An existing slice to delete, with the preconditions that make the delete safe."""

    name: str
    uid: str
    resource_version: str


@dataclass(frozen=True)
class SliceWrite:
    """A full v1 ResourceSlice body for desired slice ``index`` (create or update)."""

    index: int
    body: JsonDict


@dataclass(frozen=True)
class SyncPlan:
    """Writes that make the server's slices equal the desired pool, in the order to run them.

    Deletes first, then updates, then creates (G.3 step 7). ``generation`` is the pool generation
    every written slice carries; ``bumped`` says it went up.
    """

    generation: int
    bumped: bool
    deletes: tuple[SliceRef, ...] = ()
    updates: tuple[SliceWrite, ...] = ()
    creates: tuple[SliceWrite, ...] = ()
    unchanged: tuple[str, ...] = field(default=())  # names of matched slices left as they are

    @property
    def write_count(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


# --- building the desired pool -------------------------------------------------------------------


def build_slices(
    node_devices: NodeDevices, *, driver_name: str, node_name: str, generation: int = 1
) -> DesiredPool:
    """Split ``node_devices`` into slices within the API limits; raise PublishError if invalid.

    Validation is the helper's client-side pool check (G.1): device names and counter-set names
    unique in the pool, every ``consumesCounters`` entry naming an existing set and counter.
    """
    validate_pool(node_devices)
    slices: list[SliceContent] = [
        SliceContent(shared_counters=tuple(_counter_set_json(cs) for cs in chunk))
        for chunk in _chunks(node_devices.counter_sets, MAX_COUNTER_SETS_PER_SLICE)
    ]
    chunk: list[JsonDict] = []
    limited = False
    for device in node_devices.devices:
        needs_limit = bool(device.consumes_counters or device.taints)
        limit = (
            MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
            if limited or needs_limit
            else MAX_DEVICES_PER_SLICE
        )
        if len(chunk) >= limit:
            slices.append(SliceContent(devices=tuple(chunk)))
            chunk, limited = [], False
        chunk.append(device_json(device))
        limited = limited or needs_limit
    if chunk:
        slices.append(SliceContent(devices=tuple(chunk)))
    if not slices:
        slices.append(SliceContent())
    return DesiredPool(
        driver_name=driver_name,
        node_name=node_name,
        slices=tuple(slices),
        generation=generation,
    )


def validate_pool(node_devices: NodeDevices) -> None:
    """Raise PublishError naming every problem the API server or scheduler would trip over."""
    problems: list[str] = []
    sets: dict[str, Mapping[str, str]] = {}
    for cs in node_devices.counter_sets:
        if not _DNS_LABEL.match(cs.name):
            problems.append(f"counter set name {cs.name!r} is not a DNS label")
        if cs.name in sets:
            problems.append(f"counter set {cs.name!r} is defined twice in the pool")
        if not 1 <= len(cs.counters) <= MAX_COUNTERS_PER_SET:
            problems.append(
                f"counter set {cs.name!r} has {len(cs.counters)} counters; the API allows 1 to "
                f"{MAX_COUNTERS_PER_SET}"
            )
        sets[cs.name] = cs.counters
    seen: set[str] = set()
    for device in node_devices.devices:
        if not _DNS_LABEL.match(device.name):
            problems.append(f"device name {device.name!r} is not a DNS label")
        if device.name in seen:
            problems.append(f"device {device.name!r} appears twice in the pool")
        seen.add(device.name)
        used_sets: set[str] = set()
        for consumption in device.consumes_counters:
            if consumption.counter_set in used_sets:
                problems.append(
                    f"device {device.name!r} consumes from counter set "
                    f"{consumption.counter_set!r} twice"
                )
            used_sets.add(consumption.counter_set)
            available = sets.get(consumption.counter_set)
            if available is None:
                problems.append(
                    f"device {device.name!r} consumes from counter set "
                    f"{consumption.counter_set!r}, which the pool does not define"
                )
                continue
            problems.extend(
                f"device {device.name!r} consumes counter {counter!r}, which counter set "
                f"{consumption.counter_set!r} does not have"
                for counter in consumption.counters
                if counter not in available
            )
    if problems:
        shown = problems[:_MAX_PROBLEMS_SHOWN]
        more = len(problems) - len(shown)
        suffix = f"; and {more} more" if more else ""
        raise PublishError("invalid device pool: " + "; ".join(shown) + suffix)


def device_json(device: Device) -> JsonDict:
    """One device in resource.k8s.io/v1 JSON, with empty fields left out as the server does."""
    out: JsonDict = {"name": device.name}
    if device.attributes:
        out["attributes"] = {k: _attribute_json(v) for k, v in device.attributes.items()}
    if device.capacity:
        out["capacity"] = {k: {"value": v} for k, v in device.capacity.items()}
        for name, policy in device.request_policies.items():
            out["capacity"][name]["requestPolicy"] = _request_policy_json(policy)
    if device.consumes_counters:
        out["consumesCounters"] = [
            {
                "counterSet": c.counter_set,
                "counters": {name: {"value": v} for name, v in c.counters.items()},
            }
            for c in device.consumes_counters
        ]
    if device.allow_multiple_allocations:
        out["allowMultipleAllocations"] = True
    if device.taints:
        out["taints"] = [
            {"key": t.key, "value": t.value, "effect": t.effect}
            if t.value
            else {"key": t.key, "effect": t.effect}
            for t in device.taints
        ]
    return out


def _request_policy_json(policy: RequestPolicy) -> JsonDict:
    out: JsonDict = {}
    if policy.default is not None:
        out["default"] = policy.default
    if policy.valid_values:
        out["validValues"] = list(policy.valid_values)
    if policy.range_min is not None:
        valid_range = {"min": policy.range_min}
        if policy.range_max is not None:
            valid_range["max"] = policy.range_max
        if policy.range_step is not None:
            valid_range["step"] = policy.range_step
        out["validRange"] = valid_range
    return out


def _attribute_json(value: bool | int | str | Version) -> JsonDict:
    # bool first: it is an int subclass.
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.value}
    return {"string": value}


def _counter_set_json(counter_set: CounterSet) -> JsonDict:
    return {
        "name": counter_set.name,
        "counters": {name: {"value": v} for name, v in counter_set.counters.items()},
    }


def _chunks(items: Sequence[CounterSet], size: int) -> Iterable[Sequence[CounterSet]]:
    return (items[i : i + size] for i in range(0, len(items), size))


# --- API objects ---------------------------------------------------------------------------------


def owner_reference(*, node_name: str, node_uid: str) -> JsonDict:
    """The Node as controlling owner: the garbage collector deletes our slices with the Node."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "name": node_name,
        "uid": node_uid,
        "controller": True,
    }


def to_api_object(pool: DesiredPool, *, index: int, generation: int, node_uid: str) -> JsonDict:
    """Slice ``index`` of ``pool`` as a v1 ResourceSlice to create (``generateName`` set)."""
    content = pool.slices[index]
    spec: JsonDict = {
        "driver": pool.driver_name,
        "nodeName": pool.node_name,
        "pool": {
            "name": pool.pool_name,
            "generation": generation,
            "resourceSliceCount": len(pool.slices),
        },
    }
    if content.devices:
        spec["devices"] = list(content.devices)
    if content.shared_counters:
        spec["sharedCounters"] = list(content.shared_counters)
    return {
        "apiVersion": f"{GROUP}/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "generateName": pool.generate_name(index),
            "ownerReferences": [owner_reference(node_name=pool.node_name, node_uid=node_uid)],
        },
        "spec": spec,
    }


def to_api_objects(
    pool: DesiredPool, *, node_uid: str, generation: int | None = None
) -> list[JsonDict]:
    """Every slice of ``pool`` as v1 objects to create, at ``generation`` (default: the pool's)."""
    gen = pool.generation if generation is None else generation
    return [
        to_api_object(pool, index=i, generation=gen, node_uid=node_uid)
        for i in range(len(pool.slices))
    ]


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


def content_of(obj: Mapping[str, Any]) -> SliceContent:
    """The devices and counter sets of a v1 ResourceSlice object."""
    spec = obj.get("spec") or {}
    return SliceContent(
        devices=tuple(spec.get("devices") or ()),
        shared_counters=tuple(spec.get("sharedCounters") or ()),
    )


# --- diff ----------------------------------------------------------------------------------------


def slice_index(name: str, pool: DesiredPool) -> int | None:
    """The desired index an existing slice's name claims, or None if it is not one of ours.

    The name must start with the (possibly truncated) generateName of that index.
    """
    head, sep, _ = name.partition("-")
    if not sep or len(head) < _INDEX_MIN_DIGITS:
        return None
    try:
        index = int(head, 16)
    except ValueError:
        return None
    if head != f"{index:0{_INDEX_MIN_DIGITS}x}":
        return None
    if not name.startswith(pool.generate_name(index)[:_GENERATED_PREFIX_MAX]):
        return None
    return index


def plan_sync(
    pool: DesiredPool, existing: Sequence[Mapping[str, Any]], *, node_uid: str
) -> SyncPlan:
    """The G.3 sync of one pool: what to delete, update and create, and at which generation.

    ``existing`` are the v1 slices of our driver on our node as the server has them (other
    pools there are ours from an earlier name and get deleted). Deterministic: the same inputs give
    the same plan; unchanged devices on a restart give an empty plan.
    """
    ours: list[Mapping[str, Any]] = []
    obsolete: list[Mapping[str, Any]] = []
    for s in existing:
        in_pool = _spec(s).get("pool", {}).get("name") == pool.pool_name
        (ours if in_pool else obsolete).append(s)
    current = max((int(_spec(s)["pool"].get("generation", 0)) for s in ours), default=0)

    matched: dict[int, Mapping[str, Any]] = {}
    for s in sorted(ours, key=_name):
        index = slice_index(_name(s), pool)
        if (
            int(_spec(s)["pool"].get("generation", 0)) < current
            or index is None
            or index >= len(pool.slices)
            or index in matched
        ):
            obsolete.append(s)
        else:
            matched[index] = s

    changed = {i for i, s in matched.items() if _slice_changed(pool, i, s, generation=current)}
    missing = [i for i in range(len(pool.slices)) if i not in matched]

    if pool.generation > current:
        generation, bumped = pool.generation, True
    elif not missing and len(changed) <= 1:
        generation, bumped = current, False
    else:
        generation, bumped = current + 1, True

    to_update = sorted(matched) if bumped else sorted(changed)
    return SyncPlan(
        generation=generation,
        bumped=bumped,
        deletes=tuple(
            SliceRef(
                name=_name(s),
                uid=str(s["metadata"].get("uid", "")),
                resource_version=str(s["metadata"].get("resourceVersion", "")),
            )
            for s in sorted(obsolete, key=_name)
        ),
        updates=tuple(
            SliceWrite(
                index=i,
                body=_update_body(pool, i, matched[i], generation=generation, node_uid=node_uid),
            )
            for i in to_update
        ),
        creates=tuple(
            SliceWrite(
                index=i,
                body=to_api_object(pool, index=i, generation=generation, node_uid=node_uid),
            )
            for i in missing
        ),
        unchanged=tuple(_name(matched[i]) for i in sorted(matched) if i not in to_update),
    )


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _slice_changed(
    pool: DesiredPool, index: int, existing: Mapping[str, Any], *, generation: int
) -> bool:
    spec = _spec(existing)
    desired = pool.slices[index]
    if spec.get("pool") != {
        "name": pool.pool_name,
        "generation": generation,
        "resourceSliceCount": len(pool.slices),
    }:
        return True
    if spec.get("nodeName") != pool.node_name or spec.get("nodeSelector") or spec.get("allNodes"):
        return True
    if spec.get("perDeviceNodeSelection"):
        return True
    if list(desired.shared_counters) != list(spec.get("sharedCounters") or ()):
        return True
    return not same_devices(desired.devices, spec.get("devices") or ())


def same_devices(desired: Sequence[JsonDict], stored: Sequence[Mapping[str, Any]]) -> bool:
    """Order-sensitive equality; a taint's ``timeAdded`` is equal if either side lacks it and
    otherwise within one second (G.3 step 5)."""
    if len(desired) != len(stored):
        return False
    return all(
        d == s or _same_device_modulo_taint_time(d, s) for d, s in zip(desired, stored, strict=True)
    )


def _same_device_modulo_taint_time(desired: Mapping[str, Any], stored: Mapping[str, Any]) -> bool:
    if {k: v for k, v in desired.items() if k != "taints"} != {
        k: v for k, v in stored.items() if k != "taints"
    }:
        return False
    d_taints, s_taints = desired.get("taints") or [], stored.get("taints") or []
    if len(d_taints) != len(s_taints):
        return False
    for d, s in zip(d_taints, s_taints, strict=True):
        if _taint_identity(d) != _taint_identity(s):
            return False
        d_time, s_time = d.get("timeAdded"), s.get("timeAdded")
        if d_time and s_time:
            delta = abs((_parse_time(d_time) - _parse_time(s_time)).total_seconds())
            if delta > _TAINT_TIME_TOLERANCE_S:
                return False
    return True


def _taint_identity(taint: Mapping[str, Any]) -> tuple[str, str, str]:
    return (str(taint.get("key", "")), str(taint.get("value", "")), str(taint.get("effect", "")))


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _update_body(
    pool: DesiredPool,
    index: int,
    existing: Mapping[str, Any],
    *,
    generation: int,
    node_uid: str,
) -> JsonDict:
    """The existing object with the desired spec: identity and resourceVersion kept, so the
    update fails with a conflict if someone changed it meanwhile."""
    body = to_api_object(pool, index=index, generation=generation, node_uid=node_uid)
    body["metadata"] = {
        k: v for k, v in existing.get("metadata", {}).items() if k not in ("managedFields",)
    }
    if "devices" in body["spec"]:
        body["spec"]["devices"] = _keep_taint_times(
            body["spec"]["devices"], _spec(existing).get("devices") or ()
        )
    return body


def _keep_taint_times(
    desired: Sequence[JsonDict], stored: Sequence[Mapping[str, Any]]
) -> list[JsonDict]:
    """Copy server-set taint ``timeAdded`` values into unchanged taints, so an update does not
    restart the clock of a NoExecute taint's tolerationSeconds (G.3 step 9)."""
    times: dict[tuple[str, tuple[str, str, str]], str] = {}
    for device in stored:
        for taint in device.get("taints") or ():
            if taint.get("timeAdded"):
                times[(str(device.get("name")), _taint_identity(taint))] = taint["timeAdded"]
    if not times:
        return list(desired)
    out: list[JsonDict] = []
    for device in desired:
        taints = device.get("taints")
        if not taints:
            out.append(device)
            continue
        kept = []
        for taint in taints:
            when = times.get((device["name"], _taint_identity(taint)))
            kept.append(
                {**taint, "timeAdded": when} if when and "timeAdded" not in taint else taint
            )
        out.append({**device, "taints": kept})
    return out


# --- fields the server dropped -------------------------------------------------------------------

_DEVICE_FIELD_GATES = {
    "taints": "DRADeviceTaints",
    "consumesCounters": "DRAPartitionableDevices",
    "nodeName": "DRAPartitionableDevices",
    "nodeSelector": "DRAPartitionableDevices",
    "allNodes": "DRAPartitionableDevices",
    "bindsToNode": "DRADeviceBindingConditions",
    "bindingConditions": "DRADeviceBindingConditions",
    "bindingFailureConditions": "DRADeviceBindingConditions",
    "allowMultipleAllocations": "DRAConsumableCapacity",
}
_LIST_ATTRIBUTE_KINDS = ("ints", "bools", "strings", "versions")


@dataclass(frozen=True)
class DroppedField:
    """A field we sent that the server did not store, and the feature gate that governs it."""

    path: str  # e.g. "devices[].taints"
    gate: str  # e.g. "DRADeviceTaints"; "" when no known gate explains the difference


def dropped_fields(sent: SliceContent, stored: SliceContent) -> tuple[DroppedField, ...]:
    """What the server left out of ``stored`` compared to ``sent`` (spec D.0: fields behind a
    disabled gate are silently dropped). Empty when they are equal."""
    if sent.shared_counters == stored.shared_counters and same_devices(
        sent.devices, stored.devices
    ):
        return ()
    found: dict[str, str] = {}
    if sent.shared_counters and not stored.shared_counters:
        found["sharedCounters"] = "DRAPartitionableDevices"
    stored_by_name = {d.get("name"): d for d in stored.devices}
    for device in sent.devices:
        kept = stored_by_name.get(device["name"], {})
        for key, gate in _DEVICE_FIELD_GATES.items():
            if key in device and key not in kept:
                found[f"devices[].{key}"] = gate
        for name, cap in (device.get("capacity") or {}).items():
            if "requestPolicy" in cap and "requestPolicy" not in (
                (kept.get("capacity") or {}).get(name) or {}
            ):
                found["devices[].capacity[].requestPolicy"] = "DRAConsumableCapacity"
        for name, attr in (device.get("attributes") or {}).items():
            if any(k in attr for k in _LIST_ATTRIBUTE_KINDS) and name not in (
                kept.get("attributes") or {}
            ):
                found["devices[].attributes (list values)"] = "DRAListTypeAttributes"
    if not found:
        return (DroppedField(path="spec", gate=""),)
    return tuple(DroppedField(path=p, gate=g) for p, g in sorted(found.items()))
