"""Why a selector is false: walk the compiled tree and describe the failing comparisons."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from dra_driver.errors import CelRuntimeError
from dra_driver.scheduling.cel.expr import Activation, Expr
from dra_driver.scheduling.cel.lists import _ordering
from dra_driver.scheduling.cel.quantity import _compare_to
from dra_driver.scheduling.cel.values import Semver, _show

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
