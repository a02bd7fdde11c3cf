"""Standard conversions and size: ``int()``, ``uint()``, ``double()``, ``string()``, ``bool()``,
``bytes()``, ``type()``, ``size()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.runtime import _check_int, _check_uint, _err, _no_overload
from dra_driver.scheduling.cel.values import (
    _INT_MIN,
    CelQuantity,
    CelType,
    Semver,
    UInt,
    _show,
    _tname,
)


def _size(v: Any) -> int:
    if isinstance(v, str | list | dict):
        return len(v)
    if isinstance(v, bytes):
        return len(v)
    raise _no_overload("size", v)


def _str2(fn: str, impl: Callable[[str, str], Any]) -> Callable[[Any, Any], Any]:
    def f(s: Any, t: Any) -> Any:
        if type(s) is str and type(t) is str:
            return impl(s, t)
        raise _no_overload(fn, s, t)

    return f


def _to_int(v: Any) -> int:
    t = type(v)
    if t is int:
        return v  # type: ignore[no-any-return]
    if t is UInt:
        return _check_int(int(v))
    if t is float:
        # cel-go: -2^63 itself is out of range too (its check is v <= float64(MinInt64))
        if math.isnan(v) or math.isinf(v) or not (_INT_MIN < v < 2.0**63):
            raise _err("double out of int range")
        return int(v)
    if t is str:
        try:
            return _check_int(int(v, 10))
        except ValueError:
            raise _err(f"cannot convert {_show(v)} to int") from None
    raise _no_overload("int", v)


def _to_uint(v: Any) -> UInt:
    t = type(v)
    if t in (int, UInt):
        return _check_uint(int(v))
    if t is float:
        if math.isnan(v) or not (0 <= v < 2.0**64):
            raise _err("double out of uint range")
        return UInt(int(v))
    if t is str:
        try:
            return _check_uint(int(v.removesuffix("u"), 10))
        except ValueError:
            raise _err(f"cannot convert {_show(v)} to uint") from None
    raise _no_overload("uint", v)


def _to_double(v: Any) -> float:
    t = type(v)
    if t is float:
        return v  # type: ignore[no-any-return]
    if t in (int, UInt):
        return float(v)
    if t is str:
        try:
            return float(v)
        except ValueError:
            raise _err(f"cannot convert {_show(v)} to double") from None
    raise _no_overload("double", v)


def _to_string(v: Any) -> str:
    t = type(v)
    if t is str:
        return v  # type: ignore[no-any-return]
    if t is bool:
        return "true" if v else "false"
    if t in (int, UInt):
        return str(int(v))
    if t is float:
        return repr(v) if not v.is_integer() else f"{v:.0f}" if abs(v) < 1e21 else repr(v)
    if t is bytes:
        try:
            return v.decode("utf-8")  # type: ignore[no-any-return]
        except UnicodeDecodeError:
            raise _err("invalid UTF-8 in bytes") from None
    if t is CelQuantity or t is Semver:
        return str(v)
    raise _no_overload("string", v)


def _to_bool(v: Any) -> bool:
    if type(v) is bool:
        return v
    if type(v) is str:
        if v in ("true", "True", "TRUE", "t", "1"):
            return True
        if v in ("false", "False", "FALSE", "f", "0"):
            return False
        raise _err(f"cannot convert {_show(v)} to bool")
    raise _no_overload("bool", v)


def _to_bytes(v: Any) -> bytes:
    if type(v) is bytes:
        return v
    if type(v) is str:
        return v.encode("utf-8")
    raise _no_overload("bytes", v)


def _type_of(v: Any) -> CelType:
    return CelType(_tname(v))
