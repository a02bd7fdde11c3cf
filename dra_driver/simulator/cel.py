"""The Kubernetes DRA CEL environment for device selectors (spec section E). Pure.

Parsing uses cel-python's Lark grammar, extended with the optional-access syntax (``x.?f``,
``m[?k]``) that cel-python 0.5.0 lacks. Evaluation does not use cel-python's tree-walking
interpreter (about 2,300 evaluations/s): each expression is compiled once into Python closures
(``Program``), which also carry a static type so that mistakes the API server would reject
(unknown functions, ``device.foo``, ``device.driver == 1``, a non-bool result) fail at compile
time with their line and column. Runtime semantics follow cel-go as the scheduler runs it:
heterogeneous ``==``, errors that are not ``false`` (``&&``/``||`` absorb an error only when the
other side decides), unknown attribute domains read as empty maps, unknown attributes are a
"no such key" error.

Libraries: the CEL standard functions and macros, ``cel.bind``, optional types, ext.Strings
v2 (with ``format``), Kubernetes quantity, semver, lists (v0 and ext.Lists v3), sets and regex
(``matches``, ``find``/``findAll``, with RE2 through google-re2 as the API server has it; a
constant pattern RE2 refuses is a compile error),
two-variable comprehensions, and DRA ``includes()``. Not implemented (compile error
"undeclared reference"): timestamps and durations, url/ip/cidr/format libraries, protobuf
message construction. Optional types include ``optMap``/``optFlatMap``, ``optional_type``,
``has()`` through optional chains and optional list/map literal entries (``[?x]``, ``{?k: v}``).
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from importlib import resources
from typing import Any, Final

import lark
import re2
from lark.exceptions import LarkError, UnexpectedInput

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.quantity import Format, QuantityError, format_quantity, parse_quantity
from dra_driver.simulator import environment as env

MAX_EXPRESSION_BYTES: Final = 10 * 1024  # CELSelectorExpressionMaxLength
_COST: Final = "@cost"  # activation key of the runtime cost counter (not a CEL identifier)
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**63 - 1
_UINT_MAX: Final = 2**64 - 1

# ---------------------------------------------------------------------------------------------
# Values


class UInt(int):
    """A CEL ``uint`` (Python ints are CEL ``int``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{int(self)}u"


class CelQuantity:
    """A Kubernetes Quantity inside CEL: compared by value, keeps its suffix family."""

    __slots__ = ("format", "value")

    def __init__(self, value: Fraction, fmt: Format = "DecimalSI") -> None:
        self.value = value
        self.format: Format = fmt

    @classmethod
    def parse(cls, text: str) -> CelQuantity:
        q = parse_quantity(text)
        return cls(q.value, q.format)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __str__(self) -> str:
        return format_quantity(self.value, self.format)

    def __repr__(self) -> str:
        return f"quantity('{self}')"


_SEMVER_RE = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


class Semver:
    """A semantic version (semver 2.0.0) as the Kubernetes semver library sees it."""

    __slots__ = ("build", "major", "minor", "patch", "pre")

    def __init__(self, major: int, minor: int, patch: int, pre: str = "", build: str = "") -> None:
        self.major, self.minor, self.patch, self.pre, self.build = major, minor, patch, pre, build

    @classmethod
    def parse(cls, text: str, *, normalize: bool = False) -> Semver:
        if normalize:
            text = _normalize_semver(text)
        m = _SEMVER_RE.match(text)
        if m is None:
            raise ValueError(f"invalid semver {text!r}")
        return cls(int(m[1]), int(m[2]), int(m[3]), m[4] or "", m[5] or "")

    def compare(self, other: Semver) -> int:
        a = (self.major, self.minor, self.patch)
        b = (other.major, other.minor, other.patch)
        if a != b:
            return -1 if a < b else 1
        if self.pre == other.pre:
            return 0
        if not self.pre or not other.pre:  # a release sorts after its pre-releases
            return 1 if not self.pre else -1
        for x, y in zip(self.pre.split("."), other.pre.split("."), strict=False):
            if x == y:
                continue
            if x.isdigit() and y.isdigit():
                return -1 if int(x) < int(y) else 1
            if x.isdigit() != y.isdigit():
                return -1 if x.isdigit() else 1
            return -1 if x < y else 1
        n, m = len(self.pre.split(".")), len(other.pre.split("."))
        return 0 if n == m else (-1 if n < m else 1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.compare(other) == 0

    def __hash__(self) -> int:
        return hash((self.major, self.minor, self.patch, self.pre))

    def __str__(self) -> str:
        s = f"{self.major}.{self.minor}.{self.patch}"
        return s + (f"-{self.pre}" if self.pre else "") + (f"+{self.build}" if self.build else "")


def _normalize_semver(text: str) -> str:
    """semver(s, true): drop a leading v, fill in missing minor/patch, strip leading zeros."""
    text = text.removeprefix("v")
    core, sep, rest = _split_core(text)
    parts = core.split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return text
    parts = [str(int(p)) for p in parts] + ["0"] * (3 - len(parts))
    return ".".join(parts) + sep + rest


def _split_core(text: str) -> tuple[str, str, str]:
    m = re.search(r"[-+]", text)
    if m is None:
        return text, "", ""
    return text[: m.start()], text[m.start()], text[m.start() + 1 :]


class OptionalValue:
    """A CEL ``optional_type`` value: ``optional.of(x)`` or ``optional.none()``."""

    __slots__ = ("present", "value")

    def __init__(self, value: Any, *, present: bool) -> None:
        self.value = value
        self.present = present

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OptionalValue) or other.present != self.present:
            return False
        return not self.present or _eq(self.value, other.value)

    def __hash__(self) -> int:
        return hash(self.present)

    def __repr__(self) -> str:
        return f"optional.of({_show(self.value)})" if self.present else "optional.none()"


NONE: Final = OptionalValue(None, present=False)


@dataclass(frozen=True)
class CelType:
    """A CEL type value, as returned by ``type(x)`` and named by ``int``, ``string``, ..."""

    name: str


class DeviceObject(dict[str, Any]):
    """The ``device`` variable (``kubernetes.DRADevice``)."""


class DomainIndex(dict[str, "DomainMap"]):
    """``device.attributes`` / ``device.capacity``: an unknown domain reads as an empty map."""

    def __init__(self, kind: str, items: Mapping[str, DomainMap]) -> None:
        super().__init__(items)
        self.kind = kind

    def __missing__(self, domain: str) -> DomainMap:
        return DomainMap(self.kind, domain, {})


class DomainMap(dict[str, Any]):
    """The attributes (or capacities) of one domain; a missing id is a runtime error."""

    def __init__(self, kind: str, domain: str, items: Mapping[str, Any]) -> None:
        super().__init__(items)
        self.kind = kind
        self.domain = domain


def device_variable(
    *,
    driver: str,
    attributes: Mapping[str, Any],
    capacity: Mapping[str, CelQuantity],
    allow_multiple_allocations: bool = False,
) -> DeviceObject:
    """Build the ``device`` variable from qualified names (an unqualified name is the driver's).

    ``attributes`` values are CEL values already (int, bool, str, Semver, or lists of them).
    """
    attrs: dict[str, dict[str, Any]] = {}
    for name, value in attributes.items():
        domain, _, ident = name.rpartition("/")
        attrs.setdefault(domain or driver, {})[ident] = value
    caps: dict[str, dict[str, CelQuantity]] = {}
    for name, q in capacity.items():
        domain, _, ident = name.rpartition("/")
        caps.setdefault(domain or driver, {})[ident] = q
    return DeviceObject(
        driver=driver,
        attributes=DomainIndex(
            "attribute", {d: DomainMap("attribute", d, m) for d, m in attrs.items()}
        ),
        capacity=DomainIndex("capacity", {d: DomainMap("capacity", d, m) for d, m in caps.items()}),
        allowMultipleAllocations=allow_multiple_allocations,
    )


def _tname(v: Any) -> str:
    t = type(v)
    if t is bool:
        return "bool"
    if t is int:
        return "int"
    return _TYPE_NAMES.get(t) or (
        "map" if isinstance(v, dict) else "list" if isinstance(v, list) else t.__name__
    )


_TYPE_NAMES: dict[type, str] = {
    UInt: "uint",
    float: "double",
    str: "string",
    bytes: "bytes",
    type(None): "null_type",
    list: "list",
    dict: "map",
    DomainIndex: "map",
    DomainMap: "map",
    DeviceObject: "kubernetes.DRADevice",
    CelQuantity: "kubernetes.Quantity",
    Semver: "kubernetes.Semver",
    OptionalValue: "optional_type",
    CelType: "type",
}


def _show(v: Any) -> str:
    """A value as CEL would write it, for messages."""
    if v is True:
        return "true"
    if v is False:
        return "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, CelQuantity | Semver):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_show(k)}: {_show(x)}" for k, x in v.items()) + "}"
    if isinstance(v, CelType):
        return v.name
    return repr(v)


def show_value(v: Any) -> str:
    """Public form of ``_show`` for reports."""
    return _show(v)


# ---------------------------------------------------------------------------------------------
# Runtime helpers


def _err(message: str) -> CelRuntimeError:
    return CelRuntimeError(message)


def _no_overload(fn: str, *args: Any) -> CelRuntimeError:
    return CelRuntimeError(f"no such overload: {fn}({', '.join(_tname(a) for a in args)})")


_NUMERIC = (int, UInt, float)


def _is_num(v: Any) -> bool:
    return type(v) in (int, UInt, float)


