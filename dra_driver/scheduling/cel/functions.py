"""Every function and method by name: the implementations the compiler binds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.conversions import (
    _size,
    _str2,
    _to_bool,
    _to_bytes,
    _to_double,
    _to_int,
    _to_string,
    _to_uint,
    _type_of,
)
from dra_driver.scheduling.cel.lists import (
    _distinct,
    _flatten,
    _includes,
    _is_sorted,
    _lists_range,
    _min_max,
    _reverse,
    _slice,
    _sort,
    _sum,
)
from dra_driver.scheduling.cel.optionals import _opt, _opt_or, _opt_or_value, _opt_value, _zero
from dra_driver.scheduling.cel.quantity import (
    _compare_to,
    _is_greater,
    _is_less,
    _is_quantity,
    _q_add,
    _q_as_integer,
    _q_float,
    _q_is_integer,
    _q_sign,
    _q_sub,
    _quantity,
)
from dra_driver.scheduling.cel.regex import _find, _find_all, _matches
from dra_driver.scheduling.cel.runtime import _in
from dra_driver.scheduling.cel.semver import _is_semver, _semver, _semver_part
from dra_driver.scheduling.cel.sets import _sets
from dra_driver.scheduling.cel.strings import (
    _ascii_case,
    _char_at,
    _format,
    _index_of,
    _join,
    _last_index_of,
    _quote,
    _replace,
    _split,
    _substring,
    _trim,
)
from dra_driver.scheduling.cel.values import NONE, OptionalValue

_GLOBAL_FUNCS: dict[str, Callable[..., Any]] = {
    "size": _size,
    "int": _to_int,
    "uint": _to_uint,
    "double": _to_double,
    "string": _to_string,
    "bool": _to_bool,
    "bytes": _to_bytes,
    "type": _type_of,
    "dyn": lambda v: v,
    "matches": _matches,
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "isSemver": _is_semver,
    "optional.of": lambda v: OptionalValue(v, present=True),
    "optional.none": lambda: NONE,
    "optional.ofNonZeroValue": lambda v: NONE if _zero(v) else OptionalValue(v, present=True),
    "strings.quote": _quote,
    "lists.range": _lists_range,
    "sets.contains": _sets("sets.contains", lambda a, b: all(_in(x, a) for x in b)),
    "sets.equivalent": _sets(
        "sets.equivalent", lambda a, b: all(_in(x, b) for x in a) and all(_in(x, a) for x in b)
    ),
    "sets.intersects": _sets("sets.intersects", lambda a, b: any(_in(x, b) for x in a)),
}


_METHODS: dict[str, Callable[..., Any]] = {
    "size": _size,
    "contains": _str2("contains", lambda s, t: t in s),
    "startsWith": _str2("startsWith", str.startswith),
    "endsWith": _str2("endsWith", str.endswith),
    "matches": _matches,
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": _ascii_case("lowerAscii", upper=False),
    "upperAscii": _ascii_case("upperAscii", upper=True),
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": _trim,
    "join": _join,
    "format": _format,
    "reverse": _reverse,
    "find": _find,
    "findAll": _find_all,
    "isSorted": _is_sorted,
    "sum": _sum,
    "min": _min_max("min", -1),
    "max": _min_max("max", 1),
    "slice": _slice,
    "flatten": _flatten,
    "distinct": _distinct,
    "sort": _sort,
    "includes": _includes,
    "isInteger": _q_is_integer,
    "asInteger": _q_as_integer,
    "asApproximateFloat": _q_float,
    "sign": _q_sign,
    "add": _q_add,
    "sub": _q_sub,
    "compareTo": _compare_to,
    "isGreaterThan": _is_greater,
    "isLessThan": _is_less,
    "major": _semver_part("major"),
    "minor": _semver_part("minor"),
    "patch": _semver_part("patch"),
    "hasValue": lambda o: _opt("hasValue", o).present,
    "value": _opt_value,
    "orValue": _opt_or_value,
    "or": _opt_or,
}
