"""Byte sizes: ``parse_size("1.5 GiB") -> int`` and ``format_size(int) -> str``."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Final

__all__ = ["format_size", "parse_size"]

_UNITS: Final[dict[str, int]] = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")
_BINARY: Final = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Return the number of bytes that ``value`` names.

    Parameters
    ----------
    value
        A positive ``int`` (bytes) or a string: a number (integer or decimal) followed by a
        unit, space optional, unit case-insensitive: ``B``, ``KB MB GB TB`` (powers of 1000)
        or ``KiB MiB GiB TiB`` (powers of 1024). A bare number in a string means bytes.
    what
        The name of the argument, used in error messages.

    Raises
    ------
    TypeError
        ``value`` is neither an ``int`` nor a ``str`` (``bool`` and ``float`` included).
    ValueError
        Empty, malformed, unknown unit, not a whole number of bytes, zero or negative.

    Examples
    --------
    >>> parse_size("4GiB"), parse_size("1.5 kb"), parse_size(256)
    (4294967296, 1500, 256)
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"{what} must be an int (bytes) or a string such as '4GiB', got {value!r} "
            f"of type {type(value).__name__}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{what} must be a positive number of bytes, got {value!r}")
        return value
    match = _SIZE.fullmatch(value)
    if match is None:
        if value.strip().startswith("-"):
            raise ValueError(f"{what} must be positive, got {value!r}")
        raise ValueError(
            f"{what} {value!r} is not a size: expected a number and a unit such as "
            f"'512MiB', '1.5 GB' or '4096'"
        )
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower() if unit else "b")
    if factor is None:
        raise ValueError(
            f"{what} {value!r} has an unknown unit {unit!r}; use one of "
            f"B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    try:
        exact = Decimal(number) * factor
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
        raise ValueError(f"{what} {value!r} is not a number") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"{what} {value!r} is not a whole number of bytes ({exact} B)")
    nbytes = int(exact)
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return nbytes


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
            return f"{sign}{magnitude / factor:.2f} {unit}"
    return f"{sign}{magnitude} B"