def _eq(a: Any, b: Any) -> bool:
    ta, tb = type(a), type(b)
    if ta is tb and ta in (str, int, bool, float, bytes, UInt, type(None)):
        return bool(a == b)
    if ta is bool or tb is bool:
        return False
    if ta in (int, UInt, float) and tb in (int, UInt, float):
        if ta is float or tb is float:
            if (ta is float and math.isnan(a)) or (tb is float and math.isnan(b)):
                return False
            return _mixed_cmp(a, b) == 0
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        if len(a) != len(b):
            return False
        return all(k in b and _eq(x, b[k]) for k, x in a.items())
    if ta is tb and ta in (CelQuantity, Semver, OptionalValue, CelType):
        return bool(a == b)
    return False


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


_INT_MIN_AS_DOUBLE = float(-(2**63))
_INT_MAX_AS_DOUBLE = float(2**63 - 1)  # rounds to 2^63, as Go's float64(math.MaxInt64)
_UINT_MAX_AS_DOUBLE = float(2**64 - 1)


def _mixed_cmp(a: Any, b: Any) -> int:
    """An int or uint against a double, as cel-go compares them (neither is NaN): a double
    outside the integer type's range orders by its sign; otherwise the integer is converted to a
    double (so ``9223372036854775807 == 9223372036854775808.0``), exact comparison being what
    Python would do instead."""
    if type(a) is float:
        return -_mixed_cmp(b, a)
    if type(a) is int:
        if b < _INT_MIN_AS_DOUBLE:
            return 1
        if b > _INT_MAX_AS_DOUBLE:
            return -1
    else:
        if b < 0:
            return 1
        if b > _UINT_MAX_AS_DOUBLE:
            return -1
    fa = float(a)
    return -1 if fa < b else (1 if fa > b else 0)


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


