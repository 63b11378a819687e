"""Trace files: every event of a budget tree as JSON lines, after a versioned header.

Format, version 1. The first line is the header::

    {"format": "gpubudget-trace", "version": 1, "created": "2026-11-29T18:00:00Z", "pid": 123}

Then one object per line and event, ``t`` in seconds since the header, ``b`` a budget id
unique in the file:

- ``{"ev": "enter", "t", "b", "name", "parent": id | null, "limit", "align", "reserve",
  "backend", "base", "granule"}``: a budget was entered (``parent`` null for a root). A
  root's line gives ``base``, the address its memory starts at, and a growable root's
  (``initial=``) its ``granule``: its range is then ``base`` and the limit rounded up to
  ``align`` and to ``granule``, mapped a granule at a time. Both are absent on a child's
  line (and on every line of a trace written before they came);
- ``{"ev": "map", "t", "b", "ptr", "bytes"}`` and ``{"ev": "unmap", ...}``: growable root
  ``b`` mapped (unmapped) the granules ``[ptr, ptr + bytes)``: at its entry (what
  ``initial=`` mapped), when a block needed more, at a trim, when it went to sleep or woke;
- ``{"ev": "alloc", "t", "b", "size", "align", "tag", "ptr", "bytes", "reason"}``: an
  allocation by budget ``b``: ``ptr`` the address handed out and ``bytes`` the aligned size
  charged, or ``ptr`` null and ``reason`` why it was denied;
- ``{"ev": "free", "t", "b", "ptr"}``: the block at ``ptr`` of budget ``b`` was freed;
- ``{"ev": "resize", "t", "b", "ptr", "size", "align", "bytes"}``: the block at ``ptr`` was
  resized in place (a move is recorded as an ``alloc`` and a ``free``);
- ``{"ev": "door", "t", "b", "held", "own", "allocations", "peak", "refusals",
  "last_refused", "last_refused_by", "libraries", "attribute_only"}``: under the driver door
  (``gpubudget run``), what the door had charged budget ``b`` when its ``with`` block
  ended, on the line just before its ``exit``: the numbers of
  :class:`gpubudget.door.DoorNumbers` (``held`` counts a root's own memory, ``own``;
  ``allocations`` is its ``live``, the driver allocations made in the budget itself still
  live; ``last_refused_by`` the library that asked the last request refused here, or null),
  and ``libraries``, the budget's own driver allocations by library, largest first, as
  ``[name, live bytes, refusals]`` lists (at most 64). Written only under the door, and only
  for a budget the door charged or refused something (its ``peak`` or ``refusals`` not 0);
- ``{"ev": "exit", "t", "b"}``: the budget's ``with`` block ended;
- ``{"ev": "frame", "id", "at"}``: defines frame ``id`` (``"file:line in function"``) for
  the stacks of later ``alloc`` lines. A budget with ``track_stacks=True`` writes each
  frame once, on the line before the first allocation whose stack holds it, and then
  gives the allocation ``"stack": [id, ...]``, outermost frame first (its innermost
  :data:`MAX_FRAMES` frames): a trace with stacks grows by one short list per allocation
  and one line per distinct frame. The reader yields no event for a frame line; it gives
  each :class:`Alloc` its ``stack`` as the frames' text (``None`` without one).

- ``{"ev": "lost", "t", "events"}``: the writer's queue was full at ``t`` (its file
  written slower than events came) and dropped ``events`` events from there on: the trace
  stops there (every later event is dropped too, so that no line names a block the trace
  never showed). More than one such line may end a trace; their counts add up. The reader
  yields no event for it; :attr:`TraceReader.lost` gives the count and
  :attr:`TraceReader.cut_short` says the trace stops there (see :mod:`.queue`).

Names, tags, reasons, backend names and a door line's library names are at most
:data:`MAX_TEXT` (1024) characters: the writer shortens a longer one to 1023 characters and
``…``; a refused ``size`` or ``bytes`` beyond 64 bits is written as ``2**63 - 1``, and a door
line's numbers are kept within ``[0, 2**63)``. So every line gpubudget writes is far shorter
than :data:`MAX_LINE_BYTES` and within the ranges below: every trace it writes, it reads.

Writers are shared per path within a process, so several root budgets (``GPUBUDGET_TRACE``)
write one file with one header. A file is written by one process at a time: the writer holds
an advisory lock on it (``flock``), refuses to follow a symbolic link, and overwrites only an
empty file or an earlier trace of the same user (see :mod:`gpubudget.tracefile.files`);
``{pid}`` in a path becomes the process id.

Reading (:class:`TraceReader`, :func:`read_trace`) streams the file and checks every line
against the schema above, refusing with a :class:`TraceError` that names the file, the line
and what is wrong:

- the input must be a regular file (or ``-``, standard input, when it is not a terminal),
  at most ``max_bytes`` long (:data:`MAX_TRACE_BYTES` unless told), every line at most
  :data:`MAX_LINE_BYTES`, UTF-8, one flat JSON object;
- the header comes first; a newer ``version`` than :data:`VERSION` is refused;
- ``t`` is a finite number >= 0; ``b``, ``parent``, ``limit``, ``align``, ``reserve``,
  ``size``, ``bytes`` and ``ptr`` are integers (not floats, booleans or null, except where
  null is allowed above) in ``[-2**63, 2**63)``, and more narrowly: ``limit`` >= 1, budget
  ids, ``reserve``, ``bytes`` and ``ptr`` >= 0, ``align`` a power of two in ``enter`` and
  0 or a power of two elsewhere; ``name`` a non-blank string; ``tag``, ``reason`` and
  ``backend`` strings or null;
- ids: a budget is entered once, under a parent entered earlier and not yet exited (so
  budgets form a tree: no self-parent, no cycle), and exits once; ``alloc``, ``free`` and
  ``resize`` name a budget entered earlier;
- granules: ``granule`` is a power of two, on a root's line with its ``base`` (>= 0);
  ``map`` and ``unmap`` name a growable root entered earlier, and whole granules of its
  range, each not yet mapped (``map``) or mapped (``unmap``);
- door lines: ``held``, ``own``, ``allocations``, ``peak``, ``refusals`` and
  ``last_refused`` integers >= 0, ``last_refused_by`` a non-blank string or null (null, and
  ``last_refused`` 0, where ``refusals`` is 0), ``libraries`` a list of ``[name, bytes,
  refusals]`` (a non-blank string, two integers >= 0), ``attribute_only`` true or false
  (absent: false); the budget entered earlier, not yet exited, with no door line before;
- blocks: a granted allocation has ``bytes >= size >= 1`` and no ``reason``, at an address
  not live in the same tree (a block still live in another tree is dropped: that tree was
  garbage-collected, leaking it, and its memory was handed out again); a denied one has a ``reason`` (and ``size >= 1`` when the reason is a
  limit or fragmentation); ``free`` and ``resize`` name a live block of that budget.

Keys not named above are ignored (room for later writers of version 1). Frame lines came
later in version 1, then ``base``, ``granule``, ``map`` and ``unmap``, then ``door``: a
gpubudget older than them reads the keys as unknown, and refuses a trace with stacks, with a
growable root's granules, or written under the driver door, naming the ``frame``, ``map`` or
``door`` event it does not know; this one reads the traces those wrote. Iterating a reader
(and replaying, and ``fit``) leaves the ``map`` and ``unmap`` events out, checked: a replay
maps its own memory; :meth:`TraceReader.events_with_mappings` gives them too (the viewer
draws them). It leaves the ``door`` events out too, checked (``fit`` has no door);
``door=True``, there and in :meth:`TraceReader.events`, gives them as :class:`Door` events
(a replay's reports and the viewer show their numbers). Empty lines are skipped (a run of them a buffer at a
time, so a file of nothing else reads at disk speed; they still count as lines in the
messages and toward ``max_bytes``). A last line cut short without its newline (the writing
process was killed mid-line) is skipped, and :attr:`TraceReader.cut_short` says so. The
reader's memory grows with the budgets, the blocks live at once and the distinct frames,
never with the number of events.

Granted allocations and frees (nearly every line) are read, checked and typed in C by the
scanner built with the package (``_scan.c``, :mod:`.cscan`), a buffer of lines at a time; a
replay has it replay them too, as it reads them. Without it (no C compiler at install,
``GPUBUDGET_PURE=1``), msgspec (``pip install 'gpubudget[traces]'``) decodes and types them in
C, line by line, about three times as fast as :mod:`json`. Every other line, and any line
that these do not take, is read by the standard library's :mod:`json` and checked as above.
Events and error messages are the same either way (:mod:`.cscan`, :mod:`.fastparse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from .events import (Alloc, Door, Enter, Exit, Free, Header, Map, MappingEvent, Resize,
                     TraceEvent, Unmap)
from .format import (
    BUFFER_BYTES,
    FLUSH_BYTES,
    FLUSH_SECONDS,
    FORMAT,
    LIMIT_REASONS,
    MAX_FRAMES,
    MAX_LINE_BYTES,
    MAX_TEXT,
    MAX_TRACE_BYTES,
    VERSION,
    TraceError,
)
from ..text import printable  # kept here too: gpubudget.tracefile.printable was public
from .files import TraceBusy
from .writer import TraceWriter
from .perpath import writer_for, writer_from_env

if TYPE_CHECKING:
    from .cscan import Sink
    from .reader import PARSER_ENV, PARSERS, Trace, TraceReader, read_trace

_READER: Final = frozenset({"PARSER_ENV", "PARSERS", "Trace", "TraceReader", "read_trace"})


def __getattr__(name: str) -> Any:
    """The reader's names, imported at their first use: reading (with msgspec, where it is
    installed) is a third of the package's import time, and a program that only writes
    traces never needs it."""
    if name in _READER:
        from . import reader

        return getattr(reader, name)
    if name == "Sink":
        from . import cscan

        return cscan.Sink
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Alloc",
    "BUFFER_BYTES",
    "Door",
    "Enter",
    "Exit",
    "FLUSH_BYTES",
    "FLUSH_SECONDS",
    "FORMAT",
    "Free",
    "Header",
    "LIMIT_REASONS",
    "MAX_FRAMES",
    "MAX_LINE_BYTES",
    "MAX_TEXT",
    "MAX_TRACE_BYTES",
    "Map",
    "MappingEvent",
    "PARSERS",
    "PARSER_ENV",
    "Resize",
    "Sink",
    "Trace",
    "TraceBusy",
    "TraceError",
    "TraceEvent",
    "TraceReader",
    "TraceWriter",
    "Unmap",
    "VERSION",
    "printable",
    "read_trace",
    "writer_for",
    "writer_from_env",
]
