"""Runtime semantics shared by every library: errors, ordering as cel-go has it, checked
integer arithmetic, member access, map keys. Equality (``values._eq``) is one layer below, with
the values whose equality it defines.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

from dra_driver.errors import CelRuntimeError
from dra_driver.scheduling.cel.values import (
    _INT_MAX,
    _INT_MIN,
    _UINT_MAX,
    NONE,
    DomainIndex,
    DomainMap,
    OptionalValue,
    UInt,
    _eq,
    _mixed_cmp,
    _show,
    _tname,
)


def _err(message: str) -> CelRuntimeError:
    return CelRuntimeError(message)


def _no_overload(fn: str, *args: Any) -> CelRuntimeError:
    return CelRuntimeError(f"no such overload: {fn}({', '.join(_tname(a) for a in args)})")


_NUMERIC = (int, UInt, float)


def _is_num(v: Any) -> bool:
    return type(v) in (int, UInt, float)


def _cmp(op: str, a: Any, b: Any) -> int:
    ta, tb = type(a), type(b)
    if (ta is tb and ta in (str, int, float, UInt, bytes, bool)) or (
        ta in (int, UInt, float) and tb in (int, UInt, float)
    ):
        if (ta is float and math.isnan(a)) or (tb is float and math.isnan(b)):
            return 2  # NaN: every ordering is false
        if ta is not tb and (ta is float or tb is float):
            return _mixed_cmp(a, b)
        return -1 if a < b else (1 if a > b else 0)
    raise _no_overload(op, a, b)


def _check_int(n: int) -> int:
    if n < _INT_MIN or n > _INT_MAX:
        raise _err("integer overflow")
    return n


def _check_uint(n: int) -> UInt:
    if n < 0 or n > _UINT_MAX:
        raise _err("unsigned integer overflow")
    return UInt(n)


def _arith(op: str, a: Any, b: Any) -> Any:
    ta, tb = type(a), type(b)
    if ta is not tb:
        raise _no_overload(op, a, b)
    if ta is int:
        if op == "_+_":
            return _check_int(a + b)
        if op == "_-_":
            return _check_int(a - b)
        if op == "_*_":
            return _check_int(a * b)
        if b == 0:
            raise _err("division by zero" if op == "_/_" else "modulus by zero")
        q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # truncates toward zero
        return _check_int(q) if op == "_/_" else a - b * q
    if ta is UInt:
        if op == "_+_":
            return _check_uint(a + b)
        if op == "_-_":
            return _check_uint(a - b)
        if op == "_*_":
            return _check_uint(a * b)
        if b == 0:
            raise _err("division by zero" if op == "_/_" else "modulus by zero")
        return UInt(a // b) if op == "_/_" else UInt(a % b)
    if ta is float and op != "_%_":
        if op == "_+_":
            return a + b
        if op == "_-_":
            return a - b
        if op == "_*_":
            return a * b
        if b == 0:
            return math.copysign(math.inf, a) * math.copysign(1, b) if a else math.nan
        return a / b
    if op == "_+_" and ta in (str, bytes, list):
        return a + b
    raise _no_overload(op, a, b)


def _select(o: Any, field: str) -> Any:
    if isinstance(o, dict):
        try:
            return o[field]
        except KeyError:
            raise _missing(o, field) from None
    if type(o) is OptionalValue:  # selection on an optional keeps going optionally
        return _opt_select(o.value, field) if o.present else NONE
    raise _err(f"type '{_tname(o)}' does not support field selection")


def _missing(o: Any, key: Any) -> CelRuntimeError:
    if isinstance(o, DomainMap):
        return _err(
            f"{o.kind} {o.domain}/{key} missing (no such key: {key}; guard with "
            f"has(...) or use .?{key}.orValue(...))"
        )
    return _err(f"no such key: {_show(key)}")


def _opt_select(o: Any, field: str) -> OptionalValue:
    if type(o) is OptionalValue:
        return _opt_select(o.value, field) if o.present else NONE
    if isinstance(o, dict):
        if field in o:
            return OptionalValue(o[field], present=True)
        return NONE
    raise _err(f"type '{_tname(o)}' does not support field selection")


def _index(o: Any, key: Any) -> Any:
    if isinstance(o, list):
        if type(key) not in (int, UInt) and not (type(key) is float and key.is_integer()):
            raise _no_overload("_[_]", o, key)
        i = int(key)
        if i < 0 or i >= len(o):
            raise _err(f"index out of bounds: {i}")
        return o[i]
    if isinstance(o, dict):
        if type(key) not in (str, int, UInt, bool) and type(key) is not float:
            raise _no_overload("_[_]", o, key)
        k = _map_key(o, key)
        if k is _ABSENT:
            raise _missing(o, key)
        return o[k]
    if type(o) is OptionalValue:
        return _opt_index(o.value, key) if o.present else NONE
    raise _no_overload("_[_]", o, key)


_ABSENT: Final = object()


def _map_key(o: Mapping[Any, Any], key: Any) -> Any:
    """The key of ``o`` equal to ``key`` under CEL equality (numeric keys compare by value)."""
    if isinstance(o, DomainIndex):
        return key if type(key) is str else _ABSENT
    if key in o:
        for k in o:
            if _eq(k, key):
                return k
    if _is_num(key) and type(key) is not bool:
        for k in o:
            if _is_num(k) and type(k) is not bool and k == key:
                return k
    return _ABSENT


def _opt_index(o: Any, key: Any) -> OptionalValue:
    if type(o) is OptionalValue:
        return _opt_index(o.value, key) if o.present else NONE
    if isinstance(o, list):
        i = int(key) if type(key) in (int, UInt) else -1
        return OptionalValue(o[i], present=True) if 0 <= i < len(o) else NONE
    if isinstance(o, DomainIndex):
        return OptionalValue(o[key], present=True) if key in o else NONE
    if isinstance(o, dict):
        k = _map_key(o, key)
        return NONE if k is _ABSENT else OptionalValue(o[k], present=True)
    raise _no_overload("_[?_]", o, key)


def _in(a: Any, container: Any) -> bool:
    if isinstance(container, list):
        return any(_eq(a, x) for x in container)
    if isinstance(container, dict):
        return _map_key(container, a) is not _ABSENT
    raise _no_overload("@in", a, container)


def _truth(v: Any, fn: str) -> bool:
    if v is True or v is False:
        return bool(v)
    raise _no_overload(fn, v)
