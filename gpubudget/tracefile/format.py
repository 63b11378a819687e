"""The trace format's constants and its error (see the package's docstring)."""

from __future__ import annotations

from typing import Final

from ..errors import TraceError

__all__ = [
    "BUFFER_BYTES",
    "FLUSH_BYTES",
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
FLUSH_BYTES: Final = 1 << 20
"""Bytes queued (about 10,000 events) that wake the writer's thread to write them."""
FLUSH_SECONDS: Final = 0.25
"""The writer's thread writes what is queued at least this often (seconds)."""
BUFFER_BYTES: Final = 64 << 20
"""Most bytes a writer holds, queued and being written (about 660,000 events): an event that
would take it over that is dropped, and so is every later one (the trace stops there), each
counted; see :mod:`.queue`."""
MAX_LINE_BYTES: Final = 1 << 20
"""Longest line a reader accepts, newline included (1 MiB; the writer's lines are ~100 B)."""
MAX_TEXT: Final = 1024
"""Longest name, tag, reason, backend name or library name the writer writes, in characters:
a longer one is cut to ``MAX_TEXT - 1`` characters and ``…``. JSON writes a character in 12
bytes at most (a surrogate pair), and a line holds two such texts (a ``door`` line 65: its
64 libraries at most, and the one refused last, under 800 KiB), so every line written stays
below :data:`MAX_LINE_BYTES`: every trace gpubudget writes, gpubudget reads."""
MAX_FRAMES: Final = 512
"""Most frames an allocation's ``stack`` holds: the writer keeps the innermost ones."""
MAX_TRACE_BYTES: Final = 4 << 30
"""Largest trace a reader accepts unless told otherwise (4 GiB, about 40 million events)."""


LIMIT_REASONS: Final = frozenset({"over_limit", "fragmented"})
"""Denial reasons that a larger limit can change (a request denied for one has a size)."""

