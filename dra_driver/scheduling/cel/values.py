"""CEL values of the DRA environment: uint, Kubernetes Quantity and Semver objects, optionals,
types, the ``device`` variable, how values print, and CEL equality (heterogeneous ``==`` as
cel-go has it; an optional's equality is its value's, so it lives here, below ``runtime``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Final

from dra_driver.quantity import Format, format_quantity, parse_quantity

MAX_EXPRESSION_BYTES: Final = 10 * 1024  # CELSelectorExpressionMaxLength


_COST: Final = "@cost"  # activation key of the runtime cost counter (not a CEL identifier)


_INT_MIN: Final = -(2**63)


_INT_MAX: Final = 2**63 - 1


_UINT_MAX: Final = 2**64 - 1


class UInt(int):
    """A CEL ``uint`` (Python ints are CEL ``int``)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{int(self)}u"


class CelQuantity:
    """A Kubernetes Quantity inside CEL: compared by value, keeps its suffix family."""

    __slots__ = ("denominator", "format", "numerator", "value")

    def __init__(self, value: Fraction, fmt: Format = "DecimalSI") -> None:
        self.value = value
        self.format: Format = fmt
        # kept as plain ints: compareTo cross-multiplies them (Fraction's own comparison and even
        # its numerator/denominator properties cost more than the rest of a selector)
        self.numerator, self.denominator = value.numerator, value.denominator

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


# CEL equality lives with the values (an optional's equality is its value's), below runtime.


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
