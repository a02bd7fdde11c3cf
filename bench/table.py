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


def print_table(title: str, rows: list[Row]) -> bool:
    """Print ``rows`` as an aligned table; return True when every row with a target passed."""
    header = ("measurement", "value", "target", "verdict")
    cells = [
        (
            r.name,
            f"{r.value:,.3f} {r.unit}".rstrip(),
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
