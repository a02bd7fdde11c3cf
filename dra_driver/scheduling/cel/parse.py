"""The parser: cel-python's Lark grammar plus optional access and optional entries."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

import lark

# Grammar rules that only wrap their single child (a precedence level with no operator used).
_PASS_THROUGH = frozenset(
    ("expr", "conditionalor", "conditionaland", "relation", "addition", "multiplication", "unary",
     "member")
)  # fmt: skip


def _grammar() -> str:
    text = resources.files("celpy").joinpath("cel.lark").read_text(encoding="utf-8")
    old = "member         : member_dot | member_dot_arg | member_index | member_object | primary"
    if old not in text:  # pragma: no cover - guards an unexpected cel-python upgrade
        raise RuntimeError("cel-python grammar changed; cannot add optional access syntax")
    new = (
        "member         : member_dot | member_dot_arg | member_index | member_object"
        " | member_dot_opt | member_index_opt | primary\n"
        'member_dot_opt : member "." "?" IDENT\n'
        'member_index_opt : member "[" "?" expr "]"'
    )
    text = text.replace(old, new)
    # Optional entries of list and map literals: [?x, y], {?k: v, k2: v2}.
    lists = 'list_lit       : "[" [exprlist] "]"'
    maps = 'map_lit        : "{" [mapinits] "}"'
    if lists not in text or maps not in text:  # pragma: no cover
        raise RuntimeError("cel-python grammar changed; cannot add optional entries")
    text = text.replace(
        lists,
        'list_lit       : "[" [listelems] "]"\n'
        'listelems      : listelem ("," listelem)*\n'
        "listelem       : opt_entry | expr\n"
        'opt_entry      : "?" expr',
    )
    return text.replace(
        maps,
        'map_lit        : "{" [mapentries] "}"\n'
        'mapentries     : mapentry ("," mapentry)*\n'
        'mapentry       : opt_entry ":" expr | expr ":" expr',
    )


def _bool_literal(t: lark.Token) -> lark.Token:
    if t.value in ("true", "false"):
        return lark.Token("BOOL_LIT", t.value)
    return t


@lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(
        _grammar(),
        parser="lalr",
        start="expr",
        g_regex_flags=re.M,
        lexer_callbacks={"IDENT": _bool_literal},
        propagate_positions=True,
        maybe_placeholders=False,
        priority="invert",
    )
