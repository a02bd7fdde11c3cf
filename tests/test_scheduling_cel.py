"""The DRA CEL environment: device variable, libraries, errors, limits (spec section E)."""

from __future__ import annotations

import re

import pytest

from dra_driver.errors import CelCompileError, CelRuntimeError
from dra_driver.scheduling.cel import (
    DOUBLE,
    MAX_EXPRESSION_BYTES,
    CelQuantity,
    Semver,
    compile_expression,
    compile_selector,
    device_variable,
)

DRIVER = "gpu.nvidia.com"


def a100() -> dict[str, object]:
    return device_variable(
        driver=DRIVER,
        attributes={
            "type": "gpu",
            "productName": "NVIDIA A100-SXM4-40GB",
            "architecture": "Ampere",
            "cudaComputeCapability": Semver.parse("8.0.0"),
            "driverVersion": Semver.parse("550.54.15"),
            "resource.kubernetes.io/pcieRoot": "pci0000:00",
        },
        capacity={"memory": CelQuantity.parse("40Gi")},
    )


def run(expression: str) -> bool:
    return compile_selector(expression).matches(a100())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (
            "device.driver == 'gpu.nvidia.com' && "
            "device.attributes['gpu.nvidia.com'].type == 'gpu'",
            True,
        ),
        ("device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')", False),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0", True),
        ("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('40Gi'))", False),
        ("device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('80Gi'))", True),
        ("device.attributes['gpu.nvidia.com'].driverVersion.major() >= 550", True),
        ("device.attributes['gpu.nvidia.com'].driverVersion.minor() == 54", True),
        (
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('7.5.0'))",
            True,
        ),
        (
            "device.attributes['gpu.nvidia.com'].cudaComputeCapability"
            ".compareTo(semver('9.0.0')) == -1",
            True,
        ),
        ("device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:00'", True),
        ("has(device.attributes['resource.kubernetes.io'].pciBusID)", False),
        ("device.allowMultipleAllocations == false", True),
    ],
)
def test_typical_selectors_evaluate_as_the_scheduler_does(expression: str, expected: bool) -> None:
    assert run(expression) is expected


def test_an_unqualified_attribute_belongs_to_the_drivers_domain() -> None:
    assert run("device.attributes['gpu.nvidia.com'].architecture == 'Ampere'")
    assert run("'architecture' in device.attributes['gpu.nvidia.com']")


def test_an_unknown_domain_reads_as_an_empty_map() -> None:
    assert run("size(device.attributes['other.example.com']) == 0")
    assert run("!has(device.attributes['other.example.com'].family)")


def test_an_unknown_attribute_is_a_runtime_error_not_false() -> None:
    with pytest.raises(CelRuntimeError, match=r"attribute gpu\.nvidia\.com/profile missing"):
        run("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'")


def test_and_or_absorb_an_error_only_when_the_other_side_decides() -> None:
    assert run("device.attributes['gpu.nvidia.com'].profile == 'x' || true")
    assert not run("device.attributes['gpu.nvidia.com'].profile == 'x' && false")
    assert not run("false && device.attributes['gpu.nvidia.com'].profile == 'x'")
    with pytest.raises(CelRuntimeError):
        run("device.attributes['gpu.nvidia.com'].profile == 'x' && true")
    with pytest.raises(CelRuntimeError):
        run("false || device.attributes['gpu.nvidia.com'].profile == 'x'")


def test_a_type_mismatch_is_a_runtime_error() -> None:
    with pytest.raises(CelRuntimeError, match="no such overload"):
        run("device.attributes['gpu.nvidia.com'].productName > 5")
    # Heterogeneous equality: different types are simply not equal.
    assert not run("device.attributes['gpu.nvidia.com'].productName == 5")


def test_quantities_compare_by_value() -> None:
    assert run("quantity('1Gi') == quantity('1024Mi')")
    assert run("quantity('1Gi') != quantity('1G')")
    assert run("quantity('1.5').isInteger() == false && quantity('3k').asInteger() == 3000")
    assert run("quantity('500m').asApproximateFloat() == 0.5 && quantity('-1').sign() == -1")
    assert run("quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi')")
    assert run(
        "quantity('1Gi').sub(1073741824).sign() == 0 && quantity('1').add(2) == quantity('3')"
    )
    assert run("isQuantity('40Gi') && !isQuantity('40 GiB')")
    with pytest.raises(CelRuntimeError, match="quantity"):
        run("quantity('40 GiB').sign() == 1")