# ---------------------------------------------------------------------------------------------
# Function implementations (receiver first for methods)


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


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re2._Regexp:
    """``pattern`` compiled with RE2, the engine (and so the syntax and semantics) of the API
    server's CEL: no look-arounds or back-references, ``$`` only at the very end, ``\\d`` ASCII
    only, POSIX classes and ``\\pL``; matching time linear in the input."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _err(f"invalid regular expression {pattern!r}: {reason}") from exc


_RE2_OPTIONS = re2.Options()
_RE2_OPTIONS.log_errors = False  # the error is the caller's to report, not a log line on stderr


_REGEX_FUNCS = frozenset({"matches", "find", "findAll"})


def _matches(s: Any, p: Any) -> bool:
    if type(s) is str and type(p) is str:
        return _regex(p).search(s) is not None
    raise _no_overload("matches", s, p)


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


# strings extension (ext.Strings v2)


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


def _find(s: Any, p: Any) -> str:
    if type(s) is not str or type(p) is not str:
        raise _no_overload("find", s, p)
    m = _regex(p).search(s)
    return m.group(0) if m else ""


def _find_all(s: Any, p: Any, n: Any = -1) -> list[str]:
    """Go's ``Regexp.FindAllString``: an empty match right where the previous match ended is
    not a match of its own (``'123a45'.findAll('[0-9]*')`` is ``['123', '45']``)."""
    if type(s) is not str or type(p) is not str or type(n) is not int:
        raise _no_overload("findAll", s, p)
    regex = _regex(p)
    found: list[str] = []
    pos, previous_end = 0, -1
    while pos <= len(s) and (n < 0 or len(found) < n):
        m = regex.search(s, pos)
        if m is None:
            break
        start, end = m.span()
        if end > start:
            found.append(m.group(0))
            pos = end
        else:
            if start != previous_end:
                found.append("")
            pos = end + 1
        previous_end = end
    return found


# lists (Kubernetes lists v0 and ext.Lists v3)


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


def _sets(fn: str, impl: Callable[[list[Any], list[Any]], bool]) -> Callable[[Any, Any], bool]:
    def f(a: Any, b: Any) -> bool:
        if not isinstance(a, list) or not isinstance(b, list):
            raise _no_overload(fn, a, b)
        return impl(a, b)

    return f


def _includes(v: Any, x: Any) -> bool:
    if isinstance(v, list):
        return any(_eq(y, x) for y in v)
    return _eq(v, x)


# quantity library


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


# quantity and semver share compareTo / isGreaterThan / isLessThan


def _compare_to(a: Any, b: Any) -> int:
    if type(a) is CelQuantity and type(b) is CelQuantity:
        # Cross-multiplied integers: Fraction's own comparison goes through the numbers ABCs
        # and costs a third of a selector's evaluation (denominators are always positive).
        x, y = a.value, b.value
        left, right = x.numerator * y.denominator, y.numerator * x.denominator
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


def _semver(s: Any, normalize: Any = False) -> Semver:
    if type(s) is not str or type(normalize) is not bool:
        raise _no_overload("semver", s)
    try:
        return Semver.parse(s, normalize=normalize)
    except ValueError as exc:
        raise _err(f"semver: {exc}") from None


def _is_semver(s: Any, normalize: Any = False) -> bool:
    if type(s) is not str or type(normalize) is not bool:
        raise _no_overload("isSemver", s)
    try:
        Semver.parse(s, normalize=normalize)
    except ValueError:
        return False
    return True


def _semver_part(fn: str) -> Callable[[Any], int]:
    def f(v: Any) -> int:
        if type(v) is not Semver:
            raise _no_overload(fn, v)
        return int(getattr(v, fn))

    return f


# optional


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

# ---------------------------------------------------------------------------------------------
# Static types (enough of cel-go's checker to reject what the API server would reject)


@dataclass(frozen=True)
class T:
    name: str
    params: tuple[T, ...] = ()

    def __str__(self) -> str:
        return f"{self.name}({', '.join(map(str, self.params))})" if self.params else self.name


DYN = T("dyn")
BOOL, INT, UINT, DOUBLE = T("bool"), T("int"), T("uint"), T("double")
STRING, BYTES, NULL, TYPE = T("string"), T("bytes"), T("null_type"), T("type")
QUANTITY, SEMVER = T("kubernetes.Quantity"), T("kubernetes.Semver")
DEVICE = T("kubernetes.DRADevice")


def list_of(e: T) -> T:
    return T("list", (e,))


def map_of(k: T, v: T) -> T:
    return T("map", (k, v))


def opt_of(e: T) -> T:
    return T("optional_type", (e,))


LIST_DYN, MAP_DYN, OPT_DYN = list_of(DYN), map_of(DYN, DYN), opt_of(DYN)
_DEVICE_FIELDS: Final = {
    "driver": STRING,
    "attributes": map_of(STRING, map_of(STRING, DYN)),
    "capacity": map_of(STRING, map_of(STRING, QUANTITY)),
    "allowMultipleAllocations": BOOL,
}
_TYPE_IDENTS: Final = {
    n: CelType(n)
    for n in (
        "int",
        "uint",
        "double",
        "bool",
        "string",
        "bytes",
        "list",
        "map",
        "null_type",
        "type",
        "optional_type",
    )
}


def _fits(p: T, a: T) -> bool:
    if p.name == "dyn" or a.name == "dyn":
        return True
    if p.name != a.name or len(p.params) != len(a.params):
        return False
    return all(_fits(x, y) for x, y in zip(p.params, a.params, strict=True))


_NUMS = (INT, UINT, DOUBLE)
_ORDERED = (*_NUMS, STRING, BYTES, BOOL)
# name -> [(receiver or None for a global function, params, result)]
_Sig = tuple[T | None, tuple[T, ...], T]
_SIGS: dict[str, list[_Sig]] = {
    "size": [(None, (t,), INT) for t in (STRING, BYTES, LIST_DYN, MAP_DYN)]
    + [(t, (), INT) for t in (STRING, BYTES, LIST_DYN, MAP_DYN)],
    "int": [(None, (t,), INT) for t in (INT, UINT, DOUBLE, STRING)],
    "uint": [(None, (t,), UINT) for t in (INT, UINT, DOUBLE, STRING)],
    "double": [(None, (t,), DOUBLE) for t in (INT, UINT, DOUBLE, STRING)],
    "string": [(None, (t,), STRING) for t in (INT, UINT, DOUBLE, STRING, BOOL, BYTES)],
    "bool": [(None, (t,), BOOL) for t in (BOOL, STRING)],
    "bytes": [(None, (t,), BYTES) for t in (BYTES, STRING)],
    "type": [(None, (DYN,), TYPE)],
    "dyn": [(None, (DYN,), DYN)],
    "matches": [(None, (STRING, STRING), BOOL), (STRING, (STRING,), BOOL)],
    "contains": [(STRING, (STRING,), BOOL)],
    "startsWith": [(STRING, (STRING,), BOOL)],
    "endsWith": [(STRING, (STRING,), BOOL)],
    "charAt": [(STRING, (INT,), STRING)],
    "indexOf": [(STRING, (STRING,), INT), (STRING, (STRING, INT), INT), (LIST_DYN, (DYN,), INT)],
    "lastIndexOf": [
        (STRING, (STRING,), INT),
        (STRING, (STRING, INT), INT),
        (LIST_DYN, (DYN,), INT),
    ],
    "lowerAscii": [(STRING, (), STRING)],
    "upperAscii": [(STRING, (), STRING)],
    "replace": [(STRING, (STRING, STRING), STRING), (STRING, (STRING, STRING, INT), STRING)],
    "split": [(STRING, (STRING,), list_of(STRING)), (STRING, (STRING, INT), list_of(STRING))],
    "substring": [(STRING, (INT,), STRING), (STRING, (INT, INT), STRING)],
    "trim": [(STRING, (), STRING)],
    "join": [(list_of(STRING), (), STRING), (list_of(STRING), (STRING,), STRING)],
    "format": [(STRING, (LIST_DYN,), STRING)],
    "reverse": [(LIST_DYN, (), LIST_DYN)],  # lists v3; string reverse() is ext.Strings v3
    "strings.quote": [(None, (STRING,), STRING)],
    "find": [(STRING, (STRING,), STRING)],
    "findAll": [(STRING, (STRING,), list_of(STRING)), (STRING, (STRING, INT), list_of(STRING))],
    "isSorted": [(LIST_DYN, (), BOOL)],
    "sum": [(LIST_DYN, (), DYN)],
    "min": [(LIST_DYN, (), DYN)],
    "max": [(LIST_DYN, (), DYN)],
    "slice": [(LIST_DYN, (INT, INT), LIST_DYN)],
    "flatten": [(LIST_DYN, (), LIST_DYN), (LIST_DYN, (INT,), LIST_DYN)],
    "distinct": [(LIST_DYN, (), LIST_DYN)],
    "sort": [(LIST_DYN, (), LIST_DYN)],
    "lists.range": [(None, (INT,), list_of(INT))],
    "sets.contains": [(None, (LIST_DYN, LIST_DYN), BOOL)],
    "sets.equivalent": [(None, (LIST_DYN, LIST_DYN), BOOL)],
    "sets.intersects": [(None, (LIST_DYN, LIST_DYN), BOOL)],
    "includes": [(DYN, (DYN,), BOOL)],
    "quantity": [(None, (STRING,), QUANTITY)],
    "isQuantity": [(None, (STRING,), BOOL)],
    "isInteger": [(QUANTITY, (), BOOL)],
    "asInteger": [(QUANTITY, (), INT)],
    "asApproximateFloat": [(QUANTITY, (), DOUBLE)],
    "sign": [(QUANTITY, (), INT)],
    "add": [(QUANTITY, (QUANTITY,), QUANTITY), (QUANTITY, (INT,), QUANTITY)],
    "sub": [(QUANTITY, (QUANTITY,), QUANTITY), (QUANTITY, (INT,), QUANTITY)],
    "compareTo": [(QUANTITY, (QUANTITY,), INT), (SEMVER, (SEMVER,), INT)],
    "isGreaterThan": [(QUANTITY, (QUANTITY,), BOOL), (SEMVER, (SEMVER,), BOOL)],
    "isLessThan": [(QUANTITY, (QUANTITY,), BOOL), (SEMVER, (SEMVER,), BOOL)],
    "semver": [(None, (STRING,), SEMVER), (None, (STRING, BOOL), SEMVER)],
    "isSemver": [(None, (STRING,), BOOL), (None, (STRING, BOOL), BOOL)],
    "major": [(SEMVER, (), INT)],
    "minor": [(SEMVER, (), INT)],
    "patch": [(SEMVER, (), INT)],
    "optional.of": [(None, (DYN,), OPT_DYN)],
    "optional.none": [(None, (), OPT_DYN)],
    "optional.ofNonZeroValue": [(None, (DYN,), OPT_DYN)],
    "hasValue": [(OPT_DYN, (), BOOL)],
    "value": [(OPT_DYN, (), DYN)],
    "orValue": [(OPT_DYN, (DYN,), DYN)],
    "or": [(OPT_DYN, (OPT_DYN,), OPT_DYN)],
}
_NAMESPACED: Final = frozenset(n for n in _SIGS if "." in n) | {"cel.bind"}


def _result_type(name: str, recv: T | None, args: list[T]) -> T | None:
    """The static result type of a call, or None if no overload can match."""
    matches = [
        sig
        for sig in _SIGS.get(name, [])
        if (sig[0] is None) == (recv is None)
        and (recv is None or sig[0] is None or _fits(sig[0], recv))
        and len(sig[1]) == len(args)
        and all(_fits(p, a) for p, a in zip(sig[1], args, strict=True))
    ]
    if not matches:
        return None
    # Generic helpers whose result depends on the receiver's element type.
    if recv is not None and recv.params:
        if name in ("value", "orValue") and recv.name == "optional_type":
            return recv.params[0]
        if name in ("sum", "min", "max") and recv.name == "list":
            return recv.params[0]
    if name == "optional.of" and args:
        return opt_of(args[0])
    results = {m[2] for m in matches}
    return results.pop() if len(results) == 1 else DYN


# ---------------------------------------------------------------------------------------------
# Parser: cel-python's grammar plus optional field/index access


def _grammar() -> str:
    text = resources.files("celpy").joinpath("cel.lark").read_text(encoding="utf-8")
    old = "member         : member_dot | member_dot_arg | member_index | member_object | primary"
    if old not in text:  # pragma: no cover - guards an unexpected cel-python upgrade
        raise RuntimeError("cel-python grammar changed; cannot add optional access syntax")
    new = (
        "member         : member_dot | member_dot_arg | member_index | member_object"
        " | member_dot_opt | member_index_opt | primary\n"
        'member_dot_opt : member "." "?" IDENT\n'
        'member_index_opt : member "[" "?" expr "]"'
    )
    text = text.replace(old, new)
    # Optional entries of list and map literals: [?x, y], {?k: v, k2: v2}.
    lists = 'list_lit       : "[" [exprlist] "]"'
    maps = 'map_lit        : "{" [mapinits] "}"'
    if lists not in text or maps not in text:  # pragma: no cover
        raise RuntimeError("cel-python grammar changed; cannot add optional entries")
    text = text.replace(
        lists,
        'list_lit       : "[" [listelems] "]"\n'
        'listelems      : listelem ("," listelem)*\n'
        "listelem       : opt_entry | expr\n"
        'opt_entry      : "?" expr',
    )
    return text.replace(
        maps,
        'map_lit        : "{" [mapentries] "}"\n'
        'mapentries     : mapentry ("," mapentry)*\n'
        'mapentry       : opt_entry ":" expr | expr ":" expr',
    )


def _bool_literal(t: lark.Token) -> lark.Token:
    if t.value in ("true", "false"):
        return lark.Token("BOOL_LIT", t.value)
    return t


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(
        _grammar(),
        parser="lalr",
        start="expr",
        g_regex_flags=re.M,
        lexer_callbacks={"IDENT": _bool_literal},
        propagate_positions=True,
        maybe_placeholders=False,
        priority="invert",
    )


# ---------------------------------------------------------------------------------------------
# Compiled expression nodes

Activation = dict[str, Any]
Fn = Callable[[Activation], Any]


class Expr:
    """One compiled node: its closure, static type, and what ``why_false`` needs to read it."""

    __slots__ = (
        "column",
        "end",
        "fn",
        "iter_vars",
        "kind",
        "line",
        "name",
        "parts",
        "start",
        "target",
        "type",
    )

    def __init__(
        self,
        kind: str,
        fn: Fn,
        typ: T,
        meta: Any,
        *,
        name: str = "",
        parts: tuple[Expr, ...] = (),
        target: Expr | None = None,
    ) -> None:
        self.kind, self.fn, self.type, self.name = kind, fn, typ, name
        self.parts, self.target = parts, target
        self.iter_vars: tuple[str, ...] = ()  # a comprehension's variables (cost estimate)
        self.line = getattr(meta, "line", 1)
        self.column = getattr(meta, "column", 1)
        self.start = getattr(meta, "start_pos", 0)
        self.end = getattr(meta, "end_pos", 0)


def _const(value: Any) -> Fn:
    return lambda _v: value


class _Compiler:
    def __init__(
        self, source: str, variables: Mapping[str, T], withheld: frozenset[str] = frozenset()
    ) -> None:
        self.source = source
        self.scope: dict[str, T] = dict(variables)
        self.withheld = withheld  # functions the target environment lacks (environment.py)

    def fail(self, meta: Any, message: str) -> CelCompileError:
        # lark leaves a tree's position empty when it has no tokens of its own to take it from
        # (``false && 32``: two literals): the error then points at the expression's start.
        return _compile_error(
            self.source,
            message,
            getattr(meta, "line", None) or 1,
            getattr(meta, "column", None) or 1,
        )

    def fail_at(self, offset: int, message: str) -> CelCompileError:
        """Fail at a character offset (an operator or the dot before a field name)."""
        offset = max(0, min(offset, len(self.source)))
        line = self.source.count("\n", 0, offset) + 1
        column = offset - (self.source.rfind("\n", 0, offset) + 1) + 1
        return _compile_error(self.source, message, line, column)

    def op_offset(self, left: Expr, symbol: str) -> int:
        found = self.source.find(symbol, left.end)
        return found if found >= 0 else left.end

    @staticmethod
    def dot_offset(tok: Any, source: str) -> int:
        start = int(getattr(tok, "start_pos", 0) or 0)
        dot = source.rfind(".", 0, start)
        return dot if dot >= 0 else start

    # -- dispatch
    def visit(self, tree: lark.Tree[Any]) -> Expr:
        data = tree.data
        ch = tree.children
        if (
            data
            in (
                "expr",
                "conditionalor",
                "conditionaland",
                "relation",
                "addition",
                "multiplication",
                "unary",
                "member",
                "primary",
            )
            and len(ch) == 1
        ):
            return self.visit(ch[0])
        if data == "expr":
            return self.ternary(tree)
        if data == "conditionalor":
            return self.logic(tree, "||")
        if data == "conditionaland":
            return self.logic(tree, "&&")
        if data in ("relation", "addition", "multiplication"):
            return self.binary(tree)
        if data == "unary":
            return self.unary(tree)
        if data == "member_dot":
            return self.select(tree, optional=False)
        if data == "member_dot_opt":
            return self.select(tree, optional=True)
        if data == "member_index":
            return self.index(tree, optional=False)
        if data == "member_index_opt":
            return self.index(tree, optional=True)
        if data == "member_dot_arg":
            return self.method(tree)
        if data == "ident_arg":
            return self.call(tree)
        if data == "ident":
            return self.ident(tree)
        if data == "paren_expr":
            return self.visit(ch[0])
        if data == "list_lit":
            return self.list_lit(tree)
        if data == "map_lit":
            return self.map_lit(tree)
        if data == "literal":
            return self.literal(tree)
        if data in ("member_object", "dot_ident", "dot_ident_arg"):
            raise self.fail(
                tree.meta, "message construction and leading-dot names are not supported"
            )
        raise self.fail(tree.meta, f"unsupported syntax {data}")  # pragma: no cover

    def args(self, tree: lark.Tree[Any] | None) -> list[Expr]:
        return [] if tree is None else [self.visit(c) for c in tree.children]

    # -- operators
    def ternary(self, tree: lark.Tree[Any]) -> Expr:
        c, a, b = (self.visit(x) for x in tree.children)
        if not _fits(BOOL, c.type):
            raise self.fail(
                tree.meta, f"found no matching overload for '_?_:_' applied to '({c.type}, ...)'"
            )
        cf, af, bf = c.fn, a.fn, b.fn

        def cond(v: Activation) -> Any:
            return af(v) if _truth(cf(v), "_?_:_") else bf(v)

        if not (_fits(a.type, b.type) or b.type.name == "null_type" or a.type.name == "null_type"):
            raise self.fail(
                tree.meta,
                f"found no matching overload for '_?_:_' applied to '(bool, {a.type}, {b.type})'",
            )
        typ = a.type if a.type == b.type else DYN
        return Expr("cond", cond, typ, tree.meta, parts=(c, a, b))

    def logic(self, tree: lark.Tree[Any], op: str) -> Expr:
        left, right = self.visit(tree.children[0]), self.visit(tree.children[1])
        for e in (left, right):
            if not _fits(BOOL, e.type):
                raise self.fail(
                    tree.meta,
                    f"found no matching overload for '_{op}_' applied to "
                    f"'({left.type}, {right.type})'",
                )
        lf, rf = left.fn, right.fn
        decisive: bool = op == "||"  # the operand value that decides the result
        decided: bool = decisive  # returned; kept apart so `is` checks do not narrow it

        def logic(v: Activation) -> bool:
            err: CelRuntimeError | None = None
            try:
                lv = lf(v)
                if lv is decisive:
                    return decided
                if lv is not (not decisive):
                    err = _no_overload(f"_{op}_", lv)
            except CelRuntimeError as exc:
                err = exc
            try:
                rv = rf(v)
            except CelRuntimeError:
                if err is not None:
                    raise err from None
                raise
            if rv is decisive:
                return decided
            if rv is not (not decisive):
                raise err or _no_overload(f"_{op}_", rv)
            if err is not None:
                raise err
            return not decisive

        kind = "or" if op == "||" else "and"
        # Flatten chains so why_false sees every conjunct/disjunct at one level.
        parts: list[Expr] = []
        for e in (left, right):
            parts.extend(e.parts if e.kind == kind else (e,))
        return Expr(kind, logic, BOOL, tree.meta, parts=tuple(parts))

    def binary(self, tree: lark.Tree[Any]) -> Expr:
        op_tree, rhs_tree = tree.children
        op_name = op_tree.data.split("_", 1)[1]
        left, right = self.visit(op_tree.children[0]), self.visit(rhs_tree)
        lf, rf = left.fn, right.fn
        lt, rt = left.type, right.type
        meta = tree.meta
        if op_name in ("eq", "ne"):
            # cel-go declares == over one type: 1 == 1.0 is refused (use dyn() to compare across
            # numeric types); only <, <=, >, >= are declared across them.
            if not _fits(lt, rt):
                sym = "==" if op_name == "eq" else "!="
                raise self.fail_at(
                    self.op_offset(left, sym),
                    f"found no matching overload for '_{sym}_' applied to '({lt}, {rt})'",
                )
            negate = op_name == "ne"
            fn = self._eq_fn(lf, right, negate)
            return Expr(
                "compare", fn, BOOL, meta, name="!=" if negate else "==", parts=(left, right)
            )
        if op_name in ("lt", "le", "gt", "ge"):
            sym = {"lt": "<", "le": "<=", "gt": ">", "ge": ">="}[op_name]
            ok = (
                lt.name == "dyn"
                or rt.name == "dyn"
                or (lt in _NUMS and rt in _NUMS)
                or (lt == rt and lt in _ORDERED)
            )
            if not ok:
                raise self.fail_at(
                    self.op_offset(left, sym),
                    f"found no matching overload for '_{sym}_' applied to '({lt}, {rt})'",
                )
            test: Callable[[int], bool] = {
                "<": lambda c: c == -1,
                "<=": lambda c: c in (-1, 0),
                ">": lambda c: c == 1,
                ">=": lambda c: c in (0, 1),
            }[sym]
            fname = f"_{sym}_"

            def order(v: Activation) -> bool:
                return test(_cmp(fname, lf(v), rf(v)))

            return Expr("compare", order, BOOL, meta, name=sym, parts=(left, right))
        if op_name == "in":
            if rt.name not in ("dyn", "list", "map"):
                raise self.fail_at(
                    self.op_offset(left, "in"),
                    f"found no matching overload for '@in' applied to '({lt}, {rt})'",
                )
            if rt.params and not _fits(rt.params[0], lt):
                raise self.fail_at(
                    self.op_offset(left, "in"),
                    f"found no matching overload for '@in' applied to '({lt}, {rt})'",
                )
            return Expr(
                "compare", lambda v: _in(lf(v), rf(v)), BOOL, meta, name="in", parts=(left, right)
            )
        sym = {"add": "+", "sub": "-", "mul": "*", "div": "/", "mod": "%"}[op_name]
        fname = f"_{sym}_"
        typ = self._arith_type(self.op_offset(left, sym), sym, lt, rt)
        return Expr(
            "arith", lambda v: _arith(fname, lf(v), rf(v)), typ, meta, name=sym, parts=(left, right)
        )

    def _arith_type(self, offset: int, sym: str, lt: T, rt: T) -> T:
        if lt.name == "dyn" or rt.name == "dyn":
            return rt if lt.name == "dyn" else lt
        allowed: tuple[T, ...] = (INT, UINT, DOUBLE)
        if sym == "+":
            allowed = (*allowed, STRING, BYTES)
            if lt.name == "list" and rt.name == "list":
                return lt if _fits(lt, rt) else LIST_DYN
        if sym == "%":
            allowed = (INT, UINT)
        if lt == rt and lt in allowed:
            return lt
        raise self.fail_at(
            offset, f"found no matching overload for '_{sym}_' applied to '({lt}, {rt})'"
        )

    @staticmethod
    def _eq_fn(lf: Fn, right: Expr, negate: bool) -> Fn:
        if right.kind == "lit" and type(c := right.fn({})) in (str, int, bool):
            ct = type(c)
            if negate:
                return lambda v: not ((a == c) if type(a := lf(v)) is ct else _eq(a, c))
            return lambda v: (a == c) if type(a := lf(v)) is ct else _eq(a, c)
        rf = right.fn
        if negate:
            return lambda v: not _eq(lf(v), rf(v))
        return lambda v: _eq(lf(v), rf(v))

    def unary(self, tree: lark.Tree[Any]) -> Expr:
        op, operand_tree = tree.children
        operand = self.visit(operand_tree)
        f = operand.fn
        if op.data == "unary_not":
            if not _fits(BOOL, operand.type):
                raise self.fail(
                    tree.meta, f"found no matching overload for '!_' applied to '({operand.type})'"
                )

            def not_(v: Activation) -> bool:
                return not _truth(f(v), "!_")

            return Expr("not", not_, BOOL, tree.meta, parts=(operand,))
        if operand.type.name not in ("dyn", "int", "double"):
            raise self.fail(
                tree.meta, f"found no matching overload for '-_' applied to '({operand.type})'"
            )

        def neg(v: Activation) -> Any:
            x = f(v)
            if type(x) is int:
                return _check_int(-x)
            if type(x) is float:
                return -x
            raise _no_overload("-_", x)

        return Expr("arith", neg, operand.type, tree.meta, name="-", parts=(operand,))

    # -- member access
    def select(self, tree: lark.Tree[Any], *, optional: bool) -> Expr:
        obj_tree, field_tok = tree.children
        field = str(field_tok)
        qualified = self._qualified_name(obj_tree, field)
        if qualified is not None:
            return self._namespaced_ident(tree, qualified)
        obj = self.visit(obj_tree)
        of = obj.fn
        outer = obj.type
        # Selecting on an optional selects on its value and stays optional.
        t = outer.params[0] if outer.name == "optional_type" and outer.params else outer
        if t == DEVICE:
            if field not in _DEVICE_FIELDS:
                raise self.fail_at(
                    self.dot_offset(field_tok, self.source), f"undefined field '{field}'"
                )
            ftype = _DEVICE_FIELDS[field]
        elif t.name == "map":
            ftype = t.params[1]
        elif t.name in ("dyn", "optional_type"):
            ftype = DYN
        else:
            raise self.fail_at(
                self.dot_offset(field_tok, self.source),
                f"type '{t}' does not support field selection",
            )
        if optional or outer.name == "optional_type":
            return Expr(
                "opt_select",
                lambda v: _opt_select(of(v), field),
                opt_of(ftype),
                tree.meta,
                name=field,
                target=obj,
            )

        def select(v: Activation) -> Any:
            o = of(v)
            if type(o) is DeviceObject or type(o) is DomainMap:
                try:
                    return o[field]
                except KeyError:
                    raise _missing(o, field) from None
            return _select(o, field)

        return Expr("select", select, ftype, tree.meta, name=field, target=obj)

    def _qualified_name(self, obj_tree: lark.Tree[Any], field: str) -> str | None:
        """``optional.none`` etc.: a dotted name that is not a variable access."""
        node = obj_tree
        while node.data in ("member", "primary") and len(node.children) == 1:
            node = node.children[0]
        if node.data == "ident":
            base = str(node.children[0])
            if base not in self.scope and f"{base}.{field}" in _NAMESPACED:
                return f"{base}.{field}"
        return None

    def _namespaced_ident(self, tree: lark.Tree[Any], name: str) -> Expr:
        raise self.fail(tree.meta, f"{name} is a function; call it as {name}(...)")

    def index(self, tree: lark.Tree[Any], *, optional: bool) -> Expr:
        obj, key = self.visit(tree.children[0]), self.visit(tree.children[1])
        of, kf = obj.fn, key.fn
        outer = obj.type
        t = outer.params[0] if outer.name == "optional_type" and outer.params else outer
        if t.name == "map":
            if not _fits(t.params[0], key.type):
                raise self.fail(
                    tree.meta,
                    f"found no matching overload for '_[_]' applied to '({t}, {key.type})'",
                )
            etype = t.params[1]
        elif t.name == "list":
            if key.type.name not in ("int", "uint", "dyn"):
                raise self.fail(
                    tree.meta,
                    f"found no matching overload for '_[_]' applied to '({t}, {key.type})'",
                )
            etype = t.params[0]
        elif t.name in ("dyn", "optional_type"):
            etype = DYN
        else:
            raise self.fail(
                tree.meta, f"found no matching overload for '_[_]' applied to '({t}, {key.type})'"
            )
        if optional or outer.name == "optional_type":
            return Expr(
                "opt_index",
                lambda v: _opt_index(of(v), kf(v)),
                opt_of(etype),
                tree.meta,
                parts=(key,),
                target=obj,
            )
        if key.kind == "lit" and type(const := key.fn({})) is str:

            def index_const(v: Activation) -> Any:
                o = of(v)
                if type(o) is DomainIndex or type(o) is DomainMap:
                    try:
                        return o[const]
                    except KeyError:
                        raise _missing(o, const) from None
                return _index(o, const)

            return Expr("index", index_const, etype, tree.meta, parts=(key,), target=obj)
        return Expr(
            "index", lambda v: _index(of(v), kf(v)), etype, tree.meta, parts=(key,), target=obj
        )

    def ident(self, tree: lark.Tree[Any]) -> Expr:
        name = str(tree.children[0])
        if name in self.scope:
            return Expr("ident", lambda v: v[name], self.scope[name], tree.meta, name=name)
        if name in _TYPE_IDENTS:
            return Expr("lit", _const(_TYPE_IDENTS[name]), TYPE, tree.meta, name=name)
        raise self.fail(tree.meta, f"undeclared reference to '{name}'")

    # -- calls and macros
    def method(self, tree: lark.Tree[Any]) -> Expr:
        ch = tree.children
        recv_tree, name = ch[0], str(ch[1])
        arg_trees = list(ch[2].children) if len(ch) > 2 else []
        qualified = self._qualified_name(recv_tree, name)
        if qualified == "cel.bind":
            return self.bind(tree, arg_trees)
        if qualified is not None:
            return self.call_named(tree, qualified, [self.visit(a) for a in arg_trees])
        at = self.dot_offset(ch[1], self.source)
        if name in self.withheld:
            raise self.fail_at(at, f"undeclared reference to '{name}' (in container '')")
        if name in (
            "all",
            "exists",
            "exists_one",
            "existsOne",
            "map",
            "filter",
            "transformList",
            "transformMap",
            "sortBy",
        ):
            return self.comprehension(tree, name, recv_tree, arg_trees)
        if name in ("optMap", "optFlatMap"):
            return self.opt_map(tree, name, recv_tree, arg_trees)
        recv = self.visit(recv_tree)
        args = [self.visit(a) for a in arg_trees]
        if name not in _METHODS:
            raise self.fail_at(at, f"undeclared reference to '{name}' (in container '')")
        result = _result_type(name, recv.type, [a.type for a in args])
        if result is None:
            shown = ", ".join(str(a.type) for a in args)
            raise self.fail_at(
                at, f"found no matching overload for '{name}' applied to '{recv.type}.({shown})'"
            )
        if name in _REGEX_FUNCS and args:
            self._check_regex(args[0], lambda message: self.fail_at(at, message))
        impl = _METHODS[name]
        tf = recv.fn
        afs = [a.fn for a in args]
        if not afs:
            fn: Fn = lambda v: impl(tf(v))  # noqa: E731
        elif len(afs) == 1:
            a0 = afs[0]
            fn = lambda v: impl(tf(v), a0(v))  # noqa: E731
        else:
            fn = lambda v: impl(tf(v), *[a(v) for a in afs])  # noqa: E731
        return self._maybe_fold(
            Expr("call", fn, result, tree.meta, name=name, parts=tuple(args), target=recv)
        )

    def call(self, tree: lark.Tree[Any]) -> Expr:
        name = str(tree.children[0])
        arg_trees = list(tree.children[1].children) if len(tree.children) > 1 else []
        if name == "has":
            return self.has(tree, arg_trees)
        if name in self.scope:
            raise self.fail(tree.meta, f"'{name}' is a variable, not a function")
        return self.call_named(tree, name, [self.visit(a) for a in arg_trees])

    def call_named(self, tree: lark.Tree[Any], name: str, args: list[Expr]) -> Expr:
        if name not in _GLOBAL_FUNCS or name in self.withheld:
            raise self.fail(tree.meta, f"undeclared reference to '{name}' (in container '')")
        result = _result_type(name, None, [a.type for a in args])
        if result is None:
            shown = ", ".join(str(a.type) for a in args)
            raise self.fail(
                tree.meta, f"found no matching overload for '{name}' applied to '({shown})'"
            )
        if name in _REGEX_FUNCS and len(args) > 1:
            self._check_regex(args[1], lambda message: self.fail(tree.meta, message))
        impl = _GLOBAL_FUNCS[name]
        afs = [a.fn for a in args]
        if len(afs) == 1:
            a0 = afs[0]
            fn: Fn = lambda v: impl(a0(v))  # noqa: E731
        else:
            fn = lambda v: impl(*[a(v) for a in afs])  # noqa: E731
        return self._maybe_fold(Expr("call", fn, result, tree.meta, name=name, parts=tuple(args)))

    @staticmethod
    def _check_regex(pattern: Expr, fail: Callable[[str], CelCompileError]) -> None:
        """A constant pattern RE2 refuses is a compile error, as the API server reports it (cel-go
        compiles constant patterns when it checks the expression)."""
        if pattern.kind != "lit" or pattern.type != STRING:
            return
        try:
            _regex(pattern.fn({}))
        except CelRuntimeError as exc:
            raise fail(str(exc)) from exc

    @staticmethod
    def _maybe_fold(e: Expr) -> Expr:
        """Evaluate calls on literals once (``quantity('40Gi')``); errors stay runtime errors."""
        inputs = (*e.parts, *((e.target,) if e.target else ()))
        if e.name in ("quantity", "semver") and all(p.kind == "lit" for p in inputs):
            try:
                value = e.fn({})
            except CelRuntimeError:
                return e
            folded = Expr("lit", _const(value), e.type, None, name=e.name, parts=e.parts)
            folded.line, folded.column, folded.start, folded.end = e.line, e.column, e.start, e.end
            return folded
        return e

    def has(self, tree: lark.Tree[Any], arg_trees: list[lark.Tree[Any]]) -> Expr:
        node = arg_trees[0] if len(arg_trees) == 1 else None
        while (
            node is not None
            and node.data
            in (
                "expr",
                "conditionalor",
                "conditionaland",
                "relation",
                "addition",
                "multiplication",
                "unary",
                "member",
            )
            and len(node.children) == 1
        ):
            node = node.children[0]
        if node is None or node.data != "member_dot":
            raise self.fail(tree.meta, "invalid argument to has() macro")
        obj = self.visit(node.children[0])
        field = str(node.children[1])
        if obj.type == DEVICE and field not in _DEVICE_FIELDS:
            raise self.fail(node.meta, f"undefined field '{field}'")
        of = obj.fn

        def has(v: Activation) -> bool:
            o = of(v)
            if type(o) is OptionalValue:  # has(m.?x.y), has(optional.of(m).c): none has nothing
                if not o.present:
                    return False
                o = o.value
            if isinstance(o, dict):
                return field in o
            raise _err(f"invalid type for has(): {_tname(o)}")

        return Expr("has", has, BOOL, tree.meta, name=field, target=obj)

    def opt_map(
        self,
        tree: lark.Tree[Any],
        name: str,
        recv_tree: lark.Tree[Any],
        arg_trees: list[lark.Tree[Any]],
    ) -> Expr:
        """``opt.optMap(x, expr)``: ``optional.of(expr)`` with ``x`` bound to the value, or none;
        ``opt.optFlatMap(x, expr)``: the same, where ``expr`` is itself an optional."""
        var = self._simple_ident(arg_trees[0]) if len(arg_trees) == 2 else None
        if var is None:
            raise self.fail(tree.meta, f"{name}() requires a variable name and an expression")
        recv = self.visit(recv_tree)
        if recv.type.name not in ("optional_type", "dyn"):
            raise self.fail(
                tree.meta, f"found no matching overload for '{name}' applied to '{recv.type}'"
            )
        saved = self.scope.get(var)
        self.scope[var] = recv.type.params[0] if recv.type.params else DYN
        try:
            body = self.visit(arg_trees[1])
        finally:
            if saved is None:
                del self.scope[var]
            else:
                self.scope[var] = saved
        if name == "optFlatMap" and body.type.name not in ("optional_type", "dyn"):
            raise self.fail(
                tree.meta, f"optFlatMap() expression must be an optional, not {body.type}"
            )
        rf, bf, flat = recv.fn, body.fn, name == "optFlatMap"

        def run(v: Activation) -> OptionalValue:
            o = rf(v)
            if type(o) is not OptionalValue:
                raise _no_overload(name, o)
            if not o.present:
                return NONE
            inner = dict(v)
            inner[var] = o.value
            result = bf(inner)
            if not flat:
                return OptionalValue(result, present=True)
            if type(result) is not OptionalValue:
                raise _no_overload(name, result)
            return result

        typ = body.type if flat else opt_of(body.type)
        return Expr("call", run, typ, tree.meta, name=name, parts=(body,), target=recv)

    def bind(self, tree: lark.Tree[Any], arg_trees: list[lark.Tree[Any]]) -> Expr:
        if len(arg_trees) != 3:
            raise self.fail(tree.meta, "cel.bind() requires 3 arguments: (variable, init, body)")
        var = self._simple_ident(arg_trees[0])
        if var is None:
            raise self.fail(tree.meta, "cel.bind() variable name must be a simple identifier")
        init = self.visit(arg_trees[1])
        saved = self.scope.get(var)
        self.scope[var] = init.type
        try:
            body = self.visit(arg_trees[2])
        finally:
            if saved is None:
                del self.scope[var]
            else:
                self.scope[var] = saved
        inf_, bf = init.fn, body.fn

        def bind(v: Activation) -> Any:
            inner = dict(v)
            inner[var] = inf_(v)
            return bf(inner)

        return Expr("bind", bind, body.type, tree.meta, name=var, parts=(init, body))

    @staticmethod
    def _simple_ident(tree: lark.Tree[Any]) -> str | None:
        node = tree
        while isinstance(node, lark.Tree) and len(node.children) == 1 and node.data != "ident":
            node = node.children[0]
        if isinstance(node, lark.Tree) and node.data == "ident":
            return str(node.children[0])
        return None

    def comprehension(
        self,
        tree: lark.Tree[Any],
        name: str,
        recv_tree: lark.Tree[Any],
        arg_trees: list[lark.Tree[Any]],
    ) -> Expr:
        rng = self.visit(recv_tree)
        two_var = name in ("transformList", "transformMap") or (
            name in ("all", "exists", "exists_one", "existsOne") and len(arg_trees) == 3
        )
        nvars = 2 if two_var else 1
        expected = {
            "map": (2, 3),
            "transformList": (3, 4),
            "transformMap": (3, 4),
            "sortBy": (2,),
        }.get(name, (nvars + 1,))
        if len(arg_trees) not in expected:
            raise self.fail(tree.meta, f"{name}() macro has the wrong number of arguments")
        names = [self._simple_ident(a) for a in arg_trees[:nvars]]
        if any(n is None for n in names):
            raise self.fail(tree.meta, f"{name}() macro variables must be simple identifiers")
        vars_ = [n for n in names if n is not None]
        if rng.type.name not in ("dyn", "list", "map"):
            raise self.fail(tree.meta, f"{name}() cannot range over {rng.type}")
        rt = rng.type
        if rt.name == "list":
            var_types = [INT, rt.params[0]] if two_var else [rt.params[0]]
        elif rt.name == "map":
            var_types = [rt.params[0], rt.params[1]] if two_var else [rt.params[0]]
        else:
            var_types = [DYN, DYN] if two_var else [DYN]
        saved = {n: self.scope.get(n) for n in vars_}
        self.scope.update(zip(vars_, var_types, strict=True))
        try:
            bodies = [self.visit(a) for a in arg_trees[nvars:]]
        finally:
            for n, old in saved.items():
                if old is None:
                    self.scope.pop(n, None)
                else:
                    self.scope[n] = old
        step = 1 + sum(_flat_cost(b) for b in bodies)
        fn, typ = _comprehension(
            name, rng.fn, vars_, [b.fn for b in bodies], rng.type, bodies, step
        )
        e = Expr("comprehension", fn, typ, tree.meta, name=name, parts=tuple(bodies), target=rng)
        e.iter_vars = tuple(vars_)
        return e

    # -- literals
    def _entry(self, tree: lark.Tree[Any]) -> tuple[Expr, bool]:
        """A list element: the expression, and whether it is an optional entry (``?x``), whose
        value must be an optional and is left out when it is none."""
        if tree.data == "opt_entry":
            e = self.visit(tree.children[0])
            if e.type.name not in ("optional_type", "dyn"):
                raise self.fail(tree.meta, f"expected type 'optional_type' but found '{e.type}'")
            return e, True
        return self.visit(tree), False

    def list_lit(self, tree: lark.Tree[Any]) -> Expr:
        elems = (
            [self._entry(c.children[0]) for c in tree.children[0].children] if tree.children else []
        )
        items = [e for e, _ in elems]
        if any(opt for _, opt in elems):
            parts = [(e.fn, opt) for e, opt in elems]

            def list_(v: Activation) -> list[Any]:
                out: list[Any] = []
                for f, opt in parts:
                    x = f(v)
                    if not opt:
                        out.append(x)
                    elif type(x) is not OptionalValue:
                        raise _no_overload("optional entry", x)
                    elif x.present:
                        out.append(x.value)
                return out

            elem = self._common_type(
                [(e, e.type.params[0] if opt and e.type.params else DYN if opt else e.type)
                 for e, opt in elems]
            )  # fmt: skip
            return Expr("list", list_, list_of(elem), tree.meta, parts=tuple(items))
        fns = [i.fn for i in items]
        typ = list_of(self._common_type([(i, i.type) for i in items]))
        if all(i.kind == "lit" for i in items):
            value = [f({}) for f in fns]
            return Expr("lit", lambda _v: list(value), typ, tree.meta)
        return Expr("list", lambda v: [f(v) for f in fns], typ, tree.meta, parts=tuple(items))

    def _common_type(self, typed: Sequence[tuple[Expr, T]]) -> T:
        """The element (or key, or value) type of an aggregate literal. The API server's CEL
        environment has homogeneous aggregate literals: ``[1, 'a']`` is a compile error there
        (``[1, dyn('a')]`` is not), so it is one here."""
        common: T | None = None
        for e, t in typed:
            if t.name == "dyn":
                continue
            if common is None or (common.name == "null_type" and t.name == "optional_type"):
                common = t
            elif t.name == "null_type" and common.name == "optional_type":
                continue  # null is assignable to an optional type
            elif not _fits(common, t):
                raise self.fail_expr(e, f"expected type '{common}' but found '{t}'")
        return common or DYN

    def fail_expr(self, e: Expr, message: str) -> CelCompileError:
        return _compile_error(self.source, message, e.line or 1, e.column or 1)

    def map_lit(self, tree: lark.Tree[Any]) -> Expr:
        entries = []
        for entry in tree.children[0].children if tree.children else []:
            key_tree = entry.children[0]
            optional = key_tree.data == "opt_entry"  # {?k: v}: v is an optional, none leaves k out
            key = self.visit(key_tree.children[0] if optional else key_tree)
            value = self.visit(entry.children[1])
            if optional and value.type.name not in ("optional_type", "dyn"):
                raise self.fail(
                    key_tree.meta, f"expected type 'optional_type' but found '{value.type}'"
                )
            entries.append((key, optional, value))
        keys = [k for k, _, _ in entries]
        items = [e for k, _, x in entries for e in (k, x)]
        for k in keys:
            if k.type.name not in ("dyn", "string", "int", "uint", "bool"):
                raise self.fail(tree.meta, f"unsupported map key type {k.type}")
        pairs = [(k.fn, opt, x.fn) for k, opt, x in entries]

        def map_(v: Activation) -> dict[Any, Any]:
            out: dict[Any, Any] = {}
            for kf, opt, xf in pairs:
                k = kf(v)
                if type(k) not in (str, int, UInt, bool):
                    raise _err(f"unsupported map key type {_tname(k)}")
                if _map_key(out, k) is not _ABSENT:
                    raise _err(f"Failed with repeated key: {_show(k)}")
                x = xf(v)
                if opt:
                    if type(x) is not OptionalValue:
                        raise _no_overload("optional entry", x)
                    if not x.present:
                        continue
                    x = x.value
                out[k] = x
            return out

        typ = map_of(
            self._common_type([(k, k.type) for k in keys]),
            self._common_type(
                [(x, x.type.params[0] if opt and x.type.params else DYN if opt else x.type)
                 for _, opt, x in entries]
            ),
        )  # fmt: skip
        return Expr("map", map_, typ, tree.meta, parts=tuple(items))

    def literal(self, tree: lark.Tree[Any]) -> Expr:
        tok = tree.children[0]
        text = str(tok)
        kind = str(getattr(tok, "type", ""))
        value: Any
        if kind == "BOOL_LIT":
            value, typ = text == "true", BOOL
        elif kind == "NULL_LIT":
            value, typ = None, NULL
        elif kind == "INT_LIT":
            value, typ = int(text, 0) if "x" not in text.lower() else _hex(text), INT
            if not _INT_MIN <= value <= _INT_MAX:
                raise self.fail(tree.meta, f"invalid int literal {text}: out of range")
        elif kind == "UINT_LIT":
            n = int(text[:-1], 0) if "x" not in text.lower() else _hex(text[:-1])
            if not 0 <= n <= _UINT_MAX:
                raise self.fail(tree.meta, f"invalid uint literal {text}: out of range")
            value, typ = UInt(n), UINT
        elif kind == "FLOAT_LIT":
            value, typ = float(text), DOUBLE
        elif kind in ("STRING_LIT", "MLSTRING_LIT"):
            value, typ = _decode_string(text, self, tree.meta), STRING
        elif kind == "BYTES_LIT":
            value, typ = _decode_bytes(text[1:], self, tree.meta), BYTES
        else:  # pragma: no cover
            raise self.fail(tree.meta, f"unknown literal {text}")
        return Expr("lit", _const(value), typ, tree.meta)


def _hex(text: str) -> int:
    neg = text.startswith("-")
    n = int(text.lstrip("-"), 16)
    return -n if neg else n


_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\"'\\`?])|([0-3][0-7]{2})|[xX]([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))",
    re.S,
)
_SIMPLE_ESCAPES = {"a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11}


def _string_body(text: str) -> tuple[str, bool]:
    raw = text[0] in "rR"
    if raw:
        text = text[1:]
    q = 3 if text[:3] in ('"""', "'''") else 1
    return text[q:-q], raw


