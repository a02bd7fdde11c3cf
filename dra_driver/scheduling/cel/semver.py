"""The Kubernetes semver library."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dra_driver.scheduling.cel.runtime import _err, _no_overload
from dra_driver.scheduling.cel.values import Semver


def _semver(s: Any, normalize: Any = False) -> Semver:
    if type(s) is not str or type(normalize) is not bool:
        raise _no_overload("semver", s)
    try:
        return Semver.parse(s, normalize=normalize)
    except ValueError as exc:
        raise _err(f"semver: {exc}") from None


def _is_semver(s: Any, normalize: Any = False) -> bool:
    if type(s) is not str or type(normalize) is not bool:
        raise _no_overload("isSemver", s)
    try:
        Semver.parse(s, normalize=normalize)
    except ValueError:
        return False
    return True


def _semver_part(fn: str) -> Callable[[Any], int]:
    def f(v: Any) -> int:
        if type(v) is not Semver:
            raise _no_overload(fn, v)
        return int(getattr(v, fn))

    return f
