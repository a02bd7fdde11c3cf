"""The device model's values: a DRA device, the node's pool of them, taints and counters. Pure.

What every other module of devices/ produces and publish/slices.py turns into ResourceSlice JSON:
resource.k8s.io/v1 terms, as Python values (validation.py checks them against the API's rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from dra_driver.devices.names import COUNTER_SET_SUFFIX


@dataclass(frozen=True)
class Version:
    """A ``version`` attribute value: a semver 2.0.0 string without a leading v."""

    value: str


AttributeValue = bool | int | str | Version
"""One DRA attribute value; the Python type picks the API member (bool/int/string/version)."""

TaintEffect = Literal["None", "NoSchedule", "NoExecute"]


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: TaintEffect


@dataclass(frozen=True)
class CounterConsumption:
    """Counters one device takes from a shared counter set while allocated (KEP-4815)."""

    counter_set: str
    counters: Mapping[str, str]  # counter name -> canonical quantity string


@dataclass(frozen=True)
class CounterSet:
    """A shared counter set: what all devices consuming from it may use together."""

    name: str
    counters: Mapping[str, str]  # counter name -> canonical quantity string


@dataclass(frozen=True, kw_only=True)
class RequestPolicy:
    """How shares of one capacity are requested from a device that allows multiple allocations
    (KEP-5075 ``requestPolicy``): the amount a request that names none consumes, and either the
    valid values or a valid range (``min``, optional ``max`` and ``step``). Canonical quantity
    strings, like capacities."""

    default: str | None = None
    valid_values: tuple[str, ...] = ()
    range_min: str | None = None
    range_max: str | None = None
    range_step: str | None = None


@dataclass(frozen=True)
class Device:
    """One device of the pool, in resource.k8s.io/v1 terms.

    Attribute and capacity names are unqualified (the driver's own domain) or carry a domain
    (``resource.kubernetes.io/pciBusID``). Capacity values are canonical quantity strings, so a
    published slice compares equal to what the API server stores.
    """

    name: str
    attributes: Mapping[str, AttributeValue]
    capacity: Mapping[str, str]
    consumes_counters: tuple[CounterConsumption, ...] = ()
    taints: tuple[Taint, ...] = ()
    # KEP-5075 (consumable capacity, shares.py): several claims may hold the device at once,
    # each consuming part of its capacities; request_policies is keyed by capacity name.
    allow_multiple_allocations: bool = False
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=dict)


@dataclass(frozen=True)
class NodeDevices:
    """Everything this node offers: the devices of its pool and their shared counter sets."""

    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = field(default=())


def with_taints(node_devices: NodeDevices, taints: Mapping[str, tuple[Taint, ...]]) -> NodeDevices:
    """``node_devices`` with ``taints[name]`` added to each named device; names the pool does not
    have are ignored. Returns ``node_devices`` itself when nothing is added.

    A device of a partitionable GPU (dynamic MIG: it consumes from ``gpu-<minor>-counter-set``)
    that has no taints of its own in ``taints`` gets those of its GPU, ``taints["gpu-<minor>"]``:
    a lost GPU taints every placement, created or not.
    """

    def wanted(device: Device) -> tuple[Taint, ...]:
        own = taints.get(device.name)
        if own:
            return own
        for consumption in device.consumes_counters:
            gpu, suffix, rest = consumption.counter_set.rpartition(COUNTER_SET_SUFFIX)
            if suffix and not rest and taints.get(gpu):
                return taints[gpu]
        return ()

    devices = tuple(
        replace(d, taints=d.taints + extra) if (extra := wanted(d)) else d
        for d in node_devices.devices
    )
    if devices == node_devices.devices:
        return node_devices
    return NodeDevices(devices=devices, counter_sets=node_devices.counter_sets)
