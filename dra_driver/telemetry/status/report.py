"""What ``gpu-dra status`` shows, and how: the rows (a device as the slices, the claims and its
agent describe it), the report, and its table, JSON and YAML forms. Pure.

Place in the flow: both sources build a :class:`Report` (``agent.py`` node-local, ``cluster.py``
cluster-wide); ``command.py`` prints what :func:`formatted` makes of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COLUMNS = ("NODE", "DEVICE", "TYPE", "HEALTH", "CLAIM", "POD", "UTIL", "MEMORY", "TEMP", "POWER")


@dataclass(frozen=True)
class Holder:
    """A claim holding a device, and the pods it is reserved for."""

    namespace: str
    name: str
    pods: tuple[str, ...] = ()
    # the driver's status.devices entry of this device in the claim (KEP-4817): its conditions
    # and data (GPU/MIG UUID, index, product, profile); None when the claim has none
    device_status: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class DeviceStatus:
    """One row: a device as the slices, the claims and its agent describe it (each optional)."""

    node: str
    device: str
    type: str = ""  # gpu or mig
    profile: str = ""
    product: str = ""
    mig_enabled: bool = False
    published: bool | None = None  # in a ResourceSlice; None: not known (node-local)
    health: str = ""  # the agent's health state; empty: not reported
    taints: tuple[str, ...] = ()  # key=value:Effect, from the slice
    claims: tuple[Holder, ...] = ()
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    power_usage_watts: float | None = None
    power_limit_watts: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node": self.node, "device": self.device, "type": self.type}
        if self.profile:
            out["profile"] = self.profile
        if self.product:
            out["product"] = self.product
        if self.type == "gpu":
            out["migEnabled"] = self.mig_enabled
        if self.published is not None:
            out["published"] = self.published
        out["health"] = self.health or None
        out["taints"] = list(self.taints)
        out["claims"] = [
            {"namespace": h.namespace, "name": h.name, "pods": list(h.pods)}
            | ({"deviceStatus": dict(h.device_status)} if h.device_status is not None else {})
            for h in self.claims
        ]
        for key, value in (
            ("utilization", self.utilization_ratio),
            ("memoryUsedBytes", self.memory_used_bytes),
            ("memoryTotalBytes", self.memory_total_bytes),
            ("temperatureCelsius", self.temperature_celsius),
            ("powerWatts", self.power_usage_watts),
            ("powerLimitWatts", self.power_limit_watts),
        ):
            out[key] = None if value is None else _number(value)
        return out


@dataclass(frozen=True)
class Report:
    devices: tuple[DeviceStatus, ...]
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": [d.to_json() for d in self.devices],
            "notes": list(self.notes),
        }


# -- output ----------------------------------------------------------------------------------------


def table(report: Report) -> str:
    """The report as an aligned table, notes below it."""
    from dra_driver.devices.table import render  # noqa: PLC0415

    rows = [
        (
            d.node,
            d.device,
            _type(d),
            _health(d),
            ",".join(f"{h.namespace}/{h.name}" if h.namespace else h.name for h in d.claims) or "-",
            ",".join(p for h in d.claims for p in h.pods) or "-",
            "-" if d.utilization_ratio is None else f"{100 * d.utilization_ratio:.0f}%",
            _memory(d),
            "-" if d.temperature_celsius is None else f"{d.temperature_celsius:.0f} C",
            _power(d),
        )
        for d in report.devices
    ]
    text = render(rows, COLUMNS) if rows else "no devices"
    return "\n".join([text, *(f"note: {n}" for n in report.notes)])


def _type(d: DeviceStatus) -> str:
    if d.type == "mig":
        return f"mig {d.profile}".rstrip()
    if d.mig_enabled:
        return "gpu (MIG mode)"
    return d.type or "-"


def _health(d: DeviceStatus) -> str:
    parts = [d.health] if d.health else []
    parts += [f"taint {t}" for t in d.taints]
    return "; ".join(parts) or "-"


def _memory(d: DeviceStatus) -> str:
    gib = 1024**3
    if d.memory_total_bytes is None:
        return "-"
    total = d.memory_total_bytes / gib
    if d.memory_used_bytes is None:
        return f"-/{total:.1f} GiB"
    return f"{d.memory_used_bytes / gib:.1f}/{total:.1f} GiB"


def _power(d: DeviceStatus) -> str:
    if d.power_usage_watts is None:
        return "-"
    if d.power_limit_watts is None:
        return f"{d.power_usage_watts:.0f} W"
    return f"{d.power_usage_watts:.0f}/{d.power_limit_watts:.0f} W"


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def formatted(report: Report, output: str) -> str:
    if output == "json":
        return json.dumps(report.to_json(), indent=2)
    if output == "yaml":
        import yaml  # noqa: PLC0415

        return str(yaml.safe_dump(report.to_json(), sort_keys=False)).rstrip("\n")
    return table(report)


__all__ = ["COLUMNS", "DeviceStatus", "Holder", "Report", "formatted", "table"]
