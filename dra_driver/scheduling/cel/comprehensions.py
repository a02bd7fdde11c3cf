"""Comprehensions at run time: the closures the macros compile to (``all``, ``exists``,
``exists_one``, ``map``, ``filter``, ``sortBy``, ``transformList``, ``transformMap``), and the
runtime cost that cancels a runaway evaluation (spec E.2: one cost counter per evaluation, shared
by its comprehensions through the activation, limit ``environment.COST_LIMIT``)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from dra_driver.errors import CelRuntimeError
from dra_driver.scheduling.cel.expr import Activation, Expr, Fn
from dra_driver.scheduling.cel.lists import _ordering
from dra_driver.scheduling.cel.runtime import _err, _no_overload, _truth
from dra_driver.scheduling.cel.types import BOOL, LIST_DYN, MAP_DYN, T, list_of
from dra_driver.scheduling.cel.values import _COST, _tname
from dra_driver.scheduling.environment import COST_LIMIT


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
    limit = COST_LIMIT

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
