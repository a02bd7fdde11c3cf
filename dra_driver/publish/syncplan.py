"""The plan that makes the API server's slices equal this node's pool, and what it dropped. Pure.

Place in the flow: publisher.py lists the slices the server has, and :func:`plan_sync` compares
them with the :class:`~dra_driver.publish.slices.DesiredPool` of slices.py: the result,
a :class:`SyncPlan`, is the deletes, updates and creates publisher.py then sends through kube/.
After a write, :func:`dropped_fields` tells which fields the server did not store (a feature gate
that is off). Nothing here does I/O.

Generations follow the 1.36 helper (spec G.3/G.4): existing slices are matched to indices by
their generateName prefix (slices.py :func:`~dra_driver.publish.slices.slice_index`); the pool
generation is kept when at most one slice changes and none is created, bumped otherwise, so
restarting with unchanged devices plans zero writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from dra_driver.publish.slices import DesiredPool, SliceContent, slice_index, to_api_object
from dra_driver.resourceapi import JsonDict

_TAINT_TIME_TOLERANCE_S = 1.0


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

    changed = {
        i
        for i, s in matched.items()
        if _slice_changed(pool, i, s, generation=current) or not _owned(s, node_uid=node_uid)
    }
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


def _owned(existing: Mapping[str, Any], *, node_uid: str) -> bool:
    """Whether the stored slice has this Node (this incarnation of it: its uid) as an owner, so
    the garbage collector deletes it with the Node. True when the Node's uid is not known."""
    if not node_uid:
        return True
    refs = existing.get("metadata", {}).get("ownerReferences") or ()
    return any(
        isinstance(r, Mapping) and r.get("kind") == "Node" and r.get("uid") == node_uid
        for r in refs
    )


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
    wanted = body["metadata"]["ownerReferences"]
    body["metadata"] = {
        k: v for k, v in existing.get("metadata", {}).items() if k not in ("managedFields",)
    }
    if not _owned(existing, node_uid=node_uid):  # none, or an earlier Node of this name
        others = [
            r
            for r in existing.get("metadata", {}).get("ownerReferences") or ()
            if not (isinstance(r, Mapping) and r.get("kind") == "Node")
        ]
        body["metadata"]["ownerReferences"] = [*others, *wanted]
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