def test_semver_library_parses_and_orders_versions() -> None:
    assert run("semver('1.2.3').major() == 1 && semver('1.2.3').patch() == 3")
    assert run("semver('1.0.0-rc.1').isLessThan(semver('1.0.0'))")
    assert run("isSemver('1.2.3') && !isSemver('v1.2') && isSemver('v1.2', true)")
    assert run("semver('v1.2', true) == semver('1.2.0')")
    with pytest.raises(CelRuntimeError, match="semver"):
        run("semver('1.2').major() == 1")


def test_string_extensions_work() -> None:
    assert run("'a,b,c'.split(',') == ['a', 'b', 'c'] && ['a', 'b'].join('-') == 'a-b'")
    assert run("'NVIDIA'.lowerAscii() == 'nvidia' && 'x'.upperAscii() == 'X'")
    assert run("' x '.trim() == 'x' && 'hello'.substring(1, 3) == 'el' && 'abc'.charAt(1) == 'b'")
    assert run("'hello'.indexOf('l') == 2 && 'hello'.lastIndexOf('l') == 3")
    assert run("'a.b'.replace('.', '-') == 'a-b' && strings.quote('a') == '\"a\"'")
    assert run("'H100 SXM'.matches('^H1[0-9]+') && 'abc'.find('b.') == 'bc'")


@pytest.mark.parametrize(
    "expression",
    [
        # RE2 as the API server runs it, not Python's re
        r"!'abc\n'.matches('abc$')",  # $ is the end of the text, not before a final newline
        r"!'\u0661'.matches('^\\d$')",  # \d is ASCII only (U+0661 is an Arabic-Indic one)
        r"'a'.matches('^[[:alpha:]]$') && !'1'.matches('[[:alpha:]]')",  # POSIX classes
        r"'\u00e9'.matches('^\\pL$') && 'ab'.matches('b\\z')",  # Unicode classes, \z
        # Go's FindAllString: no empty match right where the previous match ended
        "'123a45'.findAll('[0-9]*') == ['123', '45'] && 'a12b'.findAll('[0-9]*') == ['', '12', '']",
        "'a1b2c3'.findAll('[0-9]', 2) == ['1', '2'] && 'x\u00e912'.find('[0-9]+') == '12'",
        # linear time: a pattern that backtracks exponentially in Python's re answers at once
        "!'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!'.matches('^(a+)+$')",
    ],
)
def test_regular_expressions_are_re2(expression: str) -> None:
    assert run(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("device.driver.matches('(?=gpu)')", "invalid perl operator: (?="),
        ("device.driver.find(r'(a)\\1') == ''", "invalid escape sequence: \\1"),
        ("matches(device.driver, '(?<=a)b')", "invalid perl operator: (?<"),
    ],
)
def test_a_constant_pattern_re2_refuses_is_a_compile_error(expression: str, message: str) -> None:
    with pytest.raises(CelCompileError, match="invalid regular expression") as info:
        compile_selector(expression)
    assert message in str(info.value)


def test_optional_access_and_or_value() -> None:
    assert run("device.attributes['gpu.nvidia.com'].?addressingMode.orValue('none') == 'none'")
    assert run("device.attributes['gpu.nvidia.com'].?type.orValue('') == 'gpu'")
    assert run("!device.attributes['gpu.nvidia.com'].?profile.hasValue()")
    assert run("device.attributes[?'other.com'].?x.orValue(1) == 1")
    assert run("optional.of(1).value() == 1 && optional.none().orValue(2) == 2")
    with pytest.raises(CelRuntimeError, match=r"optional\.none"):
        run("optional.none().value() == 1")


def test_cel_bind_and_macros() -> None:
    assert run(
        "cel.bind(g, device.attributes['gpu.nvidia.com'], "
        "g.type == 'gpu' && g.architecture == 'Ampere')"
    )
    assert run("[1, 2, 3].all(x, x > 0) && [1, 2].exists(x, x == 2) && [1, 2].exists_one(x, x > 1)")
    assert run("[1, 2, 3].map(x, x * 2) == [2, 4, 6] && [1, 2, 3].filter(x, x % 2 == 1) == [1, 3]")
    assert run("{'a': 1}.all(k, v, v == 1) && [3, 1, 2].sort() == [1, 2, 3] && [1, 2].sum() == 3")