def _decode_string(text: str, comp: _Compiler, meta: Any) -> str:
    body, raw = _string_body(text)
    if raw:
        return body

    def repl(m: re.Match[str]) -> str:
        if m[1]:
            return chr(_SIMPLE_ESCAPES[m[1]]) if m[1] in _SIMPLE_ESCAPES else m[1]
        if m[6] is not None:
            raise comp.fail(meta, f"invalid escape sequence \\{m[6]}")
        code = int(m[2], 8) if m[2] else int(m[3] or m[4] or m[5], 16)
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            raise comp.fail(meta, f"invalid unicode code point in escape {m[0]}")
        return chr(code)

    return _ESCAPE.sub(repl, body)


def _decode_bytes(text: str, comp: _Compiler, meta: Any) -> bytes:
    body, raw = _string_body(text)
    if raw:
        return body.encode("utf-8")
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos : m.start()].encode("utf-8")
        pos = m.end()
        if m[1]:
            out.append(_SIMPLE_ESCAPES.get(m[1], ord(m[1])))
        elif m[2] or m[3]:
            out.append(int(m[2], 8) if m[2] else int(m[3], 16))
        elif m[4] or m[5]:
            out += chr(int(m[4] or m[5], 16)).encode("utf-8")
        else:
            raise comp.fail(meta, f"invalid escape sequence \\{m[6]}")
    out += body[pos:].encode("utf-8")
    return bytes(out)


