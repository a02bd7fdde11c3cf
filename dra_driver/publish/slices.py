"""This node's pool as ResourceSlice bodies. Pure.

Place in the flow: ``devices.NodeDevices`` -> :func:`build_slices` -> :class:`DesiredPool`,
which syncplan.py compares with the slices the server has and publisher.py writes through kube/.
Nothing here does I/O; every object is resource.k8s.io/v1 JSON (kube/conversion.py translates for
servers that only serve v1beta2 or v1beta1).

How the pool is split into slices (spec D.1, nvidia-compat.md "API limits"; the limits are
resourceapi.py's):

* Since 1.35 a ResourceSlice carries either ``devices`` or ``sharedCounters``, never both, and
  counter-set names are unique in the whole pool. So the counter sets go into slices of their own,
  at most 8 per slice, and come first (indices ``0..k-1``); the devices follow in their given order
  (devices/ emits them GPU by GPU), packed greedily: at most 128 per slice, at most 64 once any
  device in that slice consumes counters or carries taints. The same NodeDevices always gives the
  same slices at the same indices, which is what lets a restart write nothing.
* A pool with neither devices nor counter sets is still published as one empty slice: it tells the
  scheduler the driver runs but has nothing to offer (spec G.1).
* On a 1.34 server with DRAPartitionableDevices (alpha) the old model wanted counter sets beside
  the devices in the same slice; that combination is not supported (the gate is off by default
  there, and the API server then drops the counter fields, which the publisher reports).

Identity follows the 1.36 helper (spec G.3/G.4): slice ``i`` is created with
``generateName = "<i as 5+ hex digits>-<driver>-<node>-"``, and :func:`slice_index` matches an
existing slice to its index by that prefix.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dra_driver.devices.model import CounterSet, Device, NodeDevices, RequestPolicy, Version
from dra_driver.errors import PublishError
from dra_driver.resourceapi import (
    GROUP,
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
    RESOURCE_SLICE,
    JsonDict,
)

_INDEX_MIN_DIGITS = 5
# names.SimpleNameGenerator keeps at most 63 - 5 characters of a generateName before it appends
# its five random characters; matching must look at that same truncated prefix.
_GENERATED_PREFIX_MAX = 58
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_MAX_PROBLEMS_SHOWN = 10
# distinct attribute values and capacities shared between devices (device_json)
_SHARED_VALUES = 4096


@dataclass(frozen=True)
class SliceContent:
    """What one ResourceSlice carries besides its identity: v1 JSON devices or counter sets."""

    devices: tuple[JsonDict, ...] = ()
    shared_counters: tuple[JsonDict, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DesiredPool:
    """The slices this node should have, in index order. The pool is named after the node.

    ``generation`` is the driver's minimum pool generation (G.3 step 6): a value above the one
    found on the server is used as is; otherwise syncplan.py's ``plan_sync`` decides.
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
    """One device in resource.k8s.io/v1 JSON, with empty fields left out as the server does.

    Equal attribute values and capacities without a policy are one shared object (read-only,
    like everything built here): most are the same on every GPU of a node (product, driver
    version, memory), and separate copies were about 0.5 MiB of a 64-GPU node's agent."""
    out: JsonDict = {"name": device.name}
    if device.attributes:
        out["attributes"] = {k: _attribute_json(v) for k, v in device.attributes.items()}
    if device.capacity:
        policies = device.request_policies
        out["capacity"] = {
            k: {"value": v, "requestPolicy": _request_policy_json(policies[k])}
            if k in policies
            else _capacity_json(v)
            for k, v in device.capacity.items()
        }
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


@functools.lru_cache(maxsize=_SHARED_VALUES, typed=True)  # typed: True is not 1
def _capacity_json(value: str) -> JsonDict:
    return {"value": value}


@functools.lru_cache(maxsize=_SHARED_VALUES, typed=True)
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
        "kind": RESOURCE_SLICE,
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


def content_of(obj: Mapping[str, Any]) -> SliceContent:
    """The devices and counter sets of a v1 ResourceSlice object."""
    spec = obj.get("spec") or {}
    return SliceContent(
        devices=tuple(spec.get("devices") or ()),
        shared_counters=tuple(spec.get("sharedCounters") or ()),
    )
