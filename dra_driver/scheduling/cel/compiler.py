"""Type-checking compilation of a parsed expression into Python closures."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import lark
from lark.exceptions import UnexpectedInput

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling import environment as env
from dra_driver.scheduling.cel.functions import _GLOBAL_FUNCS, _METHODS
from dra_driver.scheduling.cel.lists import _ordering
from dra_driver.scheduling.cel.regex import _REGEX_FUNCS, _regex
from dra_driver.scheduling.cel.runtime import (
    _ABSENT,
    _arith,
    _check_int,
    _cmp,
    _eq,
    _err,
    _in,
    _index,
    _map_key,
    _missing,
    _no_overload,
    _opt_index,
    _opt_select,
    _select,
    _truth,
)
from dra_driver.scheduling.cel.types import (
    _DEVICE_FIELDS,
    _NAMESPACED,
    _NUMS,
    _ORDERED,
    _TYPE_IDENTS,
    BOOL,
    BYTES,
    DEVICE,
    DOUBLE,
    DYN,
    INT,
    LIST_DYN,
    MAP_DYN,
    NULL,
    STRING,
    TYPE,
    UINT,
    T,
    _fits,
    _result_type,
    list_of,
    map_of,
    opt_of,
)
from dra_driver.scheduling.cel.values import (
    _COST,
    _INT_MAX,
    _INT_MIN,
    _UINT_MAX,
    NONE,
    DeviceObject,
    DomainIndex,
    DomainMap,
    OptionalValue,
    UInt,
    _show,
    _tname,
)

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


# Grammar rules that only wrap their single child (a precedence level with no operator used).
_PASS_THROUGH = frozenset(
    ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary",
     "member")
)  # fmt: skip


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
        if (data in _PASS_THROUGH or data == "primary") and len(ch) == 1:
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
            if right.kind == "lit" and type(rf({})) is int:
                # x.compareTo(q) >= 0 and the like: an int against an int literal, without
                # the generic comparison (other types still go through it)
                bound: int = rf({})
                fast = {"<": int.__lt__, "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__}[sym]

                def order_int(v: Activation) -> bool:
                    a = lf(v)
                    if type(a) is int:
                        return fast(a, bound)
                    return test(_cmp(fname, a, bound))

                return Expr("compare", order_int, BOOL, meta, name=sym, parts=(left, right))

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
        if t.name == "map" and _fits(t.params[0], key.type):
            etype = t.params[1]
        elif t.name == "list" and key.type.name in ("int", "uint", "dyn"):
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
