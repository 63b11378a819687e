from __future__ import annotations

import math
from fractions import Fraction

import pytest

from gpubudget import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 2**30),
        ("4 gib", 4 * 2**30),
        ("1.5GiB", 3 * 2**29),
        ("512MiB", 512 * 2**20),
        ("1KB", 1000),
        ("2.5 MB", 2_500_000),
        ("1TB", 10**12),
        ("1 TiB", 2**40),
        ("100B", 100),
        ("4096", 4096),
        (" 8 KiB ", 8192),
        (".5KiB", 512),
        (256, 256),
    ],
)
def test_parse_size_accepts(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "   ", "GiB", "4 XB", "4GiBs", "-1GiB", "0", "0GiB", "1.5", "nan", "inf", "1e3"])
def test_parse_size_rejects_bad_strings_quoting_them(bad: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bad, what="limit")
    assert repr(bad) in str(info.value) and "limit" in str(info.value)


@pytest.mark.parametrize("bad", [0, -5])
def test_parse_size_rejects_non_positive_ints(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        parse_size(bad)


@pytest.mark.parametrize("bad", [True, False, 1.5, math.nan, None, b"4GiB", [4]])
def test_parse_size_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        parse_size(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (4 * 2**30, "4.00 GiB"), (3 * 2**39, "1.50 TiB"), (-2048, "-2.00 KiB")],
)
def test_format_size(nbytes: int, text: str) -> None:
    assert format_size(nbytes) == text


def test_format_then_parse_round_trips_binary_units() -> None:
    for nbytes in (2**10, 3 * 2**20, 5 * 2**30):
        assert parse_size(format_size(nbytes).replace(" ", "")) == nbytes


def test_format_size_rejects_non_ints() -> None:
    with pytest.raises(TypeError):
        format_size(1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["9" * 400 + "GiB", "9" * 5000, str(2**64 + 1), "18446744073709551616.5KiB",
                                  "0" * 30 + "1" + "0" * 20 + "KB"])
def test_a_size_past_16_eib_is_refused_clearly_and_quickly(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text, what="limit")
    message = str(info.value)
    assert message.startswith("limit '") and "is too large: more than 16 EiB" in message
    assert len(message) < 200  # thousands of digits are not written back


def test_sizes_of_many_digits_are_exact() -> None:
    assert parse_size(str(2**64)) == 2**64  # the largest a string may name
    assert parse_size("0" * 5000 + "1.5" + "0" * 5000 + "KiB") == 1536  # zeros are free
    assert parse_size("12345678901234567890") == 12345678901234567890
    assert parse_size("18014398509481983.9990234375KiB") == 2**64 - 1
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size("1." + "0" * 60 + "1GiB")


def test_format_size_writes_ints_past_a_floats_range() -> None:
    assert format_size(2**70) == "1073741824.00 TiB"
    number, unit = format_size(10**400).split()
    assert unit == "TiB" and number[-3] == "."
    assert abs(Fraction(number) * 2**40 - 10**400) <= Fraction(2**40, 200)  # hundredths
    assert format_size(-(10**400)).startswith("-909494701772928237")
