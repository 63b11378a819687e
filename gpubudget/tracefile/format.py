"""The trace format's constants and its error (see the package's docstring)."""

from __future__ import annotations

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


LIMIT_REASONS: Final = frozenset({"over_limit", "fragmented"})
"""Denial reasons that a larger limit can change (a request denied for one has a size)."""

