"""A GPU's recorded answers against its simulated twin's, field by field. Pure.

Place in the flow: after the check has asked a GPU (check.py) and the same questions of the
simulated profile of the same product (``sim/profiles.py``, installed below pynvml as the agent's
``--simulate`` does). Both answers are nested JSON; :func:`differences` flattens them to dotted
paths and lists every path whose value differs. What belongs to the node rather than the product
(UUIDs, PCI addresses, which NUMA node, error counts, readings, timings, the MIG devices that
happen to exist) is compared by presence only (:data:`NODE_STATE`), so a difference always names
something the simulation says about the product that the hardware does not.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NODE_STATE = (
    "*.ms",
    "discovery.index",
    "discovery.minor",
    "discovery.uuid",
    "discovery.pci_bus_id",
    "discovery.pcie_root",
    "discovery.numa_node",
    "discovery.mig_instances*",
    "devices.*.attributes.uuid.*",
    "devices.*.attributes.parentUUID.*",
    "devices.*.attributes.resource.kubernetes.io/pciBusID.*",
    "devices.*.attributes.resource.kubernetes.io/pcieRoot.*",
    "devices.*.attributes.resource.kubernetes.io/numaNode.*",
    "mig.max_mig_devices.value",
    "mig.profiles.*.remaining_capacity.value",
    "health.ecc_errors.*.value",
    "health.remapped_rows.value*",
    "health.retired_pages.*.value*",
    "health.retired_pages_pending.value",
    "telemetry.*",
)
"""Paths (fnmatch patterns) whose values are the node's, not the product's: compared by
presence (a value, or which error NVML gave), never by value."""

PRESENT = "<present>"
_GPU_NAME = re.compile(r"\bgpu-\d+")


@dataclass(frozen=True)
class Difference:
    """One path where the hardware and the simulation disagree (None: the side lacks it)."""

    path: str
    real: Any
    simulated: Any

    def as_json(self) -> dict[str, Any]:
        return {"path": self.path, "real": self.real, "simulated": self.simulated}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts, lists and tuples as ``{"a.b.0.c": leaf}``; empty containers are leaves."""
    if isinstance(value, Mapping) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list | tuple) and value:
        out = {}
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{index}" if prefix else str(index)))
        return out
    return {prefix: list(value) if isinstance(value, tuple) else value}


def comparable(facts: Mapping[str, Any]) -> dict[str, Any]:
    """``facts`` flattened, node-state values replaced by :data:`PRESENT` (or dropped when
    they are timings) and device names made independent of the GPU's minor."""
    out: dict[str, Any] = {}
    for raw_path, raw_value in flatten(facts).items():
        path = _GPU_NAME.sub("gpu-N", raw_path)
        value = _GPU_NAME.sub("gpu-N", raw_value) if isinstance(raw_value, str) else raw_value
        if any(fnmatch.fnmatchcase(path, pattern) for pattern in NODE_STATE):
            if path.endswith(".ms"):
                continue
            value = PRESENT if value is not None else None
            if path.startswith("discovery.mig_instances"):
                path = "discovery.mig_instances"  # the devices that exist: there or not
        out[path] = value
    return out


NEWER_READINGS = "telemetry.reading."
"""Telemetry gains readings over time, and a report holds every reading its check knew (None
where NVML refused one): a reading one side lacks altogether is one the check that recorded it
did not have (``memory_reserved_bytes`` after the first H200 report), not a difference."""


def differences(real: Mapping[str, Any], simulated: Mapping[str, Any]) -> list[Difference]:
    """Every path whose value differs between the two answers, sorted by path."""
    left, right = comparable(real), comparable(simulated)
    return [
        Difference(path=path, real=left.get(path), simulated=right.get(path))
        for path in sorted(left.keys() | right.keys())
        if left.get(path) != right.get(path)
        and ((path in left and path in right) or not path.startswith(NEWER_READINGS))
    ]


__all__ = [
    "NEWER_READINGS",
    "NODE_STATE",
    "PRESENT",
    "Difference",
    "comparable",
    "differences",
    "flatten",
]
