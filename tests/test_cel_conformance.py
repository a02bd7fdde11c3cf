"""The official CEL conformance suite, run against our CEL engine in the DRA selector environment.

Data: ``tests/celspec/testdata/*.textproto``, the simple conformance tests of google/cel-spec
(``tests/simple/testdata``; commit and licence in ``tests/celspec/testdata/SOURCE.md``), read
with our own schema-less reader (``tests/celspec/textproto.py``). Every test of every file is one
pytest case, named ``<file>/<section>/<test>`` (a name used twice in a section gets ``~2``).

The DRA selector environment (``shared/spec/dra-kubelet-plugin.md`` section E) is the CEL
standard library plus ext.Strings version 2, lists, sets, regex, quantity, semver, optional
types, ``cel.bind`` and two-variable comprehensions; the API server always type-checks, with
``cel.HomogeneousAggregateLiterals``. Each case runs as that environment would run it:

* ``value`` (or no matcher, which means ``true``): compile with the declared variables (a bound
  variable the case does not declare is ``dyn``), evaluate with the bindings, and compare with
  CEL semantics, type-exact (``1``, ``1u`` and ``1.0`` differ; NaN equals NaN; maps by entries).
* ``typed_result``: the same, and the compiled expression's static type must be the deduced
  type; a ``check_only`` case only compiles and compares the type.
* ``eval_error`` / ``any_eval_errors``: evaluation must raise ``CelRuntimeError`` (one that is
  not a Python exception caught on its way out). The suite sets ``disable_check`` where cel-go's
  checker refuses the expression, or may: the DRA environment always checks, so for those cases a
  ``CelCompileError`` passes too. The suite does not say which of them cel-go refuses, so here a
  compile error from our engine is not told apart from the runtime error cel-go may give.
* ``DRA_COMPILE_ERRORS``: cases whose expression the API server refuses at compile time although
  the suite expects a value or an evaluation error (the suite runs them unchecked, or checks them
  without homogeneous literals, or they use syntax or functions the DRA environment lacks). For
  them the expected outcome is a ``CelCompileError`` whose message says the same as cel-go's.

Skipped, each with its reason in the skip message (``OUT_OF_SCOPE_FILES`` and ``_skip_reason``).
Whole files (969 cases):

============  =====  ==========================================================================
file          cases  why
============  =====  ==========================================================================
block_ext        37  ``cel.@block`` (the optimizer's common-subexpression blocks)
dynamic         226  protobuf messages, wrappers, Any, JSON Struct/Value
encoders_ext      4  the base64 encoders extension
enums            85  protobuf enums of the test messages
math_ext        199  the math extension (``math.*``)
namespace        14  containers and qualified names of protobuf messages
network_ext      69  cel-go's network extension (Kubernetes has its own ip/cidr library instead)
proto2          118  protobuf messages
proto2_ext       18  protobuf extension fields
proto3           85  protobuf messages
timestamps       78  timestamps and durations
unknowns          0  unknowns / partial evaluation (the file holds no tests)
wrappers         36  protobuf wrapper types
============  =====  ==========================================================================

Single cases in the files that run (158 cases):

==============  =====  ========================================================================
file            cases  why
==============  =====  ========================================================================
bindings_ext        2  name resolution in a container (``com.example``)
comparisons        74  protobuf messages (container or type name: 72), timestamps/durations (2)
conversions         3  timestamps/durations
fields              5  qualified (dotted) variable names: the DRA environment has only ``device``
optionals          11  protobuf messages (container)
parse              26  protobuf messages (container or type name)
string_ext         11  timestamps/durations in ``format`` (8), protobuf messages (3)
type_deduction     26  message-typed variables (14), container (7), own functions (5)
==============  =====  ========================================================================

All cases of basic, fp_math, integer_math, lists, logic, macros, macros2, plumbing and string
run.

Cases that fail today are listed, each with its reason, in
``tests/data/cel_conformance_expected_failures.txt`` and run as ``xfail(strict=True)``: a case
that starts passing fails the run until its line is removed, so the list only shrinks. The list's
header groups the reasons with their counts; ``test_expected_failures_header_counts_are_current``
keeps it true.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling import cel
from tests.celspec.textproto import Identifier, Message, parse_file

DATA_DIR = Path(__file__).parent / "celspec" / "testdata"
EXPECTED_FAILURES = Path(__file__).parent / "data" / "cel_conformance_expected_failures.txt"

OUT_OF_SCOPE_FILES: dict[str, str] = {
    "block_ext": "cel.@block (optimizer common-subexpression blocks) is not in the DRA environment",
    "dynamic": "protobuf messages, wrappers, Any and JSON Struct/Value: device selectors have none",
    "encoders_ext": "the base64 encoders extension is not in the DRA environment",
    "enums": "protobuf enums of the test messages: device selectors have none",
    "math_ext": "the math extension (math.*) is not in the DRA environment",
    "namespace": "containers and qualified names of protobuf messages: device selectors have none",
    "network_ext": "cel-go's network extension is not in the DRA environment (Kubernetes has its "
    "own ip/cidr library, not these functions)",
    "proto2": "protobuf messages: device selectors have none",
    "proto2_ext": "protobuf extension fields: device selectors have none",
    "proto3": "protobuf messages: device selectors have none",
    "timestamps": "timestamps and durations: device selectors have none",
    "unknowns": "unknowns / partial evaluation: the scheduler evaluates with every value known",
    "wrappers": "protobuf wrapper types: device selectors have none",
}

_FOLDED = "program instantiation failed"
_FOLDED_WHY = (
    "a type conversion of a constant is evaluated when the program is built (cel-go's "
    "OptOptimize, which the API server's environment sets): its error refuses the expression"
)
_MIXED = r"expected type '[^']+' but found '[^']+'"
_MIXED_WHY = "mixed-type list or map literal: the DRA environment has HomogeneousAggregateLiterals"
_MIXED_LITERALS = (
    "comparisons/eq_literal/not_eq_list_null",
    "comparisons/eq_literal/eq_list_mixed_type_numbers",
    "comparisons/eq_literal/not_eq_list_mixed_type_numbers",
    "comparisons/eq_literal/not_eq_list_false_vs_types",
    "comparisons/eq_literal/not_eq_map_null",
    "comparisons/eq_literal/eq_map_mixed_type_numbers",
    "comparisons/eq_literal/not_eq_map_false_vs_types",
    "comparisons/eq_literal/eq_map_value_mixed_types",
    "comparisons/eq_literal/not_eq_list_elem_null",
    "comparisons/eq_literal/not_eq_map_value_null",
    "comparisons/in_list_literal/elem_in_mixed_type_list*",
    "comparisons/in_map_literal/key_in_mixed_key_type_map*",
    "conversions/dyn/dyn_heterogeneous_list",
    "fields/map_fields/map_key_int64",
    "fields/map_fields/map_key_uint64",
    "fields/map_fields/map_key_mixed_*",
    "fields/map_fields/map_value_mix_type",
    "fields/qualified_identifier_resolution/map_value_repeat_key_heterogeneous",
    "fields/in/mixed_numbers_and_keys_*",
    "macros/exists/*_type_*",
    "macros/all/*_type_*",
    "macros2/exists/*_type_*",
    "macros2/all/*_type_*",
    "optionals/optionals/map_key_mixed_*",
    "plumbing/check_inputs/skip_check",
    # (not format's list and map literals: cel-go exempts them from the rule)
)
# Case id (fnmatch pattern) -> (what the compile error says, a regular expression; why the API
# server's checked environment refuses the expression although the suite expects a value or an
# evaluation error).
DRA_COMPILE_ERRORS: dict[str, tuple[str, str]] = {
    "conversions/int/uint_range": (_FOLDED, _FOLDED_WHY),
    "conversions/int/double_int_max_range": (_FOLDED, _FOLDED_WHY),
    "conversions/int/double_int_min_range": (_FOLDED, _FOLDED_WHY),
    "conversions/int/double_range": (_FOLDED, _FOLDED_WHY),
    "conversions/string/bytes_invalid": (_FOLDED, _FOLDED_WHY),
    "conversions/uint/int_neg": (_FOLDED, _FOLDED_WHY),
    "conversions/uint/double_uint_max_range": (_FOLDED, _FOLDED_WHY),
    "conversions/uint/double_range_beyond_uint": (_FOLDED, _FOLDED_WHY),
    "conversions/bool/string_true_badcase": (_FOLDED, _FOLDED_WHY),
    "conversions/bool/string_false_badcase": (_FOLDED, _FOLDED_WHY),
    "basic/variables/unbound_is_runtime_error": (
        "undeclared reference to 'x'",
        "an undeclared variable is a compile error in a checked environment",
    ),
    "basic/functions/unbound_is_runtime_error": (
        "undeclared reference to 'f_unknown'",
        "an undeclared function is a compile error in a checked environment",
    ),
    "comparisons/eq_literal/not_eq_list_length": (
        "no matching overload for '_==_'",
        "the checker has no _==_(list(string), list(int))",
    ),
    "comparisons/eq_literal/eq_mixed_types": (
        "no matching overload for '_==_'",
        "the checker has no _==_(double, int): cross-type numeric comparison covers < <= > >=",
    ),
    "comparisons/eq_literal/eq_list_elem_mixed_types": (
        "no matching overload for '_==_'",
        "the checker has no _==_(list(int), list(double))",
    ),
    "comparisons/ne_literal/ne_mixed_types": (
        "no matching overload for '_!=_'",
        "the checker has no _!=_(uint, int): cross-type numeric comparison covers < <= > >=",
    ),
    "logic/conditional/mixed_type": (
        r"no matching overload for '_\?_:_'",
        "the checker's _?_:_ needs both branches of one type",
    ),
    "logic/AND/short_circuit_type_*": (
        "no matching overload for '_&&_'",
        "the checker's _&&_ takes bools only",
    ),
    "logic/OR/short_circuit_type_*": (
        r"no matching overload for '_\|\|_'",
        "the checker's _||_ takes bools only",
    ),
    "parse/receiver_function_names/*": (
        "undeclared reference to 'a'",
        "the suite leaves 'a' undeclared (it tests parsing): a compile error when checked",
    ),
    "fields/quoted_map_fields/*": (
        "`",
        "backtick-quoted field names need cel-go's EnableIdentEscapeSyntax, which Kubernetes "
        "does not set",
    ),
    "string_ext/reverse/*": (
        "reverse",
        "string reverse() is ext.Strings version 3; Kubernetes enables version 2",
    ),
    **{pattern: (_MIXED, _MIXED_WHY) for pattern in _MIXED_LITERALS},
}

_MESSAGE_NAMES = re.compile(
    r"\b(?:google\.protobuf\.|cel\.expr\.conformance\.|TestAllTypes\b|NestedTestAllTypes\b"
    r"|TestRequired\b|GlobalEnum\b|NestedEnum\b)"
)
_TIME_FUNCTIONS = re.compile(r"\b(?:timestamp|duration)\s*\(")

_PRIMITIVES = {
    "BOOL": cel.BOOL,
    "INT64": cel.INT,
    "UINT64": cel.UINT,
    "DOUBLE": cel.DOUBLE,
    "STRING": cel.STRING,
    "BYTES": cel.BYTES,
}


class OutOfScope(Exception):
    """The case needs something device selectors never see; the message says what."""


# ---------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    id: str
    file: str
    test: Message

    @property
    def expr(self) -> str:
        return self.test.string("expr")


def _load_cases() -> Iterator[Case]:
    seen: Counter[str] = Counter()
    for path in sorted(DATA_DIR.glob("*.textproto")):
        for section in parse_file(path).messages("section"):
            for test in section.messages("test"):
                base = f"{path.stem}/{section.string('name')}/{test.string('name')}"
                seen[base] += 1
                case_id = base if seen[base] == 1 else f"{base}~{seen[base]}"
                yield Case(case_id, path.stem, test)


CASES: list[Case] = list(_load_cases())


def _skip_reason(case: Case) -> str | None:
    """Why the case is outside the DRA environment, or None when it is run."""
    if case.file in OUT_OF_SCOPE_FILES:
        return f"{case.file}.textproto: {OUT_OF_SCOPE_FILES[case.file]}"
    test = case.test
    container = test.string("container")
    if container.startswith("cel.expr.conformance."):
        return "uses the test protos' container (message types): device selectors have none"
    if container:
        return f"resolves names in container {container!r}: the DRA environment has none"
    if _MESSAGE_NAMES.search(case.expr):
        return "names a protobuf message type: device selectors have none"
    if _TIME_FUNCTIONS.search(case.expr):
        return "uses timestamps or durations: device selectors have none"
    if test.boolean("disable_macros"):
        return "runs without macros: the DRA environment always has them"
    for decl in test.messages("type_env"):
        if decl.message("function") is not None:
            return "declares its own function: the DRA environment's functions are fixed"
        if "." in decl.string("name"):
            return "declares a qualified (dotted) variable: the DRA environment has only `device`"
        try:
            _declared_type(decl)
        except OutOfScope as exc:
            return str(exc)
    for matcher in ("unknown", "any_unknowns"):
        if matcher in test:
            return "expects unknowns (partial evaluation): the scheduler has every value"
    try:
        _bindings(case)
        expected = _expected_value(test)
        if expected is not None:
            _check_in_scope(expected)
    except OutOfScope as exc:
        return str(exc)
    return None


def _dra_compile_error(case: Case) -> tuple[str, str] | None:
    for pattern, expected in DRA_COMPILE_ERRORS.items():
        if fnmatch.fnmatchcase(case.id, pattern):
            return expected
    return None


def _read_expected_failures() -> dict[str, str]:
    """The list file: ``<case id> # <reason>`` per line; ``#`` lines are comments."""
    out: dict[str, str] = {}
    for number, line in enumerate(EXPECTED_FAILURES.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        case_id, sep, reason = line.partition(" # ")
        if not sep or not reason.strip():
            raise ValueError(f"{EXPECTED_FAILURES.name}:{number}: no ' # reason' on {line!r}")
        if case_id.strip() in out:
            raise ValueError(f"{EXPECTED_FAILURES.name}:{number}: {case_id!r} listed twice")
        out[case_id.strip()] = reason.strip()
    return out


EXPECTED: dict[str, str] = _read_expected_failures()


def _params() -> list[Any]:
    params = []
    for case in CASES:
        marks: list[pytest.MarkDecorator] = []
        reason = _skip_reason(case)
        if reason is not None:
            marks.append(pytest.mark.skip(reason=reason))
        elif case.id in EXPECTED:
            marks.append(pytest.mark.xfail(strict=True, reason=EXPECTED[case.id]))
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


# ---------------------------------------------------------------------------------------------
# Types and values of the suite (cel.expr.Type, cel.expr.Value) as our engine has them


def _static_type(t: Message, *, where: str) -> cel.T:
    """A ``cel.expr.Type`` (a declaration's or a deduced type) as the engine's static type."""
    names = t.names()
    if not names:
        raise OutOfScope(f"{where} without a type")
    kind = names[0]
    if kind == "primitive":
        return _PRIMITIVES[t.enum("primitive")]
    if kind == "dyn":
        return cel.DYN
    if kind == "null":
        return cel.NULL
    if kind == "list_type":
        elem = (t.message("list_type") or Message()).message("elem_type") or Message()
        return cel.list_of(_static_type(elem, where=where))
    if kind == "map_type":
        m = t.message("map_type") or Message()
        return cel.map_of(
            _static_type(m.message("key_type") or Message(), where=where),
            _static_type(m.message("value_type") or Message(), where=where),
        )
    if kind == "type":
        inner = t.message("type") or Message()
        return cel.TYPE if not inner.names() else cel.T("type", (_static_type(inner, where=where),))
    if kind == "abstract_type":
        a = t.message("abstract_type") or Message()
        params = tuple(_static_type(p, where=where) for p in a.messages("parameter_types"))
        return cel.T(a.string("name"), params)
    if kind in ("message_type", "well_known", "wrapper"):
        raise OutOfScope(f"a {where} of protobuf type ({kind}): device selectors have none")
    raise OutOfScope(f"a {where} of type {kind}, which device selectors do not have")


def _declared_type(decl: Message) -> cel.T:
    ident = decl.message("ident") or Message()
    return _static_type(ident.message("type") or Message(), where="declaration")


def _value_kind(v: Message) -> str:
    names = v.names()
    if len(names) != 1:
        raise ValueError(f"a cel.expr.Value with fields {names}")
    return names[0]


def _check_in_scope(v: Message) -> None:
    kind = _value_kind(v)
    if kind == "object_value":
        raise OutOfScope("expects or binds a protobuf message value: device selectors have none")
    if kind == "enum_value":
        raise OutOfScope("expects or binds a protobuf enum value: device selectors have none")
    if kind == "list_value":
        for x in (v.message("list_value") or Message()).messages("values"):
            _check_in_scope(x)
    if kind == "map_value":
        for entry in (v.message("map_value") or Message()).messages("entries"):
            _check_in_scope(entry.message("key") or Message())
            _check_in_scope(entry.message("value") or Message())


def _to_cel(v: Message) -> Any:
    """A ``cel.expr.Value`` as the engine's value (for bindings)."""
    _check_in_scope(v)
    kind = _value_kind(v)
    if kind == "null_value":
        return None
    if kind == "bool_value":
        return v.boolean(kind)
    if kind == "int64_value":
        return v.integer(kind)
    if kind == "uint64_value":
        return cel.UInt(v.integer(kind))
    if kind == "double_value":
        return v.double(kind)
    if kind == "string_value":
        return v.string(kind)
    if kind == "bytes_value":
        return v.bytes_value(kind)
    if kind == "type_value":
        return cel.CelType(v.string(kind))
    if kind == "list_value":
        return [_to_cel(x) for x in (v.message(kind) or Message()).messages("values")]
    if kind == "map_value":
        entries = (v.message(kind) or Message()).messages("entries")
        return {
            _to_cel(e.message("key") or Message()): _to_cel(e.message("value") or Message())
            for e in entries
        }
    raise ValueError(f"unknown cel.expr.Value kind {kind}")


def _bindings(case: Case) -> dict[str, Any]:
    out = {}
    for b in case.test.messages("bindings"):
        expr_value = b.message("value") or Message()
        value = expr_value.message("value")
        if value is None:
            raise OutOfScope("binds an error or unknown value: the scheduler binds only values")
        out[b.string("key")] = _to_cel(value)
    return out


def _declarations(case: Case) -> dict[str, cel.T]:
    decls = {d.string("name"): _declared_type(d) for d in case.test.messages("type_env")}
    for name in _bindings(case):  # the suite binds some variables it does not declare
        decls.setdefault(name, cel.DYN)
    return decls


def _expected_value(test: Message) -> Message | None:
    """The expected value (``true`` when the case names no matcher), or None when there is none
    (an error, or a type only)."""
    if "value" in test:
        return test.message("value")
    typed = test.message("typed_result")
    if typed is not None:
        return typed.message("result")
    if any(m in test for m in ("eval_error", "any_eval_errors", "unknown", "any_unknowns")):
        return None
    return Message((("bool_value", Identifier("true")),))


def _same(expected: Message, actual: Any) -> bool:
    """CEL equality with the type exact: ``1``, ``1u`` and ``1.0`` differ; NaN is NaN."""
    kind = _value_kind(expected)
    if kind == "null_value":
        return actual is None
    if kind == "bool_value":
        return type(actual) is bool and actual is expected.boolean(kind)
    if kind == "int64_value":
        return type(actual) is int and actual == expected.integer(kind)
    if kind == "uint64_value":
        return type(actual) is cel.UInt and int(actual) == expected.integer(kind)
    if kind == "double_value":
        want = expected.double(kind)
        if type(actual) is not float:
            return False
        return (math.isnan(want) and math.isnan(actual)) or actual == want
    if kind == "string_value":
        return type(actual) is str and actual == expected.string(kind)
    if kind == "bytes_value":
        return type(actual) is bytes and actual == expected.bytes_value(kind)
    if kind == "type_value":
        return isinstance(actual, cel.CelType) and actual.name == expected.string(kind)
    if kind == "list_value":
        items = (expected.message(kind) or Message()).messages("values")
        return (
            isinstance(actual, list)
            and len(actual) == len(items)
            and all(_same(e, a) for e, a in zip(items, actual, strict=True))
        )
    if kind == "map_value":
        entries = (expected.message(kind) or Message()).messages("entries")
        if not isinstance(actual, dict) or len(actual) != len(entries):
            return False
        for e in entries:
            key, value = e.message("key") or Message(), e.message("value") or Message()
            found = [k for k in actual if _same(key, k)]
            if len(found) != 1 or not _same(value, actual[found[0]]):
                return False
        return True
    raise ValueError(f"cannot compare with a {kind}")


def _show(expected: Message) -> str:
    try:
        return cel.show_value(_to_cel(expected))
    except (OutOfScope, ValueError):
        return str(expected)


def _describe(actual: Any) -> str:
    return f"{cel.show_value(actual)} ({type(actual).__name__})"


# ---------------------------------------------------------------------------------------------
# The run


@pytest.mark.parametrize("case", _params())
def test_case_behaves_as_the_suite_expects(case: Case) -> None:
    test = case.test
    decls = _declarations(case)
    compile_error = _dra_compile_error(case)
    if compile_error is not None:
        message, why = compile_error
        with pytest.raises(CelCompileError, match=message):
            program = cel.compile_expression(case.expr, decls)
            pytest.fail(f"compiled to a {program.root.type}; the API server refuses it: {why}")
        return
    expects_error = any(m in test for m in ("eval_error", "any_eval_errors"))
    try:
        program = cel.compile_expression(case.expr, decls)
    except CelCompileError:
        if expects_error and test.boolean("disable_check"):
            return  # the suite's checker rejects (or may reject) it too; the DRA env checks
        raise
    typed = test.message("typed_result")
    if typed is not None and typed.message("deduced_type") is not None:
        want = _static_type(typed.message("deduced_type") or Message(), where="deduced type")
        assert program.root.type == want, f"static type {program.root.type}, want {want}"
    if test.boolean("check_only"):
        return
    bindings = _bindings(case)
    if expects_error:
        with pytest.raises(CelRuntimeError) as raised:
            result = program.evaluate(bindings)
            pytest.fail(f"evaluated to {_describe(result)}, want an evaluation error")
        # Program.evaluate turns a Python exception that escapes the engine into a
        # CelRuntimeError "from" it: that is a crash, not the CEL error the case wants.
        assert raised.value.__cause__ is None, f"the engine crashed: {raised.value.__cause__!r}"
        return
    expected = _expected_value(test)
    assert expected is not None
    result = program.evaluate(bindings)
    assert _same(expected, result), f"got {_describe(result)}, want {_show(expected)}"


# ---------------------------------------------------------------------------------------------
# The lists themselves


def test_expected_failures_name_existing_run_cases() -> None:
    by_id = {c.id: c for c in CASES}
    unknown = sorted(i for i in EXPECTED if i not in by_id)
    assert not unknown, f"listed but not in the suite: {unknown}"
    skipped = sorted(i for i in EXPECTED if _skip_reason(by_id[i]) is not None)
    assert not skipped, f"listed but skipped (remove them): {skipped}"


_HEADER_LINE = re.compile(r"^#\s+(\d+)\s+(.+?)\s*$")


def test_expected_failures_header_counts_are_current() -> None:
    """The header's ``#  <count>  <reason>`` lines are exactly the reasons below, counted."""
    header: dict[str, int] = {}
    in_summary = False
    for line in EXPECTED_FAILURES.read_text(encoding="utf-8").splitlines():
        if line.startswith("# Reasons"):
            in_summary = True
            continue
        if in_summary:
            m = _HEADER_LINE.match(line)
            if m is None:
                break
            header[m[2]] = int(m[1])
    assert header == dict(Counter(EXPECTED.values())), f"regroup {EXPECTED_FAILURES.name}'s header"


def test_dra_compile_error_patterns_match_cases() -> None:
    for pattern in DRA_COMPILE_ERRORS:
        assert any(fnmatch.fnmatchcase(c.id, pattern) for c in CASES), pattern


def test_every_in_scope_file_runs_cases() -> None:
    files = {c.file for c in CASES}
    run = {c.file for c in CASES if _skip_reason(c) is None}
    assert run == files - set(OUT_OF_SCOPE_FILES)