def test_macros_are_commutative_for_errors() -> None:
    assert not run("[0, 1].all(x, 1 / x > 5)")  # 1/0 fails, 1/1 > 5 is false: false wins
    assert run("[0, 1].exists(x, 1 / x == 1)")


def test_integer_arithmetic_checks_overflow_and_division_by_zero() -> None:
    with pytest.raises(CelRuntimeError, match="overflow"):
        run("9223372036854775807 + 1 > 0")
    with pytest.raises(CelRuntimeError, match="division by zero"):
        run("1 / 0 == 1")
    assert run("-7 / 2 == -3 && -7 % 2 == -1")


@pytest.mark.parametrize(
    ("expression", "message", "column"),
    [
        ("device.foo == 1", "undefined field 'foo'", 7),
        ("device.driver == 1", "no matching overload for '_==_' applied to '(string, int)'", 15),
        ("device.driver.startsWith(1)", "no matching overload for 'startsWith'", 14),
        ("nope(1)", "undeclared reference to 'nope'", 1),
        ("device.driver == 'x' &&", "unexpected end of expression", 24),
        ("device.capacity['a'].b > quantity('1')", "no matching overload for '_>_'", 24),
        ("device.driver", "must evaluate to bool", 1),
        ("device.driver == 'a' $ 1", "syntax error", 22),
        # Logic over two literals: the parser gives the tree no position of its own (this was a
        # Python TypeError out of compile_selector, a crash on user input).
        ("false && 32", "no matching overload for '_&&_' applied to '(bool, int)'", 1),
        ("true || 32", "no matching overload for '_||_' applied to '(bool, int)'", 1),
        ("32 ? true : false", "no matching overload for '_?_:_' applied to '(int, ...)'", 1),
    ],
)
def test_compile_errors_carry_the_position(expression: str, message: str, column: int) -> None:
    with pytest.raises(CelCompileError) as info:
        compile_selector(expression)
    text = str(info.value)
    assert message in text
    assert f"line 1, column {column}:" in text
    assert text.splitlines()[-1].index("^") == len(" | ") + column - 1


def test_an_expression_over_10_kib_is_rejected() -> None:
    filler = " || ".join(["device.driver == 'x'"] * 600)
    assert len(filler) > MAX_EXPRESSION_BYTES
    with pytest.raises(CelCompileError, match="more than the limit of 10240"):
        compile_selector(filler)
    just_below = "device.driver == '" + "x" * (MAX_EXPRESSION_BYTES - 30) + "'"
    assert compile_selector(just_below).matches(a100()) is False  # type: ignore[arg-type]


def test_compiled_programs_are_cached() -> None:
    expr = "device.driver == 'gpu.nvidia.com'"
    assert compile_selector(expr) is compile_selector(expr)


def test_why_false_names_the_selector_values() -> None:
    dev = a100()
    why = compile_selector(
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"
    ).why_false(dev)  # type: ignore[arg-type]
    assert why == ["memory 40Gi is less than 80Gi"]
    why = compile_selector(
        "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100')"
    ).why_false(dev)  # type: ignore[arg-type]
    assert why == ["productName 'NVIDIA A100-SXM4-40GB' does not start with 'NVIDIA H100'"]
    why = compile_selector("device.attributes['gpu.nvidia.com'].profile == 'x'").why_false(dev)  # type: ignore[arg-type]
    assert why[0].startswith("attribute gpu.nvidia.com/profile missing")
    why = compile_selector(
        "cel.bind(g, device.attributes['gpu.nvidia.com'], "
        "g.type == 'gpu' && g.architecture == 'Hopper')"
    ).why_false(dev)  # type: ignore[arg-type]
    assert why == ["architecture is 'Ampere', not 'Hopper'"]
    assert compile_selector("device.driver == 'gpu.nvidia.com'").why_false(dev) == []  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # an int against a double as cel-go compares them: the int becomes a double
        ("dyn(9223372036854775807) < 9223372036854775808.0", False),
        ("dyn(9223372036854775807) == 9223372036854775808.0", True),
        ("dyn(9223372036854775807) < 9223372036854777857.0", True),
        ("dyn(9223372036854775807) < -9223372036854777857.0", False),
        ("dyn(18446744073709551615u) < 18446744073709551616.0", False),
        ("dyn(2u) > 1.5 && dyn(1) == 1.0 && dyn(-1) < 0.5", True),
    ],
)
def test_mixed_numeric_comparisons_follow_cel_go(expression: str, expected: bool) -> None:
    assert compile_expression(expression, {}).evaluate({}) is expected


