"""Type-checking compilation of a parsed expression into Python closures: the dispatch over
the grammar's rules, operators, member access and calls. Macros (``macros``) and literals
(``literals``) are compiled by the parts ``_Compiler`` inherits; errors point into the source
(``context``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lark

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling.cel.expr import Activation, Expr, Fn, _const
from dra_driver.scheduling.cel.functions import _GLOBAL_FUNCS, _METHODS
from dra_driver.scheduling.cel.literals import Literals
from dra_driver.scheduling.cel.macros import Macros
from dra_driver.scheduling.cel.parse import _PASS_THROUGH
from dra_driver.scheduling.cel.regex import _REGEX_FUNCS, _regex
from dra_driver.scheduling.cel.runtime import (
    _arith,
    _check_int,
    _cmp,
    _in,
    _index,
    _missing,
    _no_overload,
    _opt_index,
    _opt_select,
    _select,
    _truth,
)
from dra_driver.scheduling.cel.strings import format_problem
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
    STRING,
    TYPE,
    UINT,
    T,
    _fits,
    _result_type,
    opt_of,
)
from dra_driver.scheduling.cel.values import DeviceObject, DomainIndex, DomainMap, _eq


class _Compiler(Macros, Literals):
    """Compiles one expression (``program.compile_expression`` makes one per expression)."""

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
        allowed: tuple[T, ...] = (INT, UINT, DOUBLE)
        if sym == "+":
            allowed = (*allowed, STRING, BYTES)
            if lt.name == "list" and rt.name == "list":
                return lt if _fits(lt, rt) else LIST_DYN
        if sym == "%":
            allowed = (INT, UINT)
        if lt.name == "dyn" or rt.name == "dyn":
            # dyn matches any overload, but the other side must have one: cel-go refuses
            # ``attribute + true`` (no '_+_' takes a bool), as it refuses ``1 + true``
            known = rt if lt.name == "dyn" else lt
            if known.name == "dyn" or known in allowed or (sym == "+" and known.name == "list"):
                return known
        elif lt == rt and lt in allowed:
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
        exempt = name == "format"
        self.format_depth += exempt
        try:
            recv = self.visit(recv_tree)
            args = [self.visit(a) for a in arg_trees]
        finally:
            self.format_depth -= exempt
        if name not in _METHODS:
            raise self.fail_at(at, f"undeclared reference to '{name}' (in container '')")
        result = _result_type(name, recv.type, [a.type for a in args])
        if result is None:
            shown = ", ".join(str(a.type) for a in args)
            raise self.fail_at(
                at, f"found no matching overload for '{name}' applied to '{recv.type}.({shown})'"
            )
        if name == "format" and recv.kind == "lit" and len(args) == 1:
            self._check_format(recv, args[0], at)
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

    def _check_format(self, recv: Expr, arg: Expr, at: int) -> None:
        """cel-go's compile-time check of a constant format string over a list literal."""
        fmt = recv.fn({})
        if type(fmt) is not str or arg.kind not in ("list", "lit") or arg.type.name != "list":
            return
        problem = format_problem(fmt, [_format_arg(e) for e in arg.parts])
        if problem is not None:
            raise self.fail_at(at, problem)

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
        if name in _CONVERSIONS and len(args) == 1 and _is_constant(args[0]):
            # cel-go converts a constant when it builds the program (decOptimize): a failure
            # refuses the expression there, as the API server reports it.
            try:
                fn({})
            except CelRuntimeError as exc:
                raise self.fail(tree.meta, f"program instantiation failed: {exc}") from exc
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


def _format_arg(e: Expr) -> tuple[str, tuple[Any, ...]]:
    """An element of format's list literal as ``strings.format_problem`` reads it: the kind of
    its static type (``"any"`` for a device attribute's value) and a nested literal's elements."""
    if _is_attribute_value(e):
        return "any", ()
    nested = tuple(_format_arg(p) for p in e.parts) if e.kind in ("list", "lit") else ()
    return e.type.name, nested


def _is_attribute_value(e: Expr) -> bool:
    """``device.attributes[domain].name`` (or ``[name]``): an attribute's value."""
    domain = e.target if e.kind in ("select", "index") else None
    attributes = (
        domain.target if domain is not None and domain.kind in ("select", "index") else None
    )
    return (
        attributes is not None
        and attributes.kind == "select"
        and attributes.name == "attributes"
        and attributes.target is not None
        and attributes.target.type == DEVICE
    )


# cel-go's type conversion functions (overloads.IsTypeConversionFunction) that this engine has.
_CONVERSIONS = frozenset({"bool", "bytes", "double", "dyn", "int", "string", "type", "uint"})


def _is_constant(e: Expr) -> bool:
    """A literal, a negated one (``-1``, which cel-go's parser makes a literal), or a conversion
    of a constant (which cel-go has folded to one: ``int(dyn('x'))``)."""
    if e.kind == "lit":
        return True
    if e.kind == "call" and e.name in _CONVERSIONS and len(e.parts) == 1:
        return _is_constant(e.parts[0])
    return e.kind == "arith" and e.name == "-" and len(e.parts) == 1 and e.parts[0].kind == "lit"
