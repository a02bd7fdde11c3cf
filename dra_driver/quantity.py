"""Kubernetes resource quantities: exact parsing and the API server's canonical form.

Pure. The API server stores quantities in canonical form (``85899345920`` sent with a binary
suffix comes back as ``80Gi``); publishing must send exactly that form, or every restart would
look like a change. Parsing is exact (``fractions.Fraction``) so that CEL comparisons such as
``quantity('1Gi') == quantity('1024Mi')`` hold by value.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

Format = Literal["BinarySI", "DecimalSI", "DecimalExponent"]

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_DECIMAL_BY_EXP = {exp: suffix for suffix, exp in _DECIMAL.items() if exp > 0}
_BINARY_BY_EXP = {exp: suffix for suffix, exp in _BINARY.items()}
_QUANTITY_RE = re.compile(
    r"^(?P<sign>[+-])?(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?[0-9]+)|(?P<dec>[numkMGTPE])?)$"
)


class QuantityError(ValueError):
    """A string is not a valid Kubernetes quantity."""


@dataclass(frozen=True, order=False)
class Quantity:
    """An exact quantity value and the format its suffix implied."""

    value: Fraction
    format: Format

    @property
    def is_integer(self) -> bool:
        return self.value.denominator == 1

    def canonical(self) -> str:
        """The string the API server would store for this quantity."""
        return format_quantity(self.value, self.format)


def parse_quantity(text: str) -> Quantity:
    """Parse ``text`` as a Kubernetes quantity; raise QuantityError naming it if invalid.

    Results are cached (Quantity is immutable): a cluster's slices repeat the same few strings
    ("80Gi", "132") thousands of times, and exact Fraction arithmetic is the costly part.
    """
    return _parse_quantity(text)


@functools.lru_cache(maxsize=4096)
def _parse_quantity(text: str) -> Quantity:
    m = _QUANTITY_RE.match(text.strip()) if len(text) <= 128 else None
    if m is None or text != text.strip():
        raise QuantityError(f"{text!r} is not a valid quantity (expected e.g. 40Gi, 500m, 1e3)")
    number = Fraction(m["num"])
    if m["sign"] == "-":
        number = -number
    fmt: Format
    if m["bin"]:
        return Quantity(number * 1024 ** _BINARY[m["bin"]], "BinarySI")
    if m["exp"]:
        fmt = "DecimalExponent"
        return Quantity(number * Fraction(10) ** int(m["exp"][1:]), fmt)
    return Quantity(number * Fraction(10) ** _DECIMAL[m["dec"] or ""], "DecimalSI")


def format_quantity(value: Fraction | int, fmt: Format = "DecimalSI") -> str:
    """Canonical form of ``value`` as Kubernetes writes it (integers and milli-units).

    Mirrors apimachinery's ``Quantity.String``: BinarySI uses the largest 1024-power suffix that
    divides the value exactly, falling back to DecimalSI below 1024 or for fractions; DecimalSI
    uses the largest 1000-power suffix that divides exactly.
    """
    value = Fraction(value)
    if value == 0:
        return "0"
    if fmt == "BinarySI" and value.denominator == 1 and abs(value) >= 1024:
        n = int(value)
        exp = 0
        while exp < 6 and n % 1024 == 0:
            n //= 1024
            exp += 1
        return f"{n}{_BINARY_BY_EXP.get(exp, '')}"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value.denominator != 1:
        # Sub-unit values: express in the smallest decimal suffix that makes them integral.
        for suffix, exp in (("m", -3), ("u", -6), ("n", -9)):
            scaled = value / Fraction(10) ** exp
            if scaled.denominator == 1:
                return f"{sign}{int(scaled)}{suffix}"
        # Kubernetes rounds up to nano units.
        nanos = -(-value.numerator * 10**9 // value.denominator)
        return f"{sign}{nanos}n"
    n = int(value)
    exp = 0
    while exp < 18 and n % 1000 == 0:
        n //= 1000
        exp += 3
    if fmt == "DecimalExponent":
        return f"{sign}{n}e{exp}" if exp else f"{sign}{n}"
    return f"{sign}{n}{_DECIMAL_BY_EXP.get(exp, '')}"


def binary(value_bytes: int) -> str:
    """Canonical string for a byte count published as a binary-SI quantity."""
    return format_quantity(value_bytes, "BinarySI")


def decimal(count: int) -> str:
    """Canonical string for a plain count published as a decimal-SI quantity."""
    return format_quantity(count, "DecimalSI")
