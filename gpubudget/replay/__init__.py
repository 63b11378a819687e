"""Replay a trace (:mod:`gpubudget.tracefile`) against budgets in host memory, and ``fit``:
the smallest limit of every budget under which the replay has no denial.

Replay opens the recorded budgets in the recorded order, under their recorded parents, on a
host backend that never touches memory (``MAP_NORESERVE``, so a trace of a 141 GB GPU
replays on a laptop), and repeats every allocation, free and resize. Each budget is entered
and exited in a context of its own (``parent=`` names its parent), so budgets recorded in
several threads replay in the order the trace gives. The backend's clock is the trace's:
every replayed event is stamped with the ``t`` it was recorded at, so reports and plots of
a replay show the recorded time axis.

Requests that were denied by a limit or by fragmentation are replayed too, as *probes*
(allocated, then freed at once): they are memory the program wanted. Denials for another
reason (an invalid size, alignment or tag, a released budget) are not replayed: no limit
changes them.

Stacks recorded with ``track_stacks=True`` are kept beside the replayed blocks (a replay
cannot hand a stack to ``Budget.allocate``): the reports' live blocks carry them. The
reports list each live block at the address it was recorded at, in that order: the replay
places blocks in a host mapping of its own, whose addresses change from run to run, so two
reports of one trace print the same (the arena's free bytes and largest free block are the
replay's, and the same from run to run too).

Granted allocations and frees, most of a trace, are replayed by the reader's C scanner as it
reads them (:meth:`~gpubudget.tracefile.TraceReader.events` with the replay's tables), and
everything else by the Python loop of :mod:`.run`; both do the same, in the same order.

A file is read as a stream (:class:`~gpubudget.tracefile.TraceReader`): ``replay`` holds
the budgets, the blocks live at once and their stacks, never the whole trace; a budget
knows its parent, not a copy of its chain of ancestors. ``fit`` keeps each root's events in
memory (in flat arrays, about 70 bytes an event) while it searches that root's limit.
"""

from __future__ import annotations

from .fit import Fit, fit
from .run import (
    PROBE_REASONS,
    Recorded,
    ReplayBackend,
    ReplayError,
    ReplayResult,
    replay,
)

__all__ = [
    "Fit",
    "PROBE_REASONS",
    "Recorded",
    "ReplayBackend",
    "ReplayError",
    "ReplayResult",
    "fit",
    "replay",
]
