"""Byte sizes and alignments: ``parse_size("1.5 GiB") -> int``, ``format_size(int) -> str``.

Also the constants the rest of the package shares (``KiB`` ... ``TiB``, ``DEFAULT_ALIGN``) and
the two helpers every layer needs: :func:`round_up` and :func:`check_align`.
"""

from __future__ import annotations

import operator
import re
from typing import Final, SupportsIndex

__all__ = [
    "DEFAULT_ALIGN",
    "GiB",
    "KiB",
    "MiB",
    "TiB",
    "check_align",
    "format_size",
    "parse_size",
    "round_up",
]

KiB: Final = 1024
MiB: Final = 1024**2
GiB: Final = 1024**3
TiB: Final = 1024**4
DEFAULT_ALIGN: Final = 256
"""Alignment of blocks unless a budget says otherwise: what ``cudaMalloc`` guarantees."""

_UNITS: Final[dict[str, int]] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
}
_SIZE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_BINARY: Final = (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
MAX_TEXT_SIZE: Final = 2**64
"""The largest size a string may name (16 EiB, every byte a 64-bit address can reach): a
longer number is refused before any arithmetic, so a size of thousands of digits costs
nothing and says what is wrong."""
_MAX_WHOLE_DIGITS: Final = len(str(MAX_TEXT_SIZE))
_MAX_FRACTION_DIGITS: Final = 40
"""Decimals past this many (trailing zeros aside) never make a whole number of bytes: no
unit is larger than 2**40 or 10**12."""


def as_int(value: object) -> int | None:
    """``value`` as an ``int`` if it is integer-like (an ``int`` or anything with
    ``__index__``, such as ``numpy.int64``), else ``None``; ``bool`` is not a size."""
    if type(value) is int:
        return value
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]  # checked just above
    except TypeError:
        return None


def parse_size(value: int | str | SupportsIndex, *, what: str = "size") -> int:
    """Return the number of bytes that ``value`` names.

    Parameters
    ----------
    value
        A positive integer (bytes: an ``int`` or anything with ``__index__``, such as
        ``numpy.int64``) or a string: a number (integer or decimal) followed by a unit, space
        optional, unit case-insensitive: ``B``, ``KB MB GB TB`` (powers of 1000) or
        ``KiB MiB GiB TiB`` (powers of 1024). A bare number in a string means bytes.
    what
        The name of the argument, used in error messages.

    Raises
    ------
    TypeError
        ``value`` is neither integer-like nor a ``str`` (``bool`` and ``float`` included).
    ValueError
        Empty, malformed, unknown unit, not a whole number of bytes, zero or negative.

    Examples
    --------
    >>> parse_size("4GiB"), parse_size("1.5 kb"), parse_size(256)
    (4294967296, 1500, 256)
    """
    if isinstance(value, str):
        return _parse_text(value, what)
    number = as_int(value)
    if number is None:
        raise TypeError(
            f"{what} must be an int (bytes) or a string such as '4GiB', got {value!r} "
            f"of type {type(value).__name__}"
        )
    if number <= 0:
        raise ValueError(f"{what} must be a positive number of bytes, got {value!r}")
    return number


def _parse_text(value: str, what: str) -> int:
    match = _SIZE.fullmatch(value)
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"{what} must be positive, got {_shown(value)}")
        raise ValueError(
            f"{what} {_shown(value)} is not a size: expected a number and a unit such as "
            f"'512MiB', '1.5 GB' or '4096'"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower() if unit else "b")
    if factor is None:
        raise ValueError(
            f"{what} {_shown(value)} has an unknown unit {unit!r}; use one of "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    whole, _, fraction = number.partition(".")
    whole, fraction = whole.lstrip("0"), fraction.rstrip("0")
    if len(whole) > _MAX_WHOLE_DIGITS:
        raise ValueError(f"{what} {_shown(value)} is too large: more than 16 EiB "
                         f"(2**64 bytes), more than any device holds")
    if len(fraction) > _MAX_FRACTION_DIGITS:
        raise ValueError(f"{what} {_shown(value)} is not a whole number of bytes")
    if fraction:
        nbytes = _fractional(value, what, whole, fraction, factor)
    else:
        nbytes = int(whole or "0") * factor  # a whole number: no decimals to get exact
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {_shown(value)}")
    if nbytes > MAX_TEXT_SIZE:
        raise ValueError(f"{what} {_shown(value)} is too large: more than 16 EiB "
                         f"(2**64 bytes), more than any device holds")
    return nbytes


def _fractional(value: str, what: str, whole: str, fraction: str, factor: int) -> int:
    """The bytes of ``whole.fraction`` units of ``factor`` bytes, if a whole number."""
    from decimal import Decimal, InvalidOperation, localcontext  # here: "1.5GiB" is rare

    with localcontext() as exact_digits:  # exact: at most 21 + 40 + 13 digits
        exact_digits.prec = 100
        try:
            exact = Decimal(f"{whole or 0}.{fraction or 0}") * factor
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise ValueError(f"{what} {_shown(value)} is not a number") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"{what} {_shown(value)} is not a whole number of bytes ({exact} B)")
    return int(exact)


def _shown(value: str) -> str:
    """``value`` quoted for a message as ``repr`` does, its middle left out if it is long
    (a size of thousands of digits)."""
    if len(value) <= 80:
        return repr(value)
    return f"{value[:30]!r}…{value[-12:]!r} ({len(value):,} characters)"


def format_size(nbytes: int) -> str:
    """Render a byte count in binary units with two decimals, bytes below 1 KiB.

    Examples
    --------
    >>> format_size(4 * 2**30), format_size(1536), format_size(100), format_size(0)
    ('4.00 GiB', '1.50 KiB', '100 B', '0 B')
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"format_size expects an int, got {nbytes!r}")
    sign = "-" if nbytes < 0 else ""
    magnitude = abs(nbytes)
    for unit, factor in _BINARY:
        if magnitude >= factor:
            try:
                return f"{sign}{magnitude / factor:.2f} {unit}"
            except OverflowError:  # past a float's range: exact, hundredths rounded half up
                hundredths = (magnitude * 200 // factor + 1) // 2
                return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {unit}"
    return f"{sign}{magnitude} B"


def round_up(value: int, granularity: int) -> int:
    """``value`` rounded up to a multiple of ``granularity`` (a power of two).

    >>> round_up(1000, 256), round_up(1024, 256)
    (1024, 1024)
    """
    return (value + granularity - 1) & -granularity


def is_power_of_two(value: int) -> bool:
    """Whether ``value`` is 1, 2, 4, 8, ..."""
    return value > 0 and value & (value - 1) == 0


def check_align(value: object, what: str = "align") -> int:
    """``value`` if it is an integer power of two, else ``TypeError``/``ValueError`` quoting it."""
    number = as_int(value)
    if number is None:
        raise TypeError(f"{what} must be an int power of two, got {value!r}")
    if not is_power_of_two(number):
        raise ValueError(f"{what} must be a power of two >= 1, got {value!r}")
    return number


def as_size(value: object) -> int | None:
    """``value`` as bytes: an integer-like value (see :func:`as_int`), or a
    string :func:`parse_size` reads; else ``None`` (a denial)."""
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError:
            return None
    return as_int(value)
