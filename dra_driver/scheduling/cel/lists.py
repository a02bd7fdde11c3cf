"""Kubernetes lists (v0) and ext.Lists (v3) functions, and DRA ``includes()``."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.quantity import _q_add
from dra_driver.scheduling.cel.runtime import _arith, _cmp, _err, _no_overload
from dra_driver.scheduling.cel.values import CelQuantity, Semver, _eq


def _list(fn: str, v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise _no_overload(fn, v)
    return v


def _sort_key_cmp(fn: str, items: list[Any]) -> list[Any]:
    return sorted(items, key=functools.cmp_to_key(lambda a, b: _ordering(fn, a, b)))


def _ordering(fn: str, a: Any, b: Any) -> int:
    if type(a) is CelQuantity and type(b) is CelQuantity:
        return (a.value > b.value) - (a.value < b.value)
    if type(a) is Semver and type(b) is Semver:
        return a.compare(b)
    r = _cmp(fn, a, b)
    return 0 if r == 2 else r


def _is_sorted(v: Any) -> bool:
    items = _list("isSorted", v)
    return all(_ordering("isSorted", a, b) <= 0 for a, b in itertools.pairwise(items))


def _sum(v: Any) -> Any:
    items = _list("sum", v)
    if not items:
        return 0
    total = items[0]
    for x in items[1:]:
        total = _arith("_+_", total, x) if type(total) is not CelQuantity else _q_add(total, x)
    return total


def _min_max(fn: str, sign: int) -> Callable[[Any], Any]:
    def f(v: Any) -> Any:
        items = _list(fn, v)
        if not items:
            raise _err(f"{fn} called on an empty list")
        best = items[0]
        for x in items[1:]:
            if _ordering(fn, x, best) * sign > 0:
                best = x
        return best

    return f


def _slice(v: Any, start: Any, end: Any) -> list[Any]:
    items = _list("slice", v)
    if type(start) is not int or type(end) is not int or not 0 <= start <= end <= len(items):
        raise _err(f"slice({start}, {end}) out of range for list of size {len(items)}")
    return items[start:end]


def _flatten(v: Any, depth: Any = 1) -> list[Any]:
    items = _list("flatten", v)
    if type(depth) is not int or depth < 0:
        raise _err("flatten: depth must be a non-negative int")
    out: list[Any] = []
    for x in items:
        if isinstance(x, list) and depth > 0:
            out.extend(_flatten(x, depth - 1))
        else:
            out.append(x)
    return out


def _distinct(v: Any) -> list[Any]:
    out: list[Any] = []
    for x in _list("distinct", v):
        if not any(_eq(x, y) for y in out):
            out.append(x)
    return out


def _reverse(v: Any) -> Any:
    return list(reversed(_list("reverse", v)))


def _sort(v: Any) -> list[Any]:
    return _sort_key_cmp("sort", _list("sort", v))


def _lists_range(n: Any) -> list[int]:
    if type(n) is not int:
        raise _no_overload("lists.range", n)
    return list(range(n))


def _includes(v: Any, x: Any) -> bool:
    if isinstance(v, list):
        return any(_eq(y, x) for y in v)
    return _eq(v, x)
