"""Text that is safe to show: what a trace, a ledger slot, a file name or a user's value holds
may carry terminal escapes, line breaks or bidirectional overrides, and every message that
quotes it goes through :func:`printable` (or :func:`quote`, which also keeps it short)."""

from __future__ import annotations

from typing import Final

__all__ = ["QUOTED", "printable", "quote"]

QUOTED: Final = 60
"""Characters of a value that :func:`quote` writes at most."""


def printable(text: str) -> str:
    """``text`` with every character that is not printable (control characters, terminal
    escape sequences, bidirectional overrides, line breaks, lone surrogates) written as a
    Python escape, so that text read from a trace can be shown on a terminal safely.

    >>> printable("model\\x1b[2J\\n")
    'model\\\\x1b[2J\\\\n'
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii")
                   for ch in text)


def quote(value: object) -> str:
    """A bad value, quoted for an error message as JSON writes it: safe to print, at most
    :data:`QUOTED` characters.

    >>> quote("a\\nb"), quote(1.5), quote({1, 2}), quote("x" * 100)[-3:]
    ('"a\\\\nb"', '1.5', '{1, 2}', 'xx…')
    """
    import json  # here: most programs never quote a bad value

    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):  # a value json cannot write
        text = printable(repr(value))
    return text if len(text) <= QUOTED else text[: QUOTED - 1] + "…"