def _range_items(fn_name: str, rng: Any, two_var: bool) -> Iterable[tuple[Any, ...]]:
    if isinstance(rng, list):
        return enumerate(rng) if two_var else ((x,) for x in rng)
    if isinstance(rng, dict):
        return rng.items() if two_var else ((k,) for k in rng)
    raise _err(f"{fn_name}() cannot range over {_tname(rng)}")


def _flat_cost(e: Expr) -> int:
    """Runtime cost of one evaluation of ``e`` outside nested comprehensions (which count their
    own iterations): 1 per node that is not a literal."""
    if e.kind == "comprehension":
        return 1
    own = 0 if e.kind == "lit" else 1
    return own + sum(_flat_cost(p) for p in e.parts) + (_flat_cost(e.target) if e.target else 0)


class _CostCounter:
    """Actual cost of one evaluation, shared by its comprehensions through the activation."""

    __slots__ = ("spent",)

    def __init__(self) -> None:
        self.spent = 0


def _comprehension(  # noqa: PLR0917 - internal, called once
    name: str, rf: Fn, vars_: list[str], fns: list[Fn], rtype: T, bodies: list[Expr], step: int
) -> tuple[Fn, T]:
    two_var = len(vars_) == 2
    limit = env.COST_LIMIT

    def items(v: Activation) -> Iterable[Activation]:
        rng = rf(v)
        counter = v.get(_COST)
        if counter is None:  # evaluated outside Program.evaluate (why_false): a local budget
            counter = _CostCounter()
        for it in _range_items(name, rng, two_var):
            counter.spent += step
            if counter.spent > limit:
                raise _err("operation cancelled: actual cost limit exceeded")
            inner = dict(v)
            inner[_COST] = counter
            inner.update(zip(vars_, it, strict=True))
            yield inner

    pf = fns[0]
    if name in ("all", "exists"):
        decisive: bool = name == "exists"
        decided: bool = decisive

        def quantifier(v: Activation) -> bool:
            err: CelRuntimeError | None = None
            for inner in items(v):
                try:
                    r = pf(inner)
                except CelRuntimeError as exc:
                    err = err or exc
                    continue
                if r is decisive:
                    return decided
                if r is not (not decisive):
                    err = err or _no_overload(name, r)
            if err is not None:
                raise err
            return not decisive

        return quantifier, BOOL
    if name in ("exists_one", "existsOne"):

        def exists_one(v: Activation) -> bool:
            return sum(1 for inner in items(v) if _truth(pf(inner), name)) == 1

        return exists_one, BOOL
    if name == "filter":
        return (
            lambda v: [inner[vars_[0]] for inner in items(v) if _truth(pf(inner), name)],
            rtype if rtype.name == "list" else LIST_DYN,
        )
    if name == "map":
        if len(fns) == 1:
            return (lambda v: [pf(inner) for inner in items(v)]), list_of(bodies[0].type)
        tf = fns[1]
        return (
            lambda v: [tf(inner) for inner in items(v) if _truth(pf(inner), name)],
            list_of(bodies[1].type),
        )
    if name == "sortBy":

        def sort_by(v: Activation) -> list[Any]:
            pairs: list[tuple[Any, Any]] = [(pf(inner), inner[vars_[0]]) for inner in items(v)]

            def by_key(a: tuple[Any, Any], b: tuple[Any, Any]) -> int:
                return _ordering("sortBy", a[0], b[0])

            pairs.sort(key=functools.cmp_to_key(by_key))
            return [x for _, x in pairs]

        return sort_by, rtype
    if name == "transformList":
        if len(fns) == 1:
            return (lambda v: [pf(inner) for inner in items(v)]), list_of(bodies[0].type)
        tf = fns[1]
        return (
            lambda v: [tf(inner) for inner in items(v) if _truth(pf(inner), name)],
            list_of(bodies[1].type),
        )
    # transformMap
    tf = fns[-1]
    cond = fns[0] if len(fns) == 2 else None

    def transform_map(v: Activation) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for inner in items(v):
            if cond is None or _truth(cond(inner), name):
                out[inner[vars_[0]]] = tf(inner)
        return out

    return transform_map, MAP_DYN


