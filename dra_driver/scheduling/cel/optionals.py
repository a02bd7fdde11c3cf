"""Optional values: ``optional.of/none/ofNonZeroValue``, ``value``, ``orValue``, ``or``,
``hasValue``.
"""

from __future__ import annotations

from typing import Any

from dra_driver.scheduling.cel.runtime import _err, _no_overload
from dra_driver.scheduling.cel.values import OptionalValue, UInt


def _opt(fn: str, o: Any) -> OptionalValue:
    if type(o) is not OptionalValue:
        raise _no_overload(fn, o)
    return o


def _opt_value(o: Any) -> Any:
    o = _opt("value", o)
    if not o.present:
        raise _err("optional.none() dereference")
    return o.value


def _opt_or_value(o: Any, d: Any) -> Any:
    o = _opt("orValue", o)
    return o.value if o.present else d


def _opt_or(o: Any, other: Any) -> OptionalValue:
    o = _opt("or", o)
    return o if o.present else _opt("or", other)


def _zero(v: Any) -> bool:
    if type(v) is bool:
        return v is False
    if type(v) in (int, UInt, float):
        return bool(v == 0)
    if isinstance(v, str | bytes | list | dict):
        return len(v) == 0
    return v is None
