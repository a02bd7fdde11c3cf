"""Quantities parse exactly and format the way the API server stores them."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.quantity import QuantityError, binary, decimal, format_quantity, parse_quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("80Gi", 80 * 1024**3),
        ("1024Mi", 1024**3),
        ("1.5Gi", 3 * 512 * 1024**2),
        ("500m", Fraction(1, 2)),
        ("1e3", 1000),
        ("1E3", 1000),
        ("2k", 2000),
        ("-1", -1),
        ("+7", 7),
        (".5", Fraction(1, 2)),
        ("0", 0),
    ],
)
def test_parse_gives_the_exact_value(text: str, value: int | Fraction) -> None:
    assert parse_quantity(text).value == value


@pytest.mark.parametrize("text", ["", "Gi", "1 Gi", "1GB", "1.2.3", "abc", " 1", "1ki", "0x10"])
def test_parse_rejects_invalid_text_and_names_it(text: str) -> None:
    with pytest.raises(QuantityError, match="not a valid quantity"):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("value", "fmt", "text"),
    [
        (85899345920, "BinarySI", "80Gi"),
        (85520809984, "BinarySI", "81559Mi"),
        (1000, "BinarySI", "1k"),  # below 1024 the server switches to DecimalSI
        (1, "BinarySI", "1"),
        (132, "DecimalSI", "132"),
        (1000, "DecimalSI", "1k"),
        (1500, "DecimalSI", "1500"),
        (Fraction(1, 2), "DecimalSI", "500m"),
        (0, "BinarySI", "0"),
    ],
)
def test_format_matches_the_api_servers_canonical_form(value: int, fmt: str, text: str) -> None:
    assert format_quantity(value, fmt) == text  # type: ignore[arg-type]


def test_equal_values_with_different_suffixes_are_equal() -> None:
    assert parse_quantity("1Gi").value == parse_quantity("1024Mi").value


@given(st.integers(min_value=0, max_value=2**62))
def test_canonical_binary_and_decimal_forms_round_trip(n: int) -> None:
    assert parse_quantity(binary(n)).value == n
    assert parse_quantity(decimal(n)).value == n
    assert binary(int(parse_quantity(binary(n)).value)) == binary(n)
