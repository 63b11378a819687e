"""What happened: per-budget statistics, a tree's bounded event log, and its trace writer.

:class:`Stats` holds one budget's counters (allocations, frees, denials by reason and by the
budget that refused, bytes per tag, errors caught in callbacks). :class:`Recorder` holds a
tree's event log and trace writer; its methods are the only place where an event is
counted, logged and traced, so the three always agree. Every method is called with the
tree's lock held, after the operation it records has been committed: a trace writer that
fails (a full disk) is dropped with one ``RuntimeWarning``, and the report's
``trace_error`` says why the trace stops there; any other exception raised in the clock or
the writer (a signal handler's ``TimeoutError``, a Ctrl-C) propagates, and the tree undoes
the operation it cut short.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, Protocol

from ..callers import user_stacklevel
from ..errors import TraceError, raise_if_from_outside
from ..extensions import extension

native: Final = extension("_core", "_native")  # the C core, or None

if TYPE_CHECKING:
    from ..door.records import DoorNumbers
    from ..tracefile import TraceWriter
    from .ledger import Account
    from .memory import Mapping

__all__ = ["EVENT_LOG_LIMIT", "KEEP_ERRORS", "Event", "EventLog", "Recorder", "Stats"]

EVENT_LOG_LIMIT: Final = 50_000
"""Events a budget tree keeps for its timeline; older ones are dropped. An event is a tuple of
seven small values, about 200 bytes with its numbers: at most about 10 MB per tree."""
KEEP_ERRORS: Final = 16
"""Errors caught inside callbacks that a budget keeps for its report (the most recent)."""

# A timeline event: (time, kind, budget id, aligned bytes, tag, budget's used after, root's
# used after). kind is "alloc", "free" or "deny" (then bytes is the refused size). Atomic
# values only, so that the garbage collector does not track them.
Event = tuple[float, str, int, int, "str | None", int, int]


class _Counters:
    """A budget's counters, the storage of :class:`Stats` (in C when the C core runs)."""

    __slots__ = ("allocations", "frees", "blocks", "peak_blocks", "invalid_frees", "denied",
                 "largest_denied", "denials", "tags", "errors", "retired", "bytes_allocated",
                 "bytes_freed")

    def __init__(self, errors: deque[str]) -> None:
        self.allocations = 0
        self.frees = 0
        self.blocks = 0  # live blocks now
        self.peak_blocks = 0
        self.invalid_frees = 0
        self.denied = 0
        self.largest_denied = 0
        self.denials: dict[tuple[str, str], list[int]] = {}  # (reason, refused by) -> [n, largest]
        self.tags: dict[str, list[int]] = {}  # tag -> [live bytes, peak bytes], own blocks
        self.errors = errors
        self.bytes_allocated = 0  # aligned bytes ever granted (a resize's growth included)
        self.bytes_freed = 0  # aligned bytes ever freed (a resize's shrink included)
        # allocations, frees, denials, bytes allocated and freed of released descendants no
        # longer listed as children
        self.retired = [0, 0, 0, 0, 0]


if native is not None and not TYPE_CHECKING:
    _Counters = native.Stats  # noqa: F811 - the same fields in C (recorder.c)


