"""Regular expressions (``matches``, ``find``, ``findAll``) with RE2, as the API server has them."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import re2

from dra_driver.scheduling.cel.runtime import _err, _no_overload


@lru_cache(maxsize=256)
def _regex(pattern: str) -> re2._Regexp:
    """``pattern`` compiled with RE2, the engine (and so the syntax and semantics) of the API
    server's CEL: no look-arounds or back-references, ``$`` only at the very end, ``\\d`` ASCII
    only, POSIX classes and ``\\pL``; matching time linear in the input."""
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _err(f"invalid regular expression {pattern!r}: {reason}") from exc


_RE2_OPTIONS = re2.Options()


_RE2_OPTIONS.log_errors = False  # the error is the caller's to report, not a log line on stderr


_REGEX_FUNCS = frozenset({"matches", "find", "findAll"})


def _matches(s: Any, p: Any) -> bool:
    if type(s) is str and type(p) is str:
        return _regex(p).search(s) is not None
    raise _no_overload("matches", s, p)


def _find(s: Any, p: Any) -> str:
    if type(s) is not str or type(p) is not str:
        raise _no_overload("find", s, p)
    m = _regex(p).search(s)
    return m.group(0) if m else ""


def _find_all(s: Any, p: Any, n: Any = -1) -> list[str]:
    """Go's ``Regexp.FindAllString``: an empty match right where the previous match ended is
    not a match of its own (``'123a45'.findAll('[0-9]*')`` is ``['123', '45']``)."""
    if type(s) is not str or type(p) is not str or type(n) is not int:
        raise _no_overload("findAll", s, p)
    regex = _regex(p)
    found: list[str] = []
    pos, previous_end = 0, -1
    while pos <= len(s) and (n < 0 or len(found) < n):
        m = regex.search(s, pos)
        if m is None:
            break
        start, end = m.span()
        if end > start:
            found.append(m.group(0))
            pos = end
        else:
            if start != previous_end:
                found.append("")
            pos = end + 1
        previous_end = end
    return found