def _syntax_error(source: str, exc: UnexpectedInput) -> CelCompileError:
    token = getattr(exc, "token", None)
    if (token is not None and token.type == "$END") or isinstance(
        exc, lark.exceptions.UnexpectedEOF
    ):
        lines = source.splitlines() or [""]
        return _compile_error(
            source, "syntax error: unexpected end of expression", len(lines), len(lines[-1]) + 1
        )
    if token is not None:
        what = f"unexpected {str(token)!r}"
    else:
        char = getattr(exc, "char", "")
        what = f"unexpected character {char!r}"
    return _compile_error(source, f"syntax error: {what}", max(exc.line, 1), max(exc.column, 1))


def _compile_error(source: str, message: str, line: int, column: int) -> CelCompileError:
    lines = source.splitlines() or [""]
    text = lines[line - 1] if 0 < line <= len(lines) else ""
    return CelCompileError(
        f"line {line}, column {column}: {message}\n | {text}\n | {'.' * (column - 1)}^"
    )


# ---------------------------------------------------------------------------------------------
# Public API


@dataclass(frozen=True, eq=False)
class Program:
    """A compiled expression: evaluate many times, compile once (``compile_selector`` caches)."""

    expression: str
    root: Expr
    # Whether evaluation needs a runtime cost counter (it has a comprehension); spec E.2.
    counts_cost: bool = False
    estimated_cost: int = 0  # compile_selector's estimate (environment.estimate_cost)

    def evaluate(self, activation: Activation) -> Any:
        """Evaluate; raise CelRuntimeError (never a Python exception) on a CEL error, including
        "operation cancelled: actual cost limit exceeded" past the runtime cost limit."""
        if self.counts_cost:
            activation = {**activation, _COST: _CostCounter()}
        try:
            return self.root.fn(activation)
        except RecursionError:
            raise CelRuntimeError("expression too deeply nested") from None
        except (ArithmeticError, ValueError, TypeError) as exc:  # a gap in our type checks
            raise CelRuntimeError(f"evaluation failed: {exc}") from exc

    def matches(self, device: DeviceObject) -> bool:
        """Evaluate as a device selector: the result must be a bool."""
        result = self.evaluate({"device": device})
        if result is True or result is False:
            return bool(result)
        raise CelRuntimeError(f"expression evaluated to {_tname(result)}, not bool")

    def why_false(self, device: DeviceObject) -> list[str]:
        """Human reasons why the selector is false (or fails) for ``device``; [] if it is true."""
        return _Why(self.expression, {"device": device}).reasons(self.root, {"device": device})


