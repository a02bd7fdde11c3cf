"""The one table format every benchmark prints, and the short mode every benchmark has.

Short mode (``BENCH_SHORT=1``, ``python -m bench --short``, what CI runs through
tests/test_bench_short.py): each bench runs its whole path with few iterations, so that a bench
that cannot run any more fails CI; its table is printed, but no target is judged (a few samples
on a shared CI machine say nothing about a target), and the exit status says only whether it ran.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

SHORT_ENV = "BENCH_SHORT"


def short_mode() -> bool:
    """True when the benches run in their short mode (``BENCH_SHORT=1``)."""
    return os.environ.get(SHORT_ENV, "") == "1"


def scaled(full: int, short: int) -> int:
    """``full`` iterations, or ``short`` in short mode."""
    return short if short_mode() else full


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
    """Print ``rows`` as an aligned table; return True when every row with a target passed and
    every value was measured (a value that is not finite, inf for a run that failed, is a
    failure in every mode). The column "floor (same run)" is there when a row names one. In
    short mode no target is judged: the verdict column says so."""
    short = short_mode()
    with_floor = any(r.floor for r in rows)
    header = ("measurement", "value", *(("floor (same run)",) if with_floor else ()), "target",
              "verdict")  # fmt: skip
    cells = [
        (
            r.name,
            f"{r.value:,.3f} {r.unit}".rstrip(),
            *((r.floor,) if with_floor else ()),
            r.target,
            _verdict(r, short=short),
        )
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    print(f"{title} [short mode: few iterations, targets not judged]" if short else title)
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)))
    measured = all(math.isfinite(r.value) for r in rows)
    return measured and (short or all(r.ok is not False for r in rows))


def _verdict(row: Row, *, short: bool) -> str:
    if not math.isfinite(row.value):
        return "NOT MEASURED"
    if row.ok is None:
        return ""
    if short:
        return "not judged"
    return "ok" if row.ok else "MISSED"
