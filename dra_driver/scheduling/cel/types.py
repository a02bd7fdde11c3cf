"""Static types: enough of cel-go's checker to reject what the API server rejects."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from dra_driver.scheduling.cel.values import CelType


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
    if name.startswith("sets.") and not _same_element_type(args):
        return None  # ext.Sets declares list(T), list(T): one element type for both lists
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


def _same_element_type(args: list[T]) -> bool:
    """Whether two list types can share one element type (dyn fits any)."""
    a, b = (t.params[0] if t.name == "list" and t.params else DYN for t in args)
    return _fits(a, b) or _fits(b, a)