def compile_expression(
    expression: str, variables: Mapping[str, T], *, withheld: frozenset[str] = frozenset()
) -> Program:
    """Compile ``expression`` with the given variable types; raise CelCompileError with position.

    ``withheld``: function and macro names the target environment does not declare (every
    library the engine implements is available by default)."""
    size = len(expression.encode("utf-8"))
    if size > MAX_EXPRESSION_BYTES:
        raise CelCompileError(
            f"expression is {size} bytes long, more than the limit of {MAX_EXPRESSION_BYTES}"
        )
    if not expression.strip():
        raise CelCompileError("line 1, column 1: empty expression")
    try:
        tree = _parser().parse(expression)
    except UnexpectedInput as exc:
        raise _syntax_error(expression, exc) from None
    except LarkError as exc:
        raise CelCompileError(f"syntax error: {exc}") from None
    try:
        root = _Compiler(expression, variables, withheld).visit(tree)
    except RecursionError:
        raise CelCompileError("expression is nested too deeply") from None
    return Program(expression, root, counts_cost=_has_comprehension(root))


def _has_comprehension(e: Expr) -> bool:
    return e.kind == "comprehension" or any(
        _has_comprehension(p) for p in (*e.parts, *((e.target,) if e.target else ()))
    )


@lru_cache(maxsize=4096)
def compile_selector(
    expression: str,
    k8s_version: str = env.NEWEST_VERSION,
    feature_gates: frozenset[str] = frozenset(),
) -> Program:
    """Compile a device selector (variable ``device``) as an API server of ``k8s_version``
    compiles a new expression (``environment.py``): the result must be a bool, functions that
    version lacks are undeclared, and the estimated cost must be within the limit. Raise
    CelCompileError (ValueError for an unsupported version). Cached per version and gates."""
    environment = env.environment(k8s_version, feature_gates=feature_gates)
    program = compile_expression(expression, {"device": DEVICE}, withheld=environment.withheld)
    if program.root.type.name not in ("bool", "dyn"):
        raise _compile_error(
            expression,
            f"expression must evaluate to bool, not {program.root.type}",
            program.root.line,
            program.root.column,
        )
    cost = env.estimate_cost(program.root)
    if cost > env.COST_LIMIT:
        raise CelCompileError(
            f"too complex, exceeds cost limit: estimated cost {cost} exceeds the limit of "
            f"{env.COST_LIMIT}"
        )
    return Program(expression, program.root, program.counts_cost, cost)


