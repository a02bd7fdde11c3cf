"""A schema-less reader of protobuf text format, enough for the CEL conformance files.

The conformance data (``testdata/*.textproto``) is written in protobuf text format. Reading it with
``google.protobuf.text_format`` would need the generated code of cel-spec's ``.proto`` files; this
reader needs no schema: it returns every message as its ordered fields, and the caller, which knows
the schema, converts scalars when it reads them (``Message.string``, ``Message.double``, ...).

Covered (the subset of https://protobuf.dev/reference/protobuf/textformat-spec/ the files use):
``#`` comments; ``name: value`` and ``name { ... }`` / ``name: < ... >`` fields, separated by
nothing, ``,`` or ``;``; repeated fields, also in list form ``name: [a, b]``; extension and
``Any`` expansion names in brackets (``[type.googleapis.com/pkg.Type] { ... }``); strings in
single or double quotes, adjacent ones concatenated, with the C escapes, octal (``\\303``), hex
(``\\xe2``) and Unicode (``\\u00ff``, ``\\U0001f431``, surrogate pairs) escapes; decimal, octal and
hex integers; floats (``1.5``, ``.5``, ``1e3``, ``2.5f``, ``inf``, ``-Infinity``, ``nan``); enum
constants and ``true``/``false`` as identifiers.

A string is kept as bytes (text format strings are byte strings: ``bytes_value: "\\377"`` is
not UTF-8); ``Message.string`` decodes a ``string`` field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Identifier", "Message", "TextprotoError", "parse", "parse_file"]


class TextprotoError(ValueError):
    """The text is not protobuf text format (or not the subset read here): says where."""


class Identifier(str):
    """An unquoted word in value position: an enum constant, ``true``/``false``, ``inf``."""

    __slots__ = ()


Scalar = int | float | bytes | Identifier

_FLOAT_WORDS = {"inf": math.inf, "infinity": math.inf, "nan": math.nan}
_TRUE = frozenset({"true", "True", "t"})
_FALSE = frozenset({"false", "False", "f"})


@dataclass(frozen=True)
class Message:
    """One message: its fields in the order written; a repeated field appears once per value."""

    fields: tuple[tuple[str, Value], ...] = ()

    def __contains__(self, name: object) -> bool:
        return any(n == name for n, _ in self.fields)

    def names(self) -> list[str]:
        """The field names, in order, each once."""
        return list(dict.fromkeys(n for n, _ in self.fields))

    def values(self, name: str) -> list[Value]:
        """Every value of field ``name`` (a repeated field has several, a missing one none)."""
        return [v for n, v in self.fields if n == name]

    def value(self, name: str) -> Value | None:
        """The value of singular field ``name`` (the last one, as protobuf merges), or None."""
        found = self.values(name)
        return found[-1] if found else None

    def message(self, name: str) -> Message | None:
        """Singular message field ``name``, or None when it is not set."""
        v = self.value(name)
        if v is None or isinstance(v, Message):
            return v
        raise TextprotoError(f"field {name!r} is a scalar ({v!r}), not a message")

    def messages(self, name: str) -> list[Message]:
        """Repeated message field ``name``."""
        out = []
        for v in self.values(name):
            if not isinstance(v, Message):
                raise TextprotoError(f"field {name!r} holds a scalar ({v!r}), not a message")
            out.append(v)
        return out

    def bytes_value(self, name: str, default: bytes = b"") -> bytes:
        """A ``bytes`` field."""
        v = self.value(name)
        if v is None:
            return default
        if not isinstance(v, bytes):
            raise TextprotoError(f"field {name!r} is not a string literal: {v!r}")
        return v

    def string(self, name: str, default: str = "") -> str:
        """A ``string`` field: its bytes decoded as UTF-8 (invalid UTF-8 is an error)."""
        v = self.value(name)
        if v is None:
            return default
        try:
            return self.bytes_value(name).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TextprotoError(f"field {name!r} is not valid UTF-8: {exc}") from None

    def integer(self, name: str, default: int = 0) -> int:
        """An integer field (any width or signedness; the caller checks the range)."""
        v = self.value(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise TextprotoError(f"field {name!r} is not an integer: {v!r}")
        return v

    def double(self, name: str, default: float = 0.0) -> float:
        """A ``double``/``float`` field: a number, or ``inf``/``infinity``/``nan``."""
        v = self.value(name)
        if v is None:
            return default
        return to_double(v, name)

    def boolean(self, name: str, default: bool = False) -> bool:
        """A ``bool`` field: ``true``/``false`` (also ``True``, ``t``, ``1``, ...)."""
        v = self.value(name)
        if v is None:
            return default
        if isinstance(v, Identifier) and v in _TRUE:
            return True
        if isinstance(v, Identifier) and v in _FALSE:
            return False
        if type(v) is int and v in (0, 1):
            return bool(v)
        raise TextprotoError(f"field {name!r} is not a bool: {v!r}")

    def enum(self, name: str, default: str = "") -> str:
        """An enum field written by name."""
        v = self.value(name)
        if v is None:
            return default
        if not isinstance(v, Identifier):
            raise TextprotoError(f"field {name!r} is not an enum constant: {v!r}")
        return str(v)

    def any_expansion(self) -> tuple[str, Message] | None:
        """For an expanded ``google.protobuf.Any`` (``[type.googleapis.com/T] {...}``): the type
        URL and the message; None when this message is not written that way."""
        for name, v in self.fields:
            if name.startswith("[") and "/" in name and isinstance(v, Message):
                return name[1:-1], v
        return None


Value = Scalar | Message


def to_double(v: Value, name: str = "value") -> float:
    """A scalar read as a double: an integer or float literal, or an inf/nan word."""
    if isinstance(v, Identifier):
        word = v.lower()
        sign = -1.0 if word.startswith("-") else 1.0
        if word.lstrip("-") in _FLOAT_WORDS:
            return math.copysign(_FLOAT_WORDS[word.lstrip("-")], sign)
        raise TextprotoError(f"field {name!r} is not a number: {v!r}")
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TextprotoError(f"field {name!r} is not a number: {v!r}")
    return float(v)


# ---------------------------------------------------------------------------------------------
# Tokens

_TOKEN = re.compile(
    r"""
    (?P<space>[ \t\r\n\f\v]+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>0[xX][0-9a-fA-F]+
      |(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?[fF]?)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>[{}<>\[\]:,;\-/.])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    line: int
    column: int


