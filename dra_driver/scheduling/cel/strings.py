"""The ext.Strings library (version 2, as Kubernetes enables it), with ``format``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from dra_driver.errors import CelRuntimeError
from dra_driver.scheduling.cel.conversions import _to_string
from dra_driver.scheduling.cel.runtime import _err, _no_overload
from dra_driver.scheduling.cel.values import CelType, UInt, _eq, _tname

# string.format (ext.Strings): %s %d %f %e %b %o %x %X and %%, precision for f and e (``%.3f``)
_FORMAT_CLAUSE = re.compile(r"%(?:(%)|(?:\.(\d+))?(.))", re.S)


_STRING_CLAUSE_TYPES = (
    "strings, bools, bytes, ints, doubles, maps, lists, types, durations, and timestamps"
)


def _format_error(message: str, v: Any) -> CelRuntimeError:
    return _err(f"error during formatting: {message}, was given {_tname(v)}")


def _special_double(v: float) -> str | None:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return None


def _format_s(v: Any) -> str:
    t = type(v)
    if t is float:
        return _special_double(v) or _to_string(v)
    if t in (str, bool, int, UInt, bytes):
        return _to_string(v)
    if v is None:
        return "null"
    if t is CelType:
        return str(v.name)
    if isinstance(v, list):
        return "[" + ", ".join(_format_s(x) for x in v) + "]"
    if isinstance(v, dict):
        entries = sorted((_format_s(k), _format_s(x)) for k, x in v.items())
        return "{" + ", ".join(f"{k}: {x}" for k, x in entries) + "}"
    raise _format_error(f"string clause can only be used on {_STRING_CLAUSE_TYPES}", v)


def _format_clause(verb: str, precision: int | None, v: Any) -> str:
    t = type(v)
    if verb == "s":
        return _format_s(v)
    if verb == "d":
        if t in (int, UInt):
            return str(int(v))
        special = _special_double(v) if t is float else None
        if special is None:
            raise _format_error("decimal clause can only be used on integers", v)
        return special
    if verb in ("f", "e"):
        if t not in (int, UInt, float):
            what = "fixed-point" if verb == "f" else "scientific"
            raise _format_error(f"{what} clause can only be used on doubles", v)
        x = float(v)
        return _special_double(x) or format(x, f".{6 if precision is None else precision}{verb}")
    if verb == "b":
        if t in (int, UInt, bool):
            return format(int(v), "b")
        raise _format_error("only integers and bools can be formatted as binary", v)
    if verb == "o":
        if t in (int, UInt):
            return format(int(v), "o")
        raise _format_error("octal clause can only be used on integers", v)
    # x, X
    if t in (int, UInt):
        text = format(int(v), "x")
    elif t in (str, bytes):
        text = (v.encode() if t is str else v).hex()
    else:
        raise _format_error("only integers, byte buffers, and strings can be formatted as hex", v)
    return text.upper() if verb == "X" else text


def _format(s: Any, args: Any) -> str:
    if type(s) is not str or not isinstance(args, list):
        raise _no_overload("format", s, args)
    out: list[str] = []
    index = 0
    last = 0
    for m in _FORMAT_CLAUSE.finditer(s):
        out.append(s[last : m.start()])
        last = m.end()
        if m[1]:
            out.append("%")
            continue
        verb = m[3]
        if verb not in "sdfeboxX":
            raise _err(
                f'could not parse formatting clause: unrecognized formatting clause "{verb}"'
            )
        if index >= len(args):
            raise _err(f"index {index} out of range")
        out.append(_format_clause(verb, None if m[2] is None else int(m[2]), args[index]))
        index += 1
    out.append(s[last:])
    return "".join(out)


def _char_at(s: Any, i: Any) -> str:
    if type(s) is not str or type(i) is not int:
        raise _no_overload("charAt", s, i)
    if i < 0 or i > len(s):
        raise _err(f"index out of range: {i}")
    return s[i : i + 1]


def _index_of(s: Any, t: Any, start: Any = 0) -> int:
    if isinstance(s, list) and start == 0:
        for i, x in enumerate(s):
            if _eq(x, t):
                return i
        return -1
    if type(s) is not str or type(t) is not str or type(start) is not int:
        raise _no_overload("indexOf", s, t)
    if start < 0 or start > len(s):
        raise _err(f"index out of range: {start}")
    return s.find(t, start)


def _last_index_of(s: Any, t: Any, end: Any = None) -> int:
    if isinstance(s, list) and end is None:
        for i in range(len(s) - 1, -1, -1):
            if _eq(s[i], t):
                return i
        return -1
    if type(s) is not str or type(t) is not str:
        raise _no_overload("lastIndexOf", s, t)
    if end is None:
        return s.rfind(t)
    if type(end) is not int:
        raise _no_overload("lastIndexOf", s, t, end)
    if end < 0 or (end >= len(s) and len(s) > 0):
        raise _err(f"index out of range: {end}")
    return s.rfind(t, 0, end + len(t))


def _ascii_case(fn: str, upper: bool) -> Callable[[Any], str]:
    table = str.maketrans(
        "abcdefghijklmnopqrstuvwxyz" if upper else "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if upper else "abcdefghijklmnopqrstuvwxyz",
    )

    def f(s: Any) -> str:
        if type(s) is not str:
            raise _no_overload(fn, s)
        return s.translate(table)

    return f


def _replace(s: Any, old: Any, new: Any, n: Any = -1) -> str:
    if not (type(s) is str and type(old) is str and type(new) is str and type(n) is int):
        raise _no_overload("replace", s, old, new)
    return s.replace(old, new, n if n >= 0 else -1)


def _split(s: Any, sep: Any, n: Any = -1) -> list[str]:
    if not (type(s) is str and type(sep) is str and type(n) is int):
        raise _no_overload("split", s, sep)
    if n == 0:
        return []
    if sep == "":
        chars = list(s)
        if n > 0 and len(chars) > n:
            chars = [*chars[: n - 1], "".join(chars[n - 1 :])]
        return chars
    return s.split(sep, n - 1 if n > 0 else -1)


def _substring(s: Any, start: Any, end: Any = None) -> str:
    if type(s) is not str or type(start) is not int:
        raise _no_overload("substring", s, start)
    stop = len(s) if end is None else end
    if type(stop) is not int or start < 0 or stop > len(s) or start > stop:
        raise _err(f"substring range [{start}, {stop}) out of bounds for length {len(s)}")
    return s[start:stop]


def _trim(s: Any) -> str:
    if type(s) is not str:
        raise _no_overload("trim", s)
    return s.strip()


def _join(items: Any, sep: Any = "") -> str:
    if not isinstance(items, list) or type(sep) is not str:
        raise _no_overload("join", items, sep)
    if not all(type(x) is str for x in items):
        raise _err("join: list must contain only strings")
    return sep.join(items)


def _quote(s: Any) -> str:
    if type(s) is not str:
        raise _no_overload("strings.quote", s)
    out = s.translate(
        {
            0x07: "\\a",
            0x08: "\\b",
            0x0C: "\\f",
            0x0A: "\\n",
            0x0D: "\\r",
            0x09: "\\t",
            0x0B: "\\v",
            0x5C: "\\\\",
            0x22: '\\"',
        }
    )
    return f'"{out}"'


# What each clause of a constant format string accepts, checked at compile time as cel-go's
# format validator does (ext/formatting.go ``stringFormatChecker``) when the arguments are a
# list literal: the static type's kind must be one of these, or dyn. An attribute value is not
# dyn there but ``google.protobuf.Any`` (how the DRA environment declares attributes), which no
# clause accepts.
_CLAUSE_KINDS = {
    "s": frozenset(
        {"list", "map", "int", "uint", "double", "bool", "string", "bytes", "type", "null_type"}
    ),
    "d": frozenset({"int", "uint", "double"}),
    "f": frozenset({"int", "uint", "double"}),
    "e": frozenset({"int", "uint", "double"}),
    "b": frozenset({"bool", "int", "uint"}),
    "o": frozenset({"int", "uint"}),
    "x": frozenset({"int", "uint", "string", "bytes"}),
    "X": frozenset({"int", "uint", "string", "bytes"}),
}
_CLAUSE_ERRORS = {
    "s": f"string clause can only be used on {_STRING_CLAUSE_TYPES}",
    "d": "decimal clause can only be used on integers",
    "f": "fixed-point clause can only be used on doubles",
    "e": "scientific clause can only be used on doubles",
    "b": "only integers and bools can be formatted as binary",
    "o": "octal clause can only be used on integers",
    "x": "only integers, byte buffers, and strings can be formatted as hex",
    "X": "only integers, byte buffers, and strings can be formatted as hex",
}


def format_problem(fmt: str, args: Sequence[tuple[str, Sequence[Any]]]) -> str | None:
    """What cel-go's compile-time check says of ``fmt.format([...])`` with a list literal, or
    None. ``args``: per element of the literal, its static type's kind (``"any"`` for an
    attribute value) and, for a nested list literal, its elements in the same form."""
    requested = 0
    for m in _FORMAT_CLAUSE.finditer(fmt):
        if m[1]:
            continue
        verb = m[3]
        if verb not in _CLAUSE_KINDS:
            return f'could not parse formatting clause: unrecognized formatting clause "{verb}"'
        if requested >= len(args):
            return None  # too few: an evaluation error, as in cel-go
        bad = _clause_mismatch(verb, args[requested])
        if bad is not None:
            return f"error during formatting: {_CLAUSE_ERRORS[verb]}, was given {bad}"
        requested += 1
    if len(args) > requested:
        return (
            f"too many arguments supplied to string.format (expected {requested}, got {len(args)})"
        )
    return None


def _clause_mismatch(verb: str, arg: tuple[str, Sequence[Any]]) -> str | None:
    kind, elements = arg
    if kind == "any":
        return "google.protobuf.Any"
    if kind != "dyn" and kind not in _CLAUSE_KINDS[verb]:
        return kind
    if verb == "s":
        for element in elements:
            bad = _clause_mismatch(verb, element)
            if bad is not None:
                return bad
    return None
