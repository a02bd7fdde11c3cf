"""cel-go's estimated cost of a compiled selector (spec E.2), checked against
``environment.COST_LIMIT`` when a selector compiles. Pure.

Cost (E.2): estimated cost <= 1,000,000 at validation, the same limit at runtime. The API
server's message for the estimate is "too complex, exceeds cost limit"
(``k8s:pkg/apis/resource/validation/validation.go`` ``validateCELSelector``); at runtime cel-go
cancels with "operation cancelled: actual cost limit exceeded". ``estimate_cost`` follows cel-go's
``checker/cost.go`` as far as we know it:

* a literal costs 0; an identifier, a field selection, ``has()`` and an index cost 1;
* a function or operator call costs 1 plus its arguments; ``&&``/``||`` cost their operands;
  a conditional its condition plus the dearer branch; list literals 10, map literals 30;
* string functions cost by size: ``== < ...`` on strings ceil(0.1 * the shorter size),
  ``startsWith``/``endsWith`` ceil(0.1 * argument size), ``contains`` the product of both
  sides' ceil(0.1 * size), regex functions ceil(0.1 * (string size + 1)) * ceil(0.25 *
  pattern size); ``in`` and list functions the list's size, ``sets.*`` the product of sizes,
  DRA ``includes()`` 48 (``ResourceSliceMaxAttributeValuesPerDevice``);
* a comprehension costs its range plus the range's size times (its body + 3, the accumulator
  and loop-condition calls cel-go's macros expand to); nested ones multiply.

Size hints (E.2): ``device.driver`` 63, attribute and capacity maps 32 entries (domain keys 63,
identifier keys 32), attribute values 64 (strings; list attributes 64 elements), a value of
unknown size is unbounded (cel-go: "max uint64"), which makes any comprehension over it exceed
the limit, as in cel-go.

Where our estimate may differ from cel-go's: the per-iteration overhead of each macro (cel-go
expands ``map``/``filter`` into list appends with their own costs; we charge 3 for all); the
exact cost of the Kubernetes library functions (quantity, semver, ``format``, ``split``,
``join``: we charge ceil(0.1 * size) for string-walking ones, 1 for the rest); constant list
literals (folded into one literal here, costing 0, where cel-go charges 10 plus elements);
``cel.bind`` (a comprehension over nothing in cel-go: we charge init + body + 1); and the sizes
of results (``split``, ``findAll``, ``flatten`` are taken as their input's size). Runtime cost is
counted per comprehension iteration (1 + the calls of its body outside nested comprehensions)
rather than per evaluated call: it cancels the runaway case, which comes only from
comprehensions, without slowing every selector; it can stop later or sooner than cel-go's
actual cost for the same expression.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from dra_driver.scheduling.cel.expr import Expr

_UNBOUNDED: Final = 2**64 - 1  # cel-go's "max uint64": unknown size


@dataclass(frozen=True)
class Shape:
    """A size hint: at most ``size`` characters or entries; ``item``: list elements or map keys;
    ``value``: map values."""

    size: int
    item: Shape | None = None
    value: Shape | None = None


_UNKNOWN: Final = Shape(_UNBOUNDED)
_STRING: Final = Shape(64)  # DeviceAttributeMaxValueLength
_ATTRIBUTE: Final = Shape(64, item=_STRING)  # scalar (string <= 64) or list attribute
_QUANTITY: Final = Shape(1)
_DOMAIN_MAP: Final = Shape(32, item=Shape(32), value=_ATTRIBUTE)
_CAPACITY_MAP: Final = Shape(32, item=Shape(32), value=_QUANTITY)
_DEVICE_FIELDS: Final = {
    "driver": Shape(63),
    "attributes": Shape(32, item=Shape(63), value=_DOMAIN_MAP),
    "capacity": Shape(32, item=Shape(63), value=_CAPACITY_MAP),
    "allowMultipleAllocations": Shape(1),
}
_DEVICE: Final = Shape(4, value=_UNKNOWN)


def _mul(a: int, b: int) -> int:
    return min(a * b, _UNBOUNDED)


def _add(*xs: int) -> int:
    return min(sum(xs), _UNBOUNDED)


def _factor(size: int, per_unit: float) -> int:
    return _UNBOUNDED if size >= _UNBOUNDED else math.ceil(size * per_unit)


_STRING_WALKERS: Final = frozenset(
    {
        "lowerAscii",
        "upperAscii",
        "trim",
        "replace",
        "split",
        "substring",
        "charAt",
        "join",
        "format",
        "strings.quote",
        "quantity",
        "isQuantity",
        "semver",
        "isSemver",
    }
)
_LIST_WALKERS: Final = frozenset(
    {"isSorted", "sum", "min", "max", "slice", "flatten", "distinct", "reverse"}
)
_SIZE_KEEPING: Final = frozenset(
    {"split", "findAll", "flatten", "distinct", "reverse", "sort", "slice", "lowerAscii"}
    | {"upperAscii", "trim", "substring", "replace"}
)
_MACRO_OVERHEAD: Final = 3  # accumulator read + loop condition, per iteration


class _Estimator:
    def __init__(self) -> None:
        self.scope: dict[str, Shape] = {"device": _DEVICE}

    def shape(self, e: Expr) -> Shape:
        k = e.kind
        if k == "lit":
            value = e.fn({})
            if isinstance(value, str | bytes):
                return Shape(len(value))
            if isinstance(value, list):
                items = [self._literal_shape(x) for x in value]
                return Shape(len(value), item=max(items, key=_size, default=None))
            return Shape(1)
        if k == "ident":
            return self.scope.get(e.name, _UNKNOWN)
        if k in ("select", "opt_select") and e.target is not None:
            if e.target.kind == "ident" and e.target.name == "device" and e.name in _DEVICE_FIELDS:
                return _DEVICE_FIELDS[e.name]
            return self.shape(e.target).value or _UNKNOWN
        if k in ("index", "opt_index") and e.target is not None:
            t = self.shape(e.target)
            return (t.value if e.target.type.name == "map" else t.item) or t.value or _UNKNOWN
        if k == "list":
            return Shape(len(e.parts), item=max(map(self.shape, e.parts), key=_size, default=None))
        if k == "map":
            return Shape(len(e.parts) // 2)
        if k == "bind":
            shape: Shape = self._with(
                e.name, self.shape(e.parts[0]), lambda: self.shape(e.parts[1])
            )
            return shape
        if k == "cond":
            return max(self.shape(e.parts[1]), self.shape(e.parts[2]), key=_size)
        if k == "comprehension" and e.target is not None:
            if e.name in ("map", "filter", "transformList", "sortBy"):
                return Shape(self.shape(e.target).size, item=_UNKNOWN)
            return Shape(self.shape(e.target).size) if e.name == "transformMap" else Shape(1)
        if k == "call":
            if e.name in _SIZE_KEEPING and e.target is not None:
                return self.shape(e.target)
            if e.name == "lists.range" and e.parts and e.parts[0].kind == "lit":
                return Shape(max(int(e.parts[0].fn({})), 0), item=Shape(1))
            if e.name in ("value", "orValue") and e.target is not None:
                t = self.shape(e.target)
                others = [self.shape(p) for p in e.parts]
                return max([t, *others], key=_size)
            if e.type.name in ("string", "list", "map", "bytes", "dyn"):
                return _UNKNOWN if e.type.name != "string" else Shape(_UNBOUNDED)
            return Shape(1)
        if k == "arith" and e.type.name in ("string", "list", "bytes"):
            return Shape(_add(*(self.shape(p).size for p in e.parts)))
        return Shape(1)

    @staticmethod
    def _literal_shape(x: Any) -> Shape:
        return Shape(len(x)) if isinstance(x, str | bytes | list | dict) else Shape(1)

    def _with(self, name: str, shape: Shape, body: Any) -> Any:
        with self._bound({name: shape}):
            return body()

    @contextmanager
    def _bound(self, bindings: Mapping[str, Shape]) -> Iterator[None]:
        """``bindings`` in scope (hiding outer variables of the same names) until the end."""
        saved = {n: self.scope.get(n) for n in bindings}
        self.scope.update(bindings)
        try:
            yield
        finally:
            for n, old in saved.items():
                if old is None:
                    self.scope.pop(n, None)
                else:
                    self.scope[n] = old

    def cost(self, e: Expr) -> int:
        k = e.kind
        parts = _add(*(self.cost(p) for p in e.parts)) if k not in ("bind", "comprehension") else 0
        target = self.cost(e.target) if e.target is not None and k != "comprehension" else 0
        if k == "lit":
            return 0
        if k in ("ident", "select", "opt_select", "has", "index", "opt_index"):
            return _add(1, target, parts)
        if k in ("and", "or"):
            return parts
        if k == "cond":
            c, a, b = (self.cost(p) for p in e.parts)
            return _add(c, max(a, b))
        if k == "list":
            return _add(10, parts)
        if k == "map":
            return _add(30, parts)
        if k == "not":
            return _add(1, parts)
        if k == "bind":
            init = self.cost(e.parts[0])
            body = self._with(e.name, self.shape(e.parts[0]), lambda: self.cost(e.parts[1]))
            return _add(1, init, body)
        if k == "compare":
            left, right = (self.shape(p) for p in e.parts)
            if e.name == "in":
                return _add(max(right.size, 1), parts)
            if all(p.type.name in ("string", "bytes") for p in e.parts):
                return _add(max(_factor(min(left.size, right.size), 0.1), 1), parts)
            return _add(1, parts)
        if k == "arith":
            if e.type.name in ("string", "bytes", "list"):
                return _add(max(_factor(self.shape(e).size, 0.1), 1), parts)
            return _add(1, parts)
        if k == "comprehension" and e.target is not None:
            return self._comprehension(e)
        if k == "call":
            return _add(self._call(e), target, parts)
        return _add(1, target, parts)

    def _call(self, e: Expr) -> int:
        name = e.name
        recv = self.shape(e.target) if e.target is not None else None
        args = [self.shape(p) for p in e.parts]
        if name in ("startsWith", "endsWith") and args:
            return max(_factor(args[0].size, 0.1), 1)
        if name == "contains" and recv is not None and args:
            return max(_mul(_factor(recv.size, 0.1), _factor(args[0].size, 0.1)), 1)
        if name in ("matches", "find", "findAll"):
            subject, pattern = (recv, args[0]) if recv is not None else (args[0], args[-1])
            return max(_mul(_factor(subject.size + 1, 0.1), _factor(pattern.size, 0.25)), 1)
        if name == "includes":
            return 48  # ResourceSliceMaxAttributeValuesPerDevice
        if name.startswith("sets.") and len(args) == 2:
            return max(_mul(args[0].size, args[1].size), 1)
        if name in ("indexOf", "lastIndexOf", "size") and recv is not None:
            per_unit = 0.1 if e.target is not None and e.target.type.name == "string" else 1
            return max(_factor(recv.size, per_unit), 1)
        if name in _LIST_WALKERS and recv is not None:
            return max(recv.size, 1)
        if name == "sort" and recv is not None:
            return max(_mul(recv.size, max(recv.size.bit_length(), 1)), 1)
        if name == "lists.range" and args:
            return max(args[0].size, 1)
        if name in _STRING_WALKERS:
            subject = recv if recv is not None else (args[0] if args else Shape(1))
            return max(_factor(subject.size, 0.1), 1)
        return 1

    def _comprehension(self, e: Expr) -> int:
        assert e.target is not None
        rng = self.shape(e.target)
        range_cost = self.cost(e.target)
        names = self._vars(e)
        if e.target.type.name == "map":
            shapes = [rng.item or _UNKNOWN, rng.value or _UNKNOWN]
        else:
            shapes = [Shape(1), rng.item or _UNKNOWN] if len(names) == 2 else [rng.item or _UNKNOWN]
        with self._bound(dict(zip(names, shapes[: len(names)], strict=False))):
            body = _add(*(self.cost(p) for p in e.parts))
        per_item = _add(body, _MACRO_OVERHEAD)
        total = _add(range_cost, _mul(rng.size, per_item))
        if e.name == "sortBy":
            total = _add(total, _mul(rng.size, max(rng.size.bit_length(), 1)))
        return total

    @staticmethod
    def _vars(e: Expr) -> list[str]:
        """The iteration variables the compiler recorded for this comprehension."""
        return list(getattr(e, "iter_vars", ()) or ())


def _size(s: Shape | None) -> int:
    return -1 if s is None else s.size


def estimate_cost(root: Expr) -> int:
    """cel-go's worst-case cost estimate of a compiled selector, as far as we model it (see the
    module docstring); saturates at 2**64 - 1."""
    return _Estimator().cost(root)
