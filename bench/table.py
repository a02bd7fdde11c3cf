"""The one table format every benchmark prints."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    unit: str
    target: str  # e.g. "<= 1.0 s"; empty when there is none
    ok: bool | None = None  # None when the row has no target
    # the figure the target is derived from, measured in the same run; e.g. "record p50 2.1 ms"
    floor: str = ""


def print_table(title: str, rows: list[Row]) -> bool:
    """Print ``rows`` as an aligned table; return True when every row with a target passed. The
    column "floor (same run)" is there when a row names one."""
    with_floor = any(r.floor for r in rows)
    header = ("measurement", "value", *(("floor (same run)",) if with_floor else ()), "target",
              "verdict")  # fmt: skip
    cells = [
        (
            r.name,
            f"{r.value:,.3f} {r.unit}".rstrip(),
            *((r.floor,) if with_floor else ()),
            r.target,
            "" if r.ok is None else ("ok" if r.ok else "MISSED"),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print(title)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))
    return all(r.ok is not False for r in rows)
