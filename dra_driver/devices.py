"""GPU and MIG facts -> DRA devices: names, attributes, capacities, counters. Pure.

Input: ``gpus.info.GpuInfo`` values from discovery (NVML or simulated). Output: ``NodeDevices``,
the devices and shared counter sets of this node's pool, already within the API's validation
rules (nvidia-compat.md "Attributes", spec D.1). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


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


@dataclass(frozen=True)
class NodeDevices:
    """Everything this node offers: the devices of its pool and their shared counter sets."""

    devices: tuple[Device, ...] = ()
    counter_sets: tuple[CounterSet, ...] = field(default=())
