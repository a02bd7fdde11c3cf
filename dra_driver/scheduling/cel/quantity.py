"""The Kubernetes quantity library, and ``compareTo``/``isGreaterThan``/``isLessThan`` shared with
semver.
"""

from __future__ import annotations

from typing import Any

from dra_driver.quantity import QuantityError, parse_quantity
from dra_driver.scheduling.cel.runtime import _err, _no_overload
from dra_driver.scheduling.cel.values import _INT_MAX, _INT_MIN, CelQuantity, Semver


def _quantity(s: Any) -> CelQuantity:
    if type(s) is not str:
        raise _no_overload("quantity", s)
    try:
        return CelQuantity.parse(s)
    except QuantityError as exc:
        raise _err(f"quantity: {exc}") from None


def _is_quantity(s: Any) -> bool:
    if type(s) is not str:
        raise _no_overload("isQuantity", s)
    try:
        parse_quantity(s)
    except QuantityError:
        return False
    return True


def _q(fn: str, q: Any) -> CelQuantity:
    if type(q) is not CelQuantity:
        raise _no_overload(fn, q)
    return q


def _q_add(q: Any, other: Any) -> CelQuantity:
    q = _q("add", q)
    if type(other) is CelQuantity:
        return CelQuantity(q.value + other.value, q.format)
    if type(other) is int:
        return CelQuantity(q.value + other, q.format)
    raise _no_overload("add", q, other)


def _q_sub(q: Any, other: Any) -> CelQuantity:
    q = _q("sub", q)
    if type(other) is CelQuantity:
        return CelQuantity(q.value - other.value, q.format)
    if type(other) is int:
        return CelQuantity(q.value - other, q.format)
    raise _no_overload("sub", q, other)


def _q_is_integer(q: Any) -> bool:
    v = _q("isInteger", q).value
    return v.denominator == 1 and _INT_MIN <= v <= _INT_MAX


def _q_as_integer(q: Any) -> int:
    v = _q("asInteger", q).value
    if v.denominator != 1 or not _INT_MIN <= v <= _INT_MAX:
        raise _err(f"cannot convert quantity {q} to an int64 exactly")
    return int(v)


def _q_float(q: Any) -> float:
    return float(_q("asApproximateFloat", q).value)


def _q_sign(q: Any) -> int:
    v = _q("sign", q).value
    return (v > 0) - (v < 0)


def _compare_to(a: Any, b: Any) -> int:
    if type(a) is CelQuantity and type(b) is CelQuantity:
        # Cross-multiplied integers (denominators are positive): Fraction's own comparison goes
        # through the numbers ABCs and cost a third of a selector's evaluation.
        left, right = a.numerator * b.denominator, b.numerator * a.denominator
        return (left > right) - (left < right)
    if type(a) is Semver and type(b) is Semver:
        return a.compare(b)
    raise _no_overload("compareTo", a, b)


def _is_greater(a: Any, b: Any) -> bool:
    if type(a) is type(b) and type(a) in (CelQuantity, Semver):
        return _compare_to(a, b) > 0
    raise _no_overload("isGreaterThan", a, b)


def _is_less(a: Any, b: Any) -> bool:
    if type(a) is type(b) and type(a) in (CelQuantity, Semver):
        return _compare_to(a, b) < 0
    raise _no_overload("isLessThan", a, b)