@pytest.mark.parametrize("value", ["-9223372036854775808.0", "9223372036854775807.0", "1e99"])
def test_a_double_at_or_past_the_int_range_is_a_range_error(value: str) -> None:
    with pytest.raises(CelRuntimeError, match="out of int range"):
        compile_expression("int(x)", {"x": DOUBLE}).evaluate({"x": float(value)})
    # a constant is converted when the program is built (cel-go's OptOptimize, which the API
    # server's environment sets): the error refuses the expression
    with pytest.raises(CelCompileError, match=r"program instantiation failed: .*out of int range"):
        compile_expression(f"int({value})", {})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("has({}.?x.y)", False),
        ("has({'x': {'y': 'z'}}.?x.y)", True),
        ("has({'foo': optional.none()}.foo.bar)", False),
        (
            "has(optional.of({'c': {'e': 1}}).c) && !has(optional.of({'c': {'e': 1}}).c.missing)",
            True,
        ),
        ("type(optional.none()) == optional_type", True),
        ("optional.of(42).optMap(y, y + 1).value() == 43", True),
        ("optional.none().optMap(y, y + 1).hasValue()", False),
        ("{'key': {'sub': 'v'}}.?key.optFlatMap(k, k.?sub).value() == 'v'", True),
        ("{'key': {}}.?key.optFlatMap(k, k.?sub).hasValue()", False),
        ("[?{}.?c, ?optional.of(42), ?optional.none()] == [42]", True),
        ("{?'a': optional.none(), 'b': 1, ?'c': optional.of(2)} == {'b': 1, 'c': 2}", True),
        ("has({?'foo': optional.none()}.foo)", False),
    ],
)
def test_optional_types_as_cel_go_has_them(expression: str, expected: bool) -> None:
    assert compile_expression(expression, {}).evaluate({}) is expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("[?1]", "expected type 'optional_type' but found 'int'"),
        ("{?'a': 1}", "expected type 'optional_type' but found 'int'"),
        ("optional.of(1).optFlatMap(x, x + 1)", "optFlatMap() expression must be an optional"),
        ("(1).optMap(x, x)", "no matching overload for 'optMap'"),
    ],
)
def test_optional_misuse_is_a_compile_error(expression: str, message: str) -> None:
    with pytest.raises(CelCompileError, match=re.escape(message)):
        compile_expression(expression, {})


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # the API server's literals are homogeneous: mixed arguments go through dyn()
        (
            "'%s is %d GiB, %.1f%% used'.format([dyn('gpu-0'), dyn(80), dyn(12.25)])",
            "gpu-0 is 80 GiB, 12.2% used",
        ),
        ("'%x %X %o %b'.format([dyn(255), dyn(255u), dyn(8), dyn(true)])", "ff FF 10 1"),
        ("'%x'.format(['Hi'])", "4869"),
        ("'%e'.format([1052.032911275])", "1.052033e+03"),
        ("'%.0f %.0f'.format([1.5, 2.5])", "2 2"),  # halfway to the nearest even, as Go rounds
        ("'%s'.format([[dyn(1), dyn('a'), dyn(null), dyn([2.5])]])", "[1, a, null, [2.5]]"),
        ("'%s'.format([{'b': dyn(1), 'a': dyn(true)}])", "{a: true, b: 1}"),
        ("'%d %f'.format([double('NaN'), double('-Infinity')])", "NaN -Infinity"),
    ],
)
def test_string_format_as_cel_go_formats(expression: str, expected: str) -> None:
    assert compile_expression(expression, {}).evaluate({}) == expected


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("'%a'.format(dyn([1]))", 'unrecognized formatting clause "a"'),
        ("'%d %d'.format([1])", "index 1 out of range"),
        ("'%d'.format([0.5])", "decimal clause can only be used on integers, was given double"),
        ("'%b'.format([dyn('x')])", "only integers and bools can be formatted as binary"),
    ],
)
def test_string_format_errors_name_the_clause(expression: str, message: str) -> None:
    with pytest.raises(CelRuntimeError, match=re.escape(message)):
        compile_expression(expression, {}).evaluate({})


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("'%a'.format([1])", 'unrecognized formatting clause "a"'),
        ("'%b'.format(['x'])", "only integers and bools can be formatted as binary"),
        ("'%s'.format([1, 2])", "too many arguments supplied to string.format (expected 1, got 2)"),
        (
            "'%s'.format([device.attributes['d'].x])",
            "string clause can only be used on strings, bools, bytes, ints, doubles, maps, lists, "
            "types, durations, and timestamps, was given google.protobuf.Any",
        ),
    ],
)
def test_a_constant_format_over_a_list_literal_is_checked_when_compiled(
    expression: str, message: str
) -> None:
    """As cel-go's format validator checks it (found by the oracle tier, test_oracle_cel)."""
    with pytest.raises(CelCompileError, match=re.escape(message)):
        compile_selector(f"{expression} == ''")


