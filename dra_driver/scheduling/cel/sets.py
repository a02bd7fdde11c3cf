"""The ext.Sets library: ``sets.contains``, ``sets.equivalent``, ``sets.intersects``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.runtime import _no_overload


def _sets(fn: str, impl: Callable[[list[Any], list[Any]], bool]) -> Callable[[Any, Any], bool]:
    def f(a: Any, b: Any) -> bool:
        if not isinstance(a, list) or not isinstance(b, list):
            raise _no_overload(fn, a, b)
        return impl(a, b)

    return f
