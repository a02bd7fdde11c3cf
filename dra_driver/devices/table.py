"""ResourceSlices -> a readable table of devices (device, type, product, memory, profile, slice).

Pure rendering over ResourceSlice JSON as the API server stores it (v1 flat devices or v1beta1
``basic`` devices), so the demo shows exactly what was published, not what we meant to publish.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from dra_driver.quantity import QuantityError, parse_quantity

COLUMNS = ("DEVICE", "TYPE", "PRODUCT", "MEMORY", "PROFILE", "SLICE")


def _attr(attributes: Mapping[str, Any], name: str, driver: str) -> str:
    value = attributes.get(name, attributes.get(f"{driver}/{name}"))
    if not isinstance(value, Mapping):
        return "-"
    for member in ("string", "version", "int", "bool"):
        if member in value:
            return str(value[member])
    return "-"


def _memory(capacity: Mapping[str, Any], driver: str) -> str:
    entry = capacity.get("memory", capacity.get(f"{driver}/memory"))
    if not isinstance(entry, Mapping) or "value" not in entry:
        return "-"
    try:
        gib = parse_quantity(str(entry["value"])).value / 1024**3
    except QuantityError:
        return str(entry["value"])
    return f"{float(gib):.1f} GiB"


def device_rows(slices: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """One row per device of ``slices``, ordered by slice name then device order."""
    rows: list[tuple[str, ...]] = []
    for obj in sorted(slices, key=lambda s: str(s.get("metadata", {}).get("name", ""))):
        spec = obj.get("spec", {})
        driver = str(spec.get("driver", ""))
        slice_name = str(obj.get("metadata", {}).get("name", "-"))
        for device in spec.get("devices") or ():
            body = device.get("basic", device)  # v1beta1 wraps the fields in "basic"
            attributes = body.get("attributes") or {}
            rows.append(
                (
                    str(device.get("name", "-")),
                    _attr(attributes, "type", driver),
                    _attr(attributes, "productName", driver),
                    _memory(body.get("capacity") or {}, driver),
                    _attr(attributes, "profile", driver),
                    slice_name,
                )
            )
    return rows


def render(rows: Sequence[Sequence[str]], columns: Sequence[str] = COLUMNS) -> str:
    """Left-aligned columns separated by two spaces, header first."""
    widths = [
        max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)
