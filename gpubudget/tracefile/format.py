"""The trace format's constants and its error (see the package's docstring)."""

from __future__ import annotations

import json
from typing import Final

from ..errors import TraceError

__all__ = [
    "FLUSH_EVERY",
    "FLUSH_SECONDS",
    "FORMAT",
    "LIMIT_REASONS",
    "MAX_FRAMES",
    "MAX_LINE_BYTES",
    "MAX_TEXT",
    "MAX_TRACE_BYTES",
    "VERSION",
    "TraceError",
    "printable",
]


FORMAT: Final = "gpubudget-trace"
VERSION: Final = 1
FLUSH_EVERY: Final = 64
"""Events a writer buffers at most before it flushes them to the file."""
FLUSH_SECONDS: Final = 0.25
"""A writer also flushes at an event that comes this long (seconds) after its last flush."""
MAX_LINE_BYTES: Final = 1 << 20
"""Longest line a reader accepts, newline included (1 MiB; the writer's lines are ~100 B)."""
MAX_TEXT: Final = 1024
"""Longest name, tag, reason or backend name the writer writes, in characters: a longer one
is cut to ``MAX_TEXT - 1`` characters and ``…``. JSON writes a character in 12 bytes at most
(a surrogate pair), and a line holds two such texts, so every line written stays far below
:data:`MAX_LINE_BYTES`: every trace gpubudget writes, gpubudget reads."""
MAX_FRAMES: Final = 512
"""Most frames an allocation's ``stack`` holds: the writer keeps the innermost ones."""
MAX_TRACE_BYTES: Final = 4 << 30
"""Largest trace a reader accepts unless told otherwise (4 GiB, about 40 million events)."""


_QUOTED: Final = 60
"""Characters of a bad value quoted in an error message, at most."""
LIMIT_REASONS: Final = frozenset({"over_limit", "fragmented"})
"""Denial reasons that a larger limit can change (a request denied for one has a size)."""


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


def _quote(value: object) -> str:
    """A bad value, quoted for an error message as JSON writes it: safe to print, at most
    ~60 characters."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # pragma: no cover - values come from json itself
        text = printable(repr(value))
    return text if len(text) <= _QUOTED else text[: _QUOTED - 1] + "…"