class Stats(_Counters):
    """One budget's counters; see ``BudgetReport`` for what each means."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(deque(maxlen=KEEP_ERRORS))

    def count_denial(self, nbytes: int, reason: str, refused_by: str) -> None:
        self.denied += 1
        if nbytes > self.largest_denied:
            self.largest_denied = nbytes
        entry = self.denials.get((reason, refused_by))
        if entry is None:
            self.denials[(reason, refused_by)] = [1, nbytes]
        else:
            entry[0] += 1
            if nbytes > entry[1]:
                entry[1] = nbytes

    def reset_peaks(self) -> None:
        """Peaks start again from now: block count and bytes per tag."""
        self.peak_blocks = self.blocks
        for entry in self.tags.values():
            entry[1] = entry[0]

    def tag_grew(self, tag: str, nbytes: int) -> None:
        entry = self.tags.get(tag)
        if entry is None:
            self.tags[tag] = [nbytes, nbytes]
        else:
            live = entry[0] = entry[0] + nbytes
            if live > entry[1]:
                entry[1] = live


class _EventLog:
    """A tree's last ``maxlen`` events, oldest first, and how many were ever logged (in C
    when the C core runs)."""

    __slots__ = ("_events", "logged")

    def __init__(self, maxlen: int) -> None:
        self._events: deque[Event] = deque(maxlen=maxlen)
        self.logged = 0  # events ever logged; ``logged - len(self)`` were dropped

    def append(self, event: Event) -> None:
        self._events.append(event)
        self.logged += 1

    def __len__(self) -> int:
        return len(self._events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self._events)

    @property
    def maxlen(self) -> int | None:
        return self._events.maxlen


EventLog = _EventLog
if native is not None and not TYPE_CHECKING:
    EventLog = native.EventLog


class Family(Protocol):
    """Where a registered root's children are shown in the host ledger
    (:class:`gpubudget.hostledger.children.Family`)."""

    def opened(self, account: Account, parent: Account, serial: int, name: str) -> None: ...

    def released(self, account: Account) -> None: ...

    def close(self) -> None: ...


class Recorder:
    """A tree's event log and trace writer (see the module docstring)."""

    __slots__ = ("events", "writer", "trace_error", "clock", "published", "family", "base",
                 "mapping", "root", "doors")

    def __init__(self, writer: TraceWriter | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock: Final = clock  # seconds, for the timeline
        self.events: _EventLog = EventLog(EVENT_LOG_LIMIT)
        self.writer = writer
        self.trace_error: str | None = None  # why tracing stopped, if it did
        self.published: memoryview | None = None  # the root's words in the host ledger
        # where a registered root's children are shown in the host ledger, if anywhere
        self.family: Family | None = None
        self.base = 0  # where the root's blocks sit, and a growable root's granules
        self.mapping: Mapping | None = None
        self.root: int | None = None  # the root's budget id, once entered
        # under the driver door: budget id -> its door line, for its exit's trace
        self.doors: dict[int, str] = {}

    def _now(self) -> float:
        """The clock's time for an event being recorded (the operation is already committed):
        ``time.perf_counter``'s, or the backend's clock's, ``nan`` if that one fails (its
        error is the backend's, and only leaves this event without a time)."""
        clock = self.clock
        if clock is time.perf_counter:
            return clock()
        try:
            return float(clock())
        except Exception as exc:  # noqa: BLE001 - the backend's failure
            raise_if_from_outside(exc)
            return float("nan")

    @property
    def logged(self) -> int:
        """Events ever logged; ``logged - len(events)`` were dropped."""
        return self.events.logged

    # -- one method per event: count, log, trace -----------------------------------------

    def granted(self, stats: Stats, budget: int, size: int, alignment: int, tag: str | None,
                address: int, nbytes: int, used: int, total: int,
                stack: tuple[str, ...] | None = None) -> None:
        stats.allocations += 1
        stats.bytes_allocated += nbytes
        blocks = stats.blocks = stats.blocks + 1
        if blocks > stats.peak_blocks:
            stats.peak_blocks = blocks
        if tag is not None:
            stats.tag_grew(tag, nbytes)
        self.events.append((self._now(), "alloc", budget, nbytes, tag, used, total))
        if self.writer is not None:
            self._trace(self.writer.alloc, budget, size, alignment, tag, address, nbytes, stack)

    def freed(self, stats: Stats, budget: int, address: int, nbytes: int, tag: str | None,
              used: int, total: int) -> None:
        stats.frees += 1
        stats.bytes_freed += nbytes
        stats.blocks -= 1
        if tag is not None:
            stats.tags[tag][0] -= nbytes
        self.events.append((self._now(), "free", budget, nbytes, tag, used, total))
        if self.writer is not None:
            self._trace(self.writer.free, budget, address)

    def denied(self, stats: Stats, budget: int, size: int, alignment: int, tag: str | None,
               nbytes: int, reason: str, refused_by: str, used: int, total: int) -> None:
        stats.count_denial(nbytes, reason, refused_by)
        if self.published is not None:
            self.published[2] += 1  # denials in the tree, for other processes to read
        self.events.append((self._now(), "deny", budget, nbytes, tag, used, total))
        if self.writer is not None:
            self._trace(self.writer.deny, budget, size, alignment, tag, nbytes, reason)

    def resized(self, stats: Stats, budget: int, address: int, size: int, alignment: int,
                tag: str | None, old: int, nbytes: int, used: int, total: int) -> None:
        if tag is not None:
            stats.tags[tag][0] -= old
            stats.tag_grew(tag, nbytes)
        kind = "alloc" if nbytes > old else "free"
        if nbytes > old:
            stats.bytes_allocated += nbytes - old
        else:
            stats.bytes_freed += old - nbytes
        self.events.append((self._now(), kind, budget, abs(nbytes - old), tag, used, total))
        if self.writer is not None:
            self._trace(self.writer.resize, budget, address, size, alignment, nbytes)

    def place(self, base: int, mapping: Mapping | None) -> None:
        """The root's memory starts at ``base``; a growable root's granules are ``mapping``'s,
        which tells this recorder each change of them (for the trace)."""
        self.base = base
        self.mapping = mapping
        if mapping is not None:
            mapping.watcher = self.mapped

    def entered(self, budget: int, name: str, parent: int | None, limit: int, align: int,
                reserve: int, backend: str | None) -> None:
        if parent is None:
            self.root = budget
        if self.writer is None:
            return
        if parent is not None:
            self._trace(self.writer.enter, budget, name, parent, limit, align, reserve, backend)
            return
        mapping = self.mapping
        self._trace(self.writer.enter, budget, name, parent, limit, align, reserve, backend,
                    self.base, None if mapping is None else mapping.granule)
        if mapping is not None:  # what it mapped at entry
            self.mapped("map", [index for index, on in enumerate(mapping.mapped) if on])

    def mapped(self, change: str, indices: list[int]) -> None:
        """Granules ``indices`` of the root's range were mapped or unmapped (``change``): one
        trace line per run of them. Called by the :class:`~gpubudget._core.memory.Mapping`,
        only when what is mapped changes."""
        writer, mapping, root = self.writer, self.mapping, self.root
        if writer is None or mapping is None or root is None:
            return
        write = writer.map if change == "map" else writer.unmap
        granule, address = mapping.granule, mapping.address
        for first, count in _runs(indices):
            self._trace(write, root, address + first * granule, count * granule)

    # -- the host ledger: a registered root's children, shown as they enter and go ---------

    def child_entered(self, account: Account, parent: Account, budget: int, name: str) -> None:
        """A child budget entered (its ``account`` under ``parent``'s): shown in the host
        ledger where the root is registered. Never raises (see :meth:`_shown`)."""
        if self.family is not None:
            self._shown(self.family.opened, account, parent, budget, name)

    def child_released(self, account: Account) -> None:
        """A child budget was released: no longer shown in the host ledger."""
        if self.family is not None:
            self._shown(self.family.released, account)

    def _shown(self, change: Callable[..., None], *args: object) -> None:
        """One change of what the host ledger shows. It is only shown: an exception in it (a
        bug, its file's failure) stops showing this root's children and is told once as a
        warning; an ``OSError`` that no system call raised (a signal handler's
        ``TimeoutError``) propagates."""
        try:
            change(*args)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            raise_if_from_outside(exc)
            family, self.family = self.family, None
            if family is not None:
                family.close()
            warnings.warn(f"gpubudget: child budgets are no longer shown in the host "
                          f"ledger: {type(exc).__name__}: {exc}", RuntimeWarning,
                          stacklevel=user_stacklevel())

    def door_at_exit(self, budget: int, numbers: DoorNumbers) -> None:
        """Budget ``budget``, traced and under the driver door, is about to exit: ``numbers``
        (what the door charged it) are made its ``door`` line now, which :meth:`exited`
        writes with its ``exit`` line. Called by the budget layer before the exit, outside
        the tree's lock (the hooks charge the door without it anyway): cut short here, the
        budget still exits, its exit traced, without the door's line."""
        writer = self.writer
        if writer is not None:
            self.doors[budget] = writer.door_line(budget, numbers)

    def exited(self, budget: int, root: bool) -> None:
        line = self.doors.pop(budget, "") if self.doors else ""
        if self.writer is not None:  # with the door's line first, where there is one
            self._trace(self.writer.exit, budget, *((line,) if line else ()))
        if root and self.writer is not None:
            self._trace(self.writer.flush)

    # -- the trace: isolated, so that its failure never reaches the accounting ------------

    def _trace(self, write: Callable[..., None], *args: object) -> None:
        """Call one writer method; the accounting is already committed and stays right.

        The writer's own failure (an ``OSError`` of its file: a full disk; a
        :class:`~gpubudget.errors.TraceError`: the file replaced or closed) ends the trace
        with one warning. Any other exception (a Ctrl-C, a signal handler's ``TimeoutError``
        landing in the writer) propagates: the operation it cut short is undone (see
        :meth:`~gpubudget._core.tree.Tree.fault`).
        """
        try:
            write(*args)
        except (OSError, TraceError) as exc:
            raise_if_from_outside(exc)
            self._trace_failed(exc)

    def _trace_failed(self, exc: BaseException) -> None:
        writer, self.writer = self.writer, None
        path = writer.path if writer is not None else "?"
        self.trace_error = f"trace to {path!r} stopped: {type(exc).__name__}: {exc}"
        warnings.warn(f"gpubudget: {self.trace_error}; budgets go on without it",
                      RuntimeWarning, stacklevel=user_stacklevel())


def _runs(indices: list[int]) -> Iterator[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive numbers in ``indices``.

    >>> list(_runs([7, 2, 3, 4, 9, 8]))
    [(2, 3), (7, 3)]
    """
    ordered = sorted(indices)
    start = 0
    for at in range(1, len(ordered) + 1):
        if at == len(ordered) or ordered[at] != ordered[at - 1] + 1:
            yield ordered[start], at - start
            start = at