@pytest.mark.parametrize(
    ("expression", "message", "column"),
    [
        ("[1, 'a']", "expected type 'int' but found 'string'", 5),
        ("[1, 2.0]", "expected type 'int' but found 'double'", 5),
        ("[[1], ['a']]", "expected type 'list(int)' but found 'list(string)'", 7),
        ("{'a': 1, 2: 1}", "expected type 'string' but found 'int'", 10),
    ],
)
def test_aggregate_literals_are_homogeneous_as_in_the_api_server(
    expression: str, message: str, column: int
) -> None:
    with pytest.raises(CelCompileError) as info:
        compile_expression(expression, {})
    assert message in str(info.value) and f"column {column}:" in str(info.value)
    assert compile_expression("[1, dyn('a'), dyn([]), dyn(2.0)].size() == 4", {}).evaluate({})


@pytest.mark.parametrize(
    ("left", "right", "expected"),
    [("40Gi", "40960Mi", 0), ("1.5", "1500m", 0), ("-1m", "0", -1), ("1Ki", "1k", 1),
     ("0.1", "100m", 0), ("-2Gi", "-3Gi", 1)],
)  # fmt: skip
def test_quantity_compare_to_orders_by_exact_value(left: str, right: str, expected: int) -> None:
    expression = f"quantity('{left}').compareTo(quantity('{right}'))"
    assert compile_expression(expression, {}).evaluate({}) == expected
    assert compile_expression(expression.replace("compareTo", "isGreaterThan"), {}).evaluate(
        {}
    ) is (expected > 0)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1.0 == 1", "no matching overload for '_==_' applied to '(double, int)'"),
        ("2u != 2", "no matching overload for '_!=_' applied to '(uint, int)'"),
        ("true ? 'cows' : 17", "no matching overload for '_?_:_' applied to '(bool, string, int)'"),
        ("'abc'.reverse() == 'cba'", "no matching overload for 'reverse'"),  # ext.Strings v3
    ],
)
def test_the_checker_refuses_what_the_api_server_refuses(expression: str, message: str) -> None:
    with pytest.raises(CelCompileError, match=re.escape(message)):
        compile_expression(expression, {})


def test_cross_type_numbers_compare_through_dyn_and_nan_is_never_equal() -> None:
    for expression, expected in (
        ("dyn(1.0) == 1 && 1 < 1.5 && dyn(2u) == 2", True),
        ("dyn(1) == 0.0/0.0 || dyn(1u) == 0.0/0.0", False),
        ("dyn(1) != 0.0/0.0", True),
        ("'\\X41\\x42' == 'AB' && b'\\X41' == b'A'", True),
    ):
        assert compile_expression(expression, {}).evaluate({}) is expected


def test_an_ordering_against_an_int_literal_still_compares_other_types_generically() -> None:
    for expression, expected in (
        ("dyn(1.5) > 1 && dyn(0.5) < 1 && dyn(2u) >= 2", True),
        ("quantity('1').compareTo(quantity('2')) >= 0", False),
        ("quantity('2').compareTo(quantity('2')) <= 0 && 3 > 2", True),
    ):
        assert compile_expression(expression, {}).evaluate({}) is expected
    with pytest.raises(CelRuntimeError, match="no such overload"):
        compile_expression("dyn('a') < 1", {}).evaluate({})