# ---------------------------------------------------------------------------------------------
# Why a selector is false: walk the compiled tree and describe the failing comparisons.

_RELATION = {-1: "less than", 0: "equal to", 1: "greater than"}


class _Why:
    def __init__(self, source: str, activation: Activation) -> None:
        self.source = source
        self.driver = str(activation["device"].get("driver", ""))
        self.bound: dict[str, Expr] = {}

    def text(self, e: Expr) -> str:
        return " ".join(self.source[e.start : e.end].split()) or e.kind

    def reasons(self, e: Expr, v: Activation) -> list[str]:
        try:
            value = e.fn(v)
        except CelRuntimeError as exc:
            return [str(exc)]
        if value is True:
            return []
        if value is not False:
            return [f"`{self.text(e)}` is {_show(value)}, not a bool"]
        k = e.kind
        if k == "and":
            return [r for p in e.parts for r in self.reasons(p, v)]
        if k == "or":
            alternatives = ["; ".join(self.reasons(p, v)) for p in e.parts]
            return ["none of the alternatives holds: " + " | ".join(alternatives)]
        if k == "not":
            negated = e.parts[0]
            if negated.kind == "has" and negated.target is not None:
                return [f"{self.qualified(negated.target, negated.name)} is present"]
            return [f"`{self.text(negated)}` is true"]
        if k == "has" and e.target is not None:
            return [f"{self.qualified(e.target, e.name)} missing"]
        if k == "compare":
            return [self.compare(e, v)]
        if k == "call" and e.target is not None:
            return [self.method(e, v)]
        if k == "cond":
            c = e.parts[0].fn(v)
            return self.reasons(e.parts[1] if c is True else e.parts[2], v)
        if k == "bind":
            inner = dict(v)
            inner[e.name] = e.parts[0].fn(v)
            saved = self.bound.get(e.name)
            self.bound[e.name] = e.parts[0]
            try:
                return self.reasons(e.parts[1], inner)
            finally:
                if saved is None:
                    del self.bound[e.name]
                else:
                    self.bound[e.name] = saved
        if k == "lit":
            return ["the selector is the constant false"]
        return [f"`{self.text(e)}` is false"]

    def compare(self, e: Expr, v: Activation) -> str:
        left, right = e.parts
        lhs = left
        # x.compareTo(y) <op> n: report how x relates to y.
        if left.kind == "call" and left.name == "compareTo" and left.target is not None:
            a, b = left.target.fn(v), left.parts[0].fn(v)
            rel = _compare_to(a, b)
            return f"{self.describe(left.target)} {_show(a)} is {_RELATION[rel]} {_show(b)}"
        a, b = lhs.fn(v), right.fn(v)
        if e.name == "==":
            return f"{self.describe(lhs)} is {_show(a)}, not {_show(b)}"
        if e.name == "!=":
            return f"{self.describe(lhs)} is {_show(a)}"
        if e.name == "in":
            return f"{self.describe(lhs)} {_show(a)} is not in {_show(b)}"
        try:
            rel = _ordering(e.name, a, b)
        except CelRuntimeError:
            return f"`{self.text(e)}` is false"
        relation = _RELATION.get(rel, "not comparable to")
        return f"{self.describe(lhs)} {_show(a)} is {relation} {_show(b)}"

    def method(self, e: Expr, v: Activation) -> str:
        assert e.target is not None
        recv = e.target.fn(v)
        args = [p.fn(v) for p in e.parts]
        what = f"{self.describe(e.target)} {_show(recv)}"
        shown = ", ".join(_show(a) for a in args)
        if e.name in ("isGreaterThan", "isLessThan") and args:
            rel = _compare_to(recv, args[0])
            return f"{what} is {_RELATION[rel]} {shown}"
        phrases = {
            "startsWith": "does not start with",
            "endsWith": "does not end with",
            "contains": "does not contain",
            "matches": "does not match",
            "includes": "does not include",
        }
        if e.name in phrases:
            return f"{what} {phrases[e.name]} {shown}"
        if e.name in ("orValue", "value", "hasValue"):
            return f"`{self.text(e)}` is false"
        return f"{what}.{e.name}({shown}) is false"

    def describe(self, e: Expr) -> str:
        """Name a value for a person: ``memory``, ``gpu.nvidia.com/productName``, or source."""
        if e.kind in ("select", "opt_select") and e.target is not None:
            return self.describe_field(e.target, e.name)
        if e.kind == "index" and e.target is not None and e.parts[0].kind == "lit":
            return self.describe_field(e.target, str(e.parts[0].fn({})))
        if e.kind == "call" and e.target is not None:
            if e.name in ("orValue", "value"):
                return self.describe(e.target)
            if not e.parts:
                return f"{self.describe(e.target)}.{e.name}()"
        if e.kind == "ident" and e.name in self.bound:
            return self.describe(self.bound[e.name])
        return self.text(e)

    def qualified(self, target: Expr, field: str) -> str:
        """``attribute gpu.nvidia.com/profile`` for a field of a domain map, else its source."""
        domain_expr = target
        if domain_expr.kind == "ident" and domain_expr.name in self.bound:
            domain_expr = self.bound[domain_expr.name]
        if domain_expr.kind == "index" and domain_expr.target is not None:
            base, key = domain_expr.target, domain_expr.parts[0]
            if (
                base.kind == "select"
                and base.name in ("attributes", "capacity")
                and key.kind == "lit"
            ):
                noun = "attribute" if base.name == "attributes" else "capacity"
                return f"{noun} {key.fn({})}/{field}"
        return f"{self.text(target)}.{field}"

    def describe_field(self, target: Expr, field: str) -> str:
        domain_expr = target
        if domain_expr.kind == "ident" and domain_expr.name in self.bound:
            domain_expr = self.bound[domain_expr.name]
        if domain_expr.kind == "index" and domain_expr.target is not None:
            base = domain_expr.target
            key = domain_expr.parts[0]
            if (
                base.kind == "select"
                and base.name in ("attributes", "capacity")
                and key.kind == "lit"
            ):
                domain = str(key.fn({}))
                noun = "attribute" if base.name == "attributes" else "capacity"
                if domain == self.driver:
                    return field
                return f"{noun} {domain}/{field}" if noun == "capacity" else f"{domain}/{field}"
        if target.kind == "ident" and target.name == "device":
            return field
        return f"{self.text(target)}.{field}"


@functools.lru_cache(maxsize=1024)
def _attribute_semver(text: str) -> Semver:
    """A published version attribute, parsed once per distinct string (never mutated)."""
    return Semver.parse(text)


def attribute_value(value: Mapping[str, Any]) -> Any:
    """One ResourceSlice attribute (``{string: ...}``, ``{version: ...}``, lists) as a CEL value."""
    if "string" in value:
        return str(value["string"])
    if "bool" in value:
        return bool(value["bool"])
    if "int" in value:
        return int(value["int"])
    if "version" in value:
        return _attribute_semver(str(value["version"]))
    if "strings" in value:
        return [str(x) for x in value["strings"]]
    if "ints" in value:
        return [int(x) for x in value["ints"]]
    if "bools" in value:
        return [bool(x) for x in value["bools"]]
    if "versions" in value:
        return [_attribute_semver(str(x)) for x in value["versions"]]
    raise ValueError(f"attribute value {dict(value)!r} has none of int/bool/string/version")
