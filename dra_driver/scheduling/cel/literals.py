"""Literals, compiled: scalars (with CEL's escapes and integer ranges), and list and map
literals (optional entries, homogeneous element types as the API server's environment has
them)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import lark

from dra_driver.scheduling.cel.context import CompileContext
from dra_driver.scheduling.cel.expr import Activation, Expr, _const
from dra_driver.scheduling.cel.runtime import _ABSENT, _err, _map_key, _no_overload
from dra_driver.scheduling.cel.types import (
    BOOL,
    BYTES,
    DOUBLE,
    DYN,
    INT,
    NULL,
    STRING,
    UINT,
    T,
    _fits,
    list_of,
    map_of,
)
from dra_driver.scheduling.cel.values import (
    _INT_MAX,
    _INT_MIN,
    _UINT_MAX,
    OptionalValue,
    UInt,
    _show,
    _tname,
)


class Literals(CompileContext):
    """Compiles scalar, list and map literals."""

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
            return Expr("lit", lambda _v: list(value), typ, tree.meta, parts=tuple(items))
        return Expr("list", lambda v: [f(v) for f in fns], typ, tree.meta, parts=tuple(items))

    def _common_type(self, typed: Sequence[tuple[Expr, T]]) -> T:
        """The element (or key, or value) type of an aggregate literal. The API server's CEL
        environment has homogeneous aggregate literals: ``[1, 'a']`` is a compile error there
        (``[1, dyn('a')]`` is not), so it is one here, except inside a ``format`` call, whose
        literals cel-go exempts (``'%s %d'.format(['a', 1])``): their mixed type is dyn."""
        common: T | None = None
        for e, t in typed:
            if t.name == "dyn":
                continue
            if common is None or (common.name == "null_type" and t.name == "optional_type"):
                common = t
            elif t.name == "null_type" and common.name == "optional_type":
                continue  # null is assignable to an optional type
            elif not _fits(common, t):
                if self.format_depth:
                    return DYN
                raise self.fail_expr(e, f"expected type '{common}' but found '{t}'")
        return common or DYN

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


def _decode_string(text: str, comp: CompileContext, meta: Any) -> str:
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


def _decode_bytes(text: str, comp: CompileContext, meta: Any) -> bytes:
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
