"""A claim's ``matchAttribute`` and ``distinctAttribute`` constraints during the search. Pure.

A ``ConstraintTracker`` keeps the attribute values of the devices placed so far for the
requests a constraint names, and refuses a device that would break it; ``remove`` undoes the
last ``add`` when the search backtracks. List attributes match when they overlap (a match
narrows to the intersection), as with DRAListTypeAttributes.
"""

from __future__ import annotations

from typing import Any, Final

from dra_driver.scheduling.allocator.candidates import Candidate, RequestData
from dra_driver.scheduling.allocator.model import Constraint


class ConstraintTracker:
    """One constraint of one claim, and the values the devices placed for it so far have."""

    def __init__(self, c: Constraint) -> None:
        self.c = c
        self.attribute = c.match_attribute or c.distinct_attribute or ""
        self.values: list[Any] = []

    def applies(self, data: RequestData) -> bool:
        if not self.c.requests:
            return True
        return (
            data.parent or data.request.name
        ) in self.c.requests or data.full_name in self.c.requests

    def add(self, data: RequestData, cand: Candidate) -> bool:
        if not self.applies(data):
            return True
        value = lookup_attribute(cand, self.attribute)
        if value is MISSING:
            return False
        if self.c.match_attribute is not None:
            if self.values and not _attr_overlap(self.values[-1], value):
                return False
            narrowed = value if not self.values else _attr_intersection(self.values[-1], value)
            self.values.append(narrowed)
        else:
            if any(_attr_overlap(v, value) for v in self.values):
                return False
            self.values.append(value)
        return True

    def remove(self, data: RequestData) -> None:
        if self.applies(data):
            self.values.pop()


MISSING: Final = object()


def lookup_attribute(cand: Candidate, qualified: str) -> Any:
    """A fully-qualified attribute of a device; also finds it unqualified in the driver's domain."""
    attrs = cand.device.attributes
    if qualified in attrs:
        return attrs[qualified]
    domain, _, ident = qualified.partition("/")
    if domain == cand.pool.driver and ident in attrs:
        return attrs[ident]
    return MISSING


def _key(x: Any) -> str:
    return f"{type(x).__name__}:{x}"  # typed: the int 1 and the string "1" differ


def _as_set(v: Any) -> set[str]:
    return {_key(x) for x in (v if isinstance(v, list) else [v])}


def _attr_overlap(a: Any, b: Any) -> bool:
    return bool(_as_set(a) & _as_set(b))


def _attr_intersection(a: Any, b: Any) -> list[Any]:
    """The values of ``a`` that ``b`` has too (a scalar counts as a list of one)."""
    keep = _as_set(b)
    return [x for x in (a if isinstance(a, list) else [a]) if _key(x) in keep]
