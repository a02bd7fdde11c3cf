"""Macros and other calls that bind variables, compiled: ``has()``, ``cel.bind``,
``optMap``/``optFlatMap`` and the comprehension macros (their run time is in
``comprehensions``)."""

from __future__ import annotations

from typing import Any

import lark

from dra_driver.scheduling.cel.comprehensions import _comprehension, _flat_cost
from dra_driver.scheduling.cel.context import CompileContext
from dra_driver.scheduling.cel.expr import Activation, Expr
from dra_driver.scheduling.cel.parse import _PASS_THROUGH
from dra_driver.scheduling.cel.runtime import _err, _no_overload
from dra_driver.scheduling.cel.types import _DEVICE_FIELDS, BOOL, DEVICE, DYN, INT, opt_of
from dra_driver.scheduling.cel.values import NONE, OptionalValue, _tname


class Macros(CompileContext):
    """Compiles ``has()``, ``cel.bind``, ``optMap``/``optFlatMap`` and the comprehensions."""

    def has(self, tree: lark.Tree[Any], arg_trees: list[lark.Tree[Any]]) -> Expr:
        node = arg_trees[0] if len(arg_trees) == 1 else None
        while node is not None and node.data in _PASS_THROUGH and len(node.children) == 1:
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