def _tokens(text: str) -> Iterator[_Token]:
    pos, line, line_start = 0, 1, 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TextprotoError(
                f"line {line}, column {pos - line_start + 1}: unexpected character {text[pos]!r}"
            )
        kind = m.lastgroup or ""
        if kind != "space":
            yield _Token(kind, m.group(), line, pos - line_start + 1)
        newlines = m.group().count("\n")
        if newlines:
            line += newlines
            line_start = m.start() + m.group().rfind("\n") + 1
        pos = m.end()


_SIMPLE_ESCAPES = {
    "a": b"\a",
    "b": b"\b",
    "f": b"\f",
    "n": b"\n",
    "r": b"\r",
    "t": b"\t",
    "v": b"\v",
    "\\": b"\\",
    "'": b"'",
    '"': b'"',
    "?": b"?",
}
_ESCAPE = re.compile(
    r"\\(?:(?P<oct>[0-7]{1,3})|x(?P<hex>[0-9a-fA-F]{1,2})|u(?P<u4>[0-9a-fA-F]{4})"
    r"|U(?P<u8>[0-9a-fA-F]{8})|(?P<simple>.))",
    re.DOTALL,
)


def unescape(body: str) -> bytes:
    """The bytes a quoted string's body (without its quotes) stands for."""
    out = bytearray()
    pos = 0
    pending_high: int | None = None  # a \\u high surrogate waiting for its low half
    for m in _ESCAPE.finditer(body):
        if m.start() > pos:
            if pending_high is not None:
                raise TextprotoError(f"lone surrogate \\u{pending_high:04x} in string")
            out += body[pos : m.start()].encode("utf-8")
        pos = m.end()
        code: int | None = None
        if m["oct"] is not None:
            out.append(int(m["oct"], 8) & 0xFF)
        elif m["hex"] is not None:
            out.append(int(m["hex"], 16))
        elif m["u4"] is not None:
            code = int(m["u4"], 16)
        elif m["u8"] is not None:
            code = int(m["u8"], 16)
        else:
            simple = _SIMPLE_ESCAPES.get(m["simple"])
            if simple is None:
                raise TextprotoError(f"invalid escape \\{m['simple']} in string")
            out += simple
        if pending_high is not None and (code is None or not 0xDC00 <= code <= 0xDFFF):
            raise TextprotoError(f"lone surrogate \\u{pending_high:04x} in string")
        if code is None:
            continue
        if 0xD800 <= code <= 0xDBFF and m["u4"] is not None:
            pending_high = code
            continue
        if pending_high is not None:
            code = 0x10000 + ((pending_high - 0xD800) << 10) + (code - 0xDC00)
            pending_high = None
        elif 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            raise TextprotoError(f"invalid Unicode escape U+{code:04X} in string")
        out += chr(code).encode("utf-8")
    if pending_high is not None:
        raise TextprotoError(f"lone surrogate \\u{pending_high:04x} in string")
    out += body[pos:].encode("utf-8")
    return bytes(out)


