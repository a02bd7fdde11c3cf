"""A compiled expression node (``Expr``): its closure, its static type, and where it came from
in the source, which ``why`` reads to explain a false selector and ``cost`` to estimate the
selector's cost."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.types import T

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
