"""tests/celspec/textproto.py: the schema-less protobuf text-format reader of the CEL suite."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.celspec.textproto import Identifier, Message, TextprotoError, parse, parse_file, unescape

DATA_DIR = Path(__file__).parent / "celspec" / "testdata"


def test_fields_keep_their_order_and_repeated_fields_their_values() -> None:
    m = parse('name: "basic" section { name: "a" } section { name: "b" }')
    assert m.names() == ["name", "section"]
    assert m.string("name") == "basic"
    assert [s.string("name") for s in m.messages("section")] == ["a", "b"]


def test_colon_is_optional_before_a_message_and_angle_brackets_delimit_one() -> None:
    m = parse("a: { x: 1 } b { x: 2 } c: < x: 3 > d < x: 4 >")
    assert [(m.message(n) or Message()).integer("x") for n in "abcd"] == [1, 2, 3, 4]


def test_fields_may_be_separated_by_commas_or_semicolons() -> None:
    m = parse("value: { int64_value: 1, }; other: 2; last: 3,")
    assert (m.message("value") or Message()).integer("int64_value") == 1
    assert m.integer("other") == 2
    assert m.integer("last") == 3


def test_comments_run_to_the_end_of_the_line_but_not_inside_strings() -> None:
    m = parse('# header\nexpr: "a # b" # trailing\n# done')
    assert m.string("expr") == "a # b"


def test_list_syntax_expands_to_repeated_values() -> None:
    m = parse("n: [1, 2, 3] m: [{ x: 1 }, { x: 2 }] e: []")
    assert m.values("n") == [1, 2, 3]
    assert [x.integer("x") for x in m.messages("m")] == [1, 2]
    assert m.values("e") == []
    assert "e" not in m


def test_adjacent_strings_are_concatenated_across_lines_and_quote_styles() -> None:
    m = parse('expr: "a" \'b\'\n  "c"')
    assert m.string("expr") == "abc"


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        (r'"\a\b\f\n\r\t\v\\\'\"\?"', b"\a\b\f\n\r\t\v\\'\"?"),
        (r'"\303\277"', b"\xc3\xbf"),  # octal: bytes, here the UTF-8 of U+00FF
        (r'"\0\12\101"', b"\x00\n\x41"),  # octal of one to three digits
        (r'"\x00\xff\xF"', b"\x00\xff\x0f"),  # hex of one or two digits
        (r'"\u00ff"', "\u00ff".encode()),
        (r'"\U0001f431"', "\U0001f431".encode()),
        (r'"\ud83d\ude00"', "\U0001f600".encode()),  # a surrogate pair is one code point
        ('"ÿ☺"', "ÿ☺".encode()),  # raw non-ASCII text is its UTF-8
        (r"'it''s'", b"its"),  # two adjacent strings
    ],
)
def test_string_escapes(literal: str, expected: bytes) -> None:
    assert parse(f"s: {literal}").bytes_value("s") == expected


def test_a_bytes_field_need_not_be_utf8_but_a_string_field_must_be() -> None:
    m = parse(r's: "\377"')
    assert m.bytes_value("s") == b"\xff"
    with pytest.raises(TextprotoError, match="UTF-8"):
        m.string("s")


@pytest.mark.parametrize("body", [r"\q", r"\ud800", r"\ud800x", r"\udc00", r"\U00110000"])
def test_invalid_escapes_are_errors(body: str) -> None:
    with pytest.raises(TextprotoError):
        unescape(body)


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        ("0", 0),
        ("42", 42),
        ("-42", -42),
        ("0x1F", 31),
        ("-0x10", -16),
        ("017", 15),  # a leading zero is octal
        ("18446744073709551615", 2**64 - 1),
        ("-9223372036854775808", -(2**63)),
    ],
)
def test_integers(literal: str, expected: int) -> None:
    assert parse(f"n: {literal}").integer("n") == expected


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        ("1.5", 1.5),
        ("-0.5", -0.5),
        (".25", 0.25),
        ("1.", 1.0),
        ("1e3", 1000.0),
        ("2.5E-1", 0.25),
        ("2.5f", 2.5),
        ("7", 7.0),  # an integer literal in a double field
        ("inf", math.inf),
        ("-inf", -math.inf),
        ("Infinity", math.inf),
        ("-Infinity", -math.inf),
    ],
)
def test_doubles(literal: str, expected: float) -> None:
    assert parse(f"d: {literal}").double("d") == expected


def test_nan_is_a_double() -> None:
    assert math.isnan(parse("d: nan").double("d"))
    assert math.isnan(parse("d: NaN").double("d"))


def test_enums_and_bools_are_identifiers() -> None:
    m = parse("null_value: NULL_VALUE a: true b: false c: True d: f e: 1")
    assert m.value("null_value") == Identifier("NULL_VALUE")
    assert m.enum("null_value") == "NULL_VALUE"
    assert [m.boolean(n) for n in "abcde"] == [True, False, True, False, True]
    assert m.boolean("missing") is False


def test_any_expansion_gives_the_type_url_and_the_message() -> None:
    m = parse(
        "object_value { [type.googleapis.com/cel.expr.conformance.proto3.TestAllTypes] "
        "{ single_int64: 1 } }"
    )
    expanded = (m.message("object_value") or Message()).any_expansion()
    assert expanded is not None
    url, inner = expanded
    assert url == "type.googleapis.com/cel.expr.conformance.proto3.TestAllTypes"
    assert inner.integer("single_int64") == 1


def test_extension_field_names_keep_their_brackets() -> None:
    m = parse("[cel.expr.conformance.proto2.int32_ext]: 42")
    assert m.integer("[cel.expr.conformance.proto2.int32_ext]") == 42
    assert m.any_expansion() is None


def test_a_singular_field_read_twice_gives_the_last_value() -> None:
    assert parse("n: 1 n: 2").integer("n") == 2


def test_typed_readers_refuse_the_wrong_kind_of_value() -> None:
    m = parse('s: "x" n: 1 e: FOO m { }')
    with pytest.raises(TextprotoError):
        m.integer("s")
    with pytest.raises(TextprotoError):
        m.string("n")
    with pytest.raises(TextprotoError):
        m.double("e")
    with pytest.raises(TextprotoError):
        m.enum("s")
    with pytest.raises(TextprotoError):
        m.message("n")
    with pytest.raises(TextprotoError):
        m.boolean("s")


def test_missing_fields_read_as_their_defaults() -> None:
    m = parse("")
    assert (m.string("s"), m.integer("n"), m.double("d"), m.enum("e")) == ("", 0, 0.0, "")
    assert m.message("m") is None
    assert m.messages("m") == []


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("a {", "end of text"),
        ("a: }", "line 1, column 4"),
        ("a 1", "line 1, column 3"),
        ("a: @", "line 1, column 4"),
        ('a: "x\n"', "line 1, column 4"),  # a string may not span lines
        ("a: -FOO", "line 1, column 5"),
        ("a: [1 2]", "line 1, column 7"),
        ("\n\n  }", "line 3, column 3"),
    ],
)
def test_syntax_errors_say_where(text: str, where: str) -> None:
    with pytest.raises(TextprotoError, match=where):
        parse(text)


def test_every_conformance_file_parses_with_its_name_and_sections() -> None:
    files = sorted(DATA_DIR.glob("*.textproto"))
    assert len(files) == 30
    tests = 0
    for path in files:
        m = parse_file(path)
        assert m.string("name"), path.name
        for section in m.messages("section"):
            for test in section.messages("test"):
                assert test.string("name") and test.string("expr"), path.name
                tests += 1
    # The count of `expr:` fields in the files, as grep counts them.
    assert tests == 2456
