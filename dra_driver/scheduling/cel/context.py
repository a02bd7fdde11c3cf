"""What every part of the compiler shares: the source (compile errors point into it, with line
and column, as the API server reports them), the variables in scope and the functions the target
environment withholds. ``compiler``, ``macros`` and ``literals`` each add the syntax they compile
to ``CompileContext``; ``compiler._Compiler`` puts them together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lark
from lark.exceptions import UnexpectedInput

from dra_driver.errors import CelCompileError
from dra_driver.scheduling.cel.expr import Expr
from dra_driver.scheduling.cel.types import T


class CompileContext:
    """The state of one compilation, and compile errors that point into its source."""

    def __init__(
        self, source: str, variables: Mapping[str, T], withheld: frozenset[str] = frozenset()
    ) -> None:
        self.source = source
        self.scope: dict[str, T] = dict(variables)
        self.withheld = withheld  # functions the target environment lacks (environment.py)
        # How many ``format`` calls enclose the part being compiled: list and map literals at
        # any depth inside one are exempt from the homogeneous-literal rule (cel-go's
        # HomogeneousAggregateLiteralExemptFunctions, which ext.Strings' format validator sets).
        self.format_depth = 0

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

    def fail_expr(self, e: Expr, message: str) -> CelCompileError:
        return _compile_error(self.source, message, e.line or 1, e.column or 1)

    def visit(self, tree: lark.Tree[Any]) -> Expr:
        """Compile ``tree`` (``compiler._Compiler`` dispatches on its rule)."""
        raise NotImplementedError


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