def _number(text: str) -> int | float:
    if text[:2] in ("0x", "0X"):
        return int(text, 16)
    if text.isdigit():
        if len(text) > 1 and text[0] == "0":
            try:
                return int(text, 8)
            except ValueError:
                raise TextprotoError(f"invalid octal integer {text!r}") from None
        return int(text)
    return float(text.rstrip("fF"))


# ---------------------------------------------------------------------------------------------
# Parser


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = list(_tokens(text))
        self.pos = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def next(self) -> _Token:
        tok = self.peek()
        if tok is None:
            raise TextprotoError("unexpected end of text")
        self.pos += 1
        return tok

    def fail(self, tok: _Token | None, message: str) -> TextprotoError:
        where = f"line {tok.line}, column {tok.column}" if tok else "end of text"
        return TextprotoError(f"{where}: {message}")

    def expect(self, text: str) -> _Token:
        tok = self.peek()
        if tok is None or tok.text != text:
            got = repr(tok.text) if tok else "end of text"
            raise self.fail(tok, f"expected {text!r}, got {got}")
        return self.next()

    def accept(self, text: str) -> bool:
        tok = self.peek()
        if tok is not None and tok.kind == "punct" and tok.text == text:
            self.pos += 1
            return True
        return False

    def message(self, close: str | None) -> Message:
        fields: list[tuple[str, Value]] = []
        while True:
            tok = self.peek()
            if tok is None:
                if close is not None:
                    raise self.fail(tok, f"expected {close!r}")
                return Message(tuple(fields))
            if close is not None and tok.text == close:
                self.pos += 1
                return Message(tuple(fields))
            name = self.field_name()
            if self.accept(":"):
                values = self.values()
            else:
                nxt = self.peek()
                if nxt is None or nxt.text not in ("{", "<", "["):
                    raise self.fail(nxt, f"expected ':' or a message after field {name!r}")
                values = self.values()
            fields.extend((name, v) for v in values)
            if not self.accept(","):
                self.accept(";")

    def field_name(self) -> str:
        tok = self.next()
        if tok.kind == "ident":
            return tok.text
        if tok.text == "[":
            parts = []
            while (part := self.next()).text != "]":
                if part.kind != "ident" and part.text not in (".", "/"):
                    raise self.fail(part, f"unexpected {part.text!r} in an extension name")
                parts.append(part.text)
            return "[" + "".join(parts) + "]"
        raise self.fail(tok, f"expected a field name, got {tok.text!r}")

    def values(self) -> list[Value]:
        """One value, or the values of a ``[a, b]`` list."""
        tok = self.peek()
        if tok is not None and tok.text == "[":
            self.pos += 1
            out: list[Value] = []
            if self.accept("]"):
                return out
            while True:
                out.append(self.single())
                if self.accept("]"):
                    return out
                self.expect(",")
        return [self.single()]

    def single(self) -> Value:
        tok = self.next()
        if tok.text == "{":
            return self.message("}")
        if tok.text == "<":
            return self.message(">")
        if tok.kind == "string":
            data = unescape(tok.text[1:-1])
            while (nxt := self.peek()) is not None and nxt.kind == "string":
                self.pos += 1
                data += unescape(nxt.text[1:-1])
            return data
        negative = tok.text == "-"
        if negative:
            tok = self.next()
        if tok.kind == "number":
            n = _number(tok.text)
            return -n if negative else n
        if tok.kind == "ident":
            if negative:
                if tok.text.lower() not in _FLOAT_WORDS:
                    raise self.fail(tok, f"'-' before {tok.text!r}, which is not inf or nan")
                return Identifier("-" + tok.text)
            return Identifier(tok.text)
        raise self.fail(tok, f"expected a value, got {tok.text!r}")


def parse(text: str) -> Message:
    """Parse a whole text-format message; raise TextprotoError naming the line and column."""
    return _Parser(text).message(None)


def parse_file(path: Path) -> Message:
    """Parse a ``.textproto`` file (UTF-8)."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except TextprotoError as exc:
        raise TextprotoError(f"{path.name}: {exc}") from None
