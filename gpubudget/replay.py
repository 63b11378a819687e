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

A file is read as a stream (:class:`~gpubudget.tracefile.TraceReader`): ``replay`` holds
the budgets and the blocks live at once, never the whole trace. ``fit`` keeps each root's
events in memory (in flat arrays, about 60 bytes an event) while it searches that root's
limit.
"""

from __future__ import annotations

import contextvars
import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Final, Union

from .backends.host import HostBackend
from .budget import TRACE_ENV, Budget
from .errors import BudgetError, GpuBudgetError
from .report import BudgetReport
from .tracefile import (
    LIMIT_REASONS,
    MAX_TRACE_BYTES,
    Alloc,
    Enter,
    Exit,
    Free,
    Resize,
    Trace,
    TraceError,
    TraceEvent,
    TraceReader,
)
from .units import format_size, round_up

__all__ = [
    "PROBE_REASONS",
    "Fit",
    "Recorded",
    "ReplayBackend",
    "ReplayError",
    "ReplayResult",
    "fit",
    "replay",
]

PROBE_REASONS: Final = LIMIT_REASONS
"""Denial reasons whose requests are replayed as probes (a larger limit would grant them)."""
_MAX_DOUBLINGS: Final = 64
"""How often ``fit`` doubles a root's ceiling at most (the host's address space ends first)."""

TraceSource = Union[Trace, TraceReader, str, "os.PathLike[str]"]
"""What ``replay`` and ``fit`` read: a trace in memory, an open reader, or a file name."""


class ReplayError(TraceError):
    """A valid trace that cannot be replayed or fitted here (a limit larger than the host's
    address space can map, even untouched)."""


class ReplayBackend(HostBackend):
    """Host memory mapped without reserving it, whose clock is the trace's.

    The replay sets :attr:`now` to each event's recorded ``t`` before repeating it; budgets
    on this backend stamp their timelines with :meth:`clock`, so a replay's report keeps the
    recorded times.
    """

    def __init__(self) -> None:
        super().__init__(noreserve=True)
        self.now = 0.0
        """The ``t`` of the event being replayed, in seconds."""

    def clock(self) -> float:
        """The recorded time of the event being replayed."""
        return self.now


@dataclass(frozen=True)
class Recorded:
    """One budget of a trace: as recorded, and what its replay did."""

    id: int
    name: str
    parent: int | None
    limit: int
    """The limit used in the replay (the recorded one unless overridden)."""
    recorded_limit: int
    reserve: int
    align: int
    entered_at: float
    """The ``t`` of its entry, seconds since the trace began."""
    peak: int = 0
    """Its peak ``used`` in the replay, probes included."""
    granted_peak: int = 0
    """Its peak ``used`` counting only what the recording granted (``fit`` computes it;
    ``replay`` leaves 0)."""
    largest_probe: int = 0
    """The largest request it was denied in the recording (replayed as a probe), 0 if none."""
    denials: int = 0
    """Requests refused in the replay (its own, and its entry if that was refused)."""
    after_release: int = 0
    """Allocations skipped because the budget was already released in the replay (see
    :func:`replay`)."""


@dataclass(frozen=True)
class ReplayResult:
    """What a replay produced: one report per root budget, and every budget by id."""

    reports: tuple[BudgetReport, ...]
    """The root budgets' reports, in the order they were entered."""
    roots: tuple[int, ...]
    """The root budgets' ids, in the same order."""
    budgets: dict[int, Recorded]
    cut_short: str | None = None
    """Set when the trace's last line was cut short and skipped (see ``TraceReader``)."""

    @property
    def denials(self) -> dict[int, int]:
        """Budget id -> requests refused in the replay, for the budgets that refused any."""
        return {bid: b.denials for bid, b in self.budgets.items() if b.denials}

    @property
    def after_release(self) -> int:
        """Allocations skipped because their budget was already released in the replay."""
        return sum(b.after_release for b in self.budgets.values())

    def root_of(self, budget: int) -> int:
        """The id of the root of ``budget``'s tree."""
        while (parent := self.budgets[budget].parent) is not None:
            budget = parent
        return budget


class _Member:
    """One recorded budget during a replay."""

    __slots__ = ("entry", "limit", "chain", "budget", "context", "denials", "largest_probe",
                 "granted_peak", "after_release")

    def __init__(self, entry: Enter, limit: int, chain: tuple[_Member, ...]) -> None:
        self.entry = entry
        self.limit = limit
        self.chain = (self,) + chain  # itself, then its ancestors
        self.budget: Budget | None = None  # None when its entry was refused
        self.context = contextvars.Context()
        self.denials = 0
        self.largest_probe = 0
        self.granted_peak = 0
        self.after_release = 0

    def note_granted(self) -> None:
        """After a change that the recording granted: raise the chain's granted peaks."""
        for member in self.chain:
            if member.budget is not None and member.budget.used > member.granted_peak:
                member.granted_peak = member.budget.used


class _Replay:
    """One replay's state: the budgets opened, and the recorded address -> replayed block."""

    def __init__(self, limits: dict[int, int], *, granted_peaks: bool = False,
                 last_uses: dict[int, int] | None = None) -> None:
        self.limits = limits
        self.granted_peaks = granted_peaks
        self.last_uses = last_uses or {}  # budget id -> index of the last event using it
        self.unpins: dict[int, list[Budget]] = {}  # event index -> budgets to unpin after it
        self.index = 0  # of the event being replayed
        self.backend = ReplayBackend()
        # A replay is never traced, even where GPUBUDGET_TRACE asks every root to be: that
        # could be the very file being read. No trace= means that variable's file, so the
        # replay's roots write theirs to the null device when it is set.
        self.trace = os.devnull if os.environ.get(TRACE_ENV) else None
        self.members: dict[int, _Member] = {}
        self.roots: list[int] = []
        self.blocks: dict[int, tuple[_Member, int]] = {}

    def run(self, events: Iterable[TraceEvent]) -> ReplayResult:
        backend = self.backend
        unpins = self.unpins
        try:
            for index, event in enumerate(events):
                self.index = index
                backend.now = event.t
                if type(event) is Alloc:  # the most frequent first
                    self.alloc(event)
                elif type(event) is Free:
                    self.free(event)
                elif type(event) is Enter:
                    self.enter(event)
                elif type(event) is Exit:
                    self.exit(event)
                elif type(event) is Resize:
                    self.resize(event)
                if unpins and index in unpins:
                    for budget in unpins.pop(index):
                        budget.unpin()
            reports = tuple(self.report(root) for root in self.roots)
            budgets = {bid: self.recorded(member) for bid, member in self.members.items()}
        finally:
            self.close()
        return ReplayResult(reports, tuple(self.roots), budgets)

    def report(self, root: int) -> BudgetReport:
        budget = self.members[root].budget
        assert budget is not None  # a root whose entry fails ends the replay
        return budget.report()

    @staticmethod
    def recorded(member: _Member) -> Recorded:
        entry = member.entry
        return Recorded(entry.budget, entry.name, entry.parent, member.limit, entry.limit,
                        entry.reserve, entry.align, entry.t,
                        member.budget.peak if member.budget is not None else 0,
                        member.granted_peak, member.largest_probe, member.denials,
                        member.after_release)

    def close(self) -> None:
        """Give the host mappings back: unpin, free what is live, exit what is open."""
        for budgets in self.unpins.values():
            for budget in budgets:
                budget.unpin()
        self.unpins.clear()
        for member, address in self.blocks.values():
            if member.budget is not None:
                member.budget.free(address)
        self.blocks.clear()
        for member in reversed(list(self.members.values())):
            if member.budget is not None and member.budget.state == "open":
                member.context.run(member.budget.__exit__, None, None, None)

    def enter(self, event: Enter) -> None:
        limit = self.limits.get(event.budget, event.limit)
        parent = self.members.get(event.parent) if event.parent is not None else None
        member = self.members[event.budget] = _Member(
            event, limit, parent.chain if parent is not None else ())
        if parent is None:
            self.roots.append(event.budget)
        elif parent.budget is None:
            member.denials += 1  # its parent could not be opened
            return
        budget = Budget(limit, align=event.align, name=event.name,
                        reserve=min(event.reserve, limit) or None,
                        backend=self.backend if parent is None else None,
                        parent=parent.budget if parent is not None else None,
                        trace=self.trace if parent is None else None)
        try:
            member.context.run(budget.__enter__)
        except BudgetError as exc:
            if parent is None:
                raise ReplayError(f"cannot replay root budget {event.name!r}: its limit of "
                                  f"{format_size(limit)} cannot be mapped in host memory, "
                                  f"even untouched ({exc})") from None
            member.denials += 1  # its reserve did not fit in its parent
            return
        except GpuBudgetError:
            member.denials += 1
            return
        member.budget = budget
        if self.granted_peaks and parent is not None:
            parent.note_granted()  # its reserve, set aside in its ancestors
        last = self.last_uses.get(event.budget, -1)
        if last > self.index:  # see replay(): kept from release until its last use
            budget.pin()
            self.unpins.setdefault(last, []).append(budget)

    def alloc(self, event: Alloc) -> None:
        probe = event.ptr is None
        if probe and event.reason not in PROBE_REASONS:
            return  # not a matter of limits: see the module docstring
        member = self.members[event.budget]
        if probe and event.nbytes > member.largest_probe:
            member.largest_probe = event.nbytes
        budget = member.budget
        if budget is None:
            member.denials += 1
            return
        if budget.state == "released":  # see replay(): kept alive in the recording
            member.after_release += 1
            return
        address = member.context.run(budget.allocate, event.size, event.align, tag=event.tag)
        if address is None:
            member.denials += 1
        elif probe:
            budget.free(address)
        else:
            assert event.ptr is not None
            self.blocks[event.ptr] = (member, address)
            if self.granted_peaks:
                member.note_granted()

    def free(self, event: Free) -> None:
        found = self.blocks.pop(event.ptr, None)
        if found is not None and found[0].budget is not None:
            found[0].budget.free(found[1])

    def resize(self, event: Resize) -> None:
        found = self.blocks.get(event.ptr)
        if found is None or found[0].budget is None:
            return  # its allocation was denied in this replay: counted there
        member, address = found
        assert member.budget is not None
        moved = member.budget.resize(address, event.size, event.align)
        if moved is None:
            self.members[event.budget].denials += 1
        else:
            self.blocks[event.ptr] = (member, moved)
            if self.granted_peaks:
                member.note_granted()

    def exit(self, event: Exit) -> None:
        member = self.members[event.budget]
        if member.budget is not None and member.budget.state == "open":
            member.context.run(member.budget.__exit__, None, None, None)


def replay(
    trace: TraceSource,
    *,
    limits: dict[int, int] | None = None,
    max_bytes: int = MAX_TRACE_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayResult:
    """Replay ``trace`` in host memory and return each root's report.

    A budget is released once its scope has exited, no block is live and nothing pins it
    (a TensorRT runtime or engine); pins are not in the trace. So that an allocation the
    recording granted after such a moment (an engine making an execution context later)
    is replayed, a trace held in memory (a :class:`~gpubudget.tracefile.Trace`, and every
    replay of :func:`fit`) pins each budget until the last event that allocates through it.
    A trace read as a stream cannot look ahead: such allocations are skipped and counted
    in :attr:`ReplayResult.after_release`.

    Parameters
    ----------
    trace
        A :class:`~gpubudget.tracefile.Trace`, an open
        :class:`~gpubudget.tracefile.TraceReader`, or a file name (``"-"``: standard input),
        read as a stream.
    limits
        Budget id -> limit to use instead of the recorded one.
    max_bytes, progress
        Passed to the :class:`~gpubudget.tracefile.TraceReader` that reads a file name.

    Raises
    ------
    TraceError
        The file is not a valid trace (one line naming the file, the line and the problem).
    ReplayError
        A root's limit cannot be mapped in this host's address space.

    Examples
    --------
    >>> import os, tempfile
    >>> from gpubudget import gpu_budget
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with gpu_budget("1MiB", name="pool", backend="host", trace=path) as pool:
    ...     block = pool.allocate(100_000, tag="weights")
    ...     pool.allocate(2**21) is None
    True
    >>> (report,) = replay(path).reports
    >>> report.name, report.peak, report.denied, report.by_tag[0].tag
    ('pool', 100096, 1, 'weights')
    """
    if isinstance(trace, Trace):
        return _Replay(limits or {}, last_uses=_last_uses(trace.events)).run(trace.events)
    run = _Replay(limits or {}).run
    if isinstance(trace, TraceReader):
        return replace(run(trace), cut_short=trace.cut_short)
    with TraceReader(trace, max_bytes=max_bytes, progress=progress) as reader:
        return replace(run(reader), cut_short=reader.cut_short)


@dataclass(frozen=True)
class Fit:
    """The fitted limit of one recorded budget."""

    budget: int
    name: str
    parent: int | None
    recorded_limit: int
    align: int
    reserve: int
    peak: int
    """Its peak ``used`` counting only what the recording granted: at most its recorded
    limit."""
    largest_denied: int
    """The largest request the recording denied it (aligned bytes), 0 if none: replayed as
    a probe, so the fitted limit grants it."""
    limit: int
    """The smallest limit under which the replay has no denial (see :func:`fit`)."""


def fit(
    trace: TraceSource,
    *,
    max_bytes: int = MAX_TRACE_BYTES,
    progress: Callable[[str], None] | None = None,
) -> list[Fit]:
    """The smallest limit for every budget of ``trace`` under which replay has no denial.

    A child's limit only counts bytes, so its smallest limit is its peak ``used`` (at least
    its reserve and its alignment), probes included, in a replay that nothing limits. A
    root's limit is also the size of the arena its tree is placed in, so fragmentation can
    ask for more than the peak: with its children at their fitted limits, the root is tried
    at its peak, then at growing steps above it (1, 2, 4... alignments), then by bisection
    between the last step denied and the first granted, over multiples of its alignment.
    The search assumes that a larger limit never denies what a smaller one granted, true of
    best fit in practice though not guaranteed; the limit returned was replayed without a
    denial.

    Each root is fitted on its own events, so the cost is linear in the number of roots.
    Results come root by root, each root before its descendants, in the order of entry.
    ``progress`` receives a short message at each replay.

    Raises
    ------
    TraceError
        The file is not a valid trace.
    ReplayError
        The trace holds no budget, or a root would need more than the host can map.

    Examples
    --------
    >>> import os, tempfile
    >>> from gpubudget import gpu_budget
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with gpu_budget("16MiB", name="pool", backend="host", trace=path):
    ...     with gpu_budget("8MiB", name="model") as model:
    ...         a, b = model.allocate(2**20), model.allocate(2**20)
    ...         _ = model.free(a)
    ...         c = model.allocate(2**21)          # cannot use a's hole: fragmentation
    >>> [(f.name, f.peak, f.limit) for f in fit(path)]
    [('pool', 3145728, 4194304), ('model', 3145728, 3145728)]
    """
    tell = progress if progress is not None else _quiet
    trees = _split_by_root(trace, max_bytes, tell)
    if not trees:
        raise ReplayError(f"{_source_name(trace)}: the trace holds no budget")
    found: list[Fit] = []
    for number, events in enumerate(trees.values(), start=1):
        label = f"fitting root {number} of {len(trees)} ({events.enters[0].name!r}): replay"
        found += _fit_root(events, _Steps(label, tell))
    return found


class _Steps:
    """Tells ``progress`` which replay of which root is running."""

    def __init__(self, label: str, tell: Callable[[str], None]) -> None:
        self.label = label
        self.tell = tell

    def __call__(self, step: int) -> None:
        self.tell(f"{self.label} {step}")


def _quiet(message: str) -> None:
    return None


def _source_name(trace: TraceSource) -> str:
    if isinstance(trace, Trace):
        return "trace"
    return trace.name if isinstance(trace, TraceReader) else os.fspath(trace)


_ENTER, _ALLOC, _FREE, _RESIZE, _EXIT = range(5)
"""The kinds of event, as ``_TreeEvents`` stores them."""


class _TreeEvents:
    """One tree's events in flat arrays: about 60 bytes an event, where tuples take ~300.

    ``fit`` replays each tree many times; this is what it holds meanwhile. Iterating gives
    the events back as :data:`~gpubudget.tracefile.TraceEvent` tuples.
    """

    def __init__(self) -> None:
        self.enters: list[Enter] = []  # few: kept as they are
        self.kinds = array("b")
        self.times = array("d")
        self.budgets = array("q")
        self.sizes = array("q")  # size; the index of an Enter in ``enters``
        self.aligns = array("q")
        self.addresses = array("q")  # -1 for none (addresses are >= 0)
        self.nbytes = array("q")
        self.tags = array("l")  # indexes into ``strings``; 0 is None
        self.reasons = array("l")
        self.strings: list[str | None] = [None]
        self._string_index: dict[str | None, int] = {None: 0}

    def __len__(self) -> int:
        return len(self.kinds)

    def _string(self, text: str | None) -> int:
        index = self._string_index.get(text)
        if index is None:
            index = self._string_index[text] = len(self.strings)
            self.strings.append(text)
        return index

    def append(self, event: TraceEvent) -> None:
        if type(event) is Alloc:
            row = (_ALLOC, event.size, event.align,
                   -1 if event.ptr is None else event.ptr, event.nbytes,
                   self._string(event.tag), self._string(event.reason))
        elif type(event) is Free:
            row = (_FREE, 0, 0, event.ptr, 0, 0, 0)
        elif type(event) is Enter:
            row = (_ENTER, len(self.enters), 0, 0, 0, 0, 0)
            self.enters.append(event)
        elif type(event) is Resize:
            row = (_RESIZE, event.size, event.align, event.ptr, event.nbytes, 0, 0)
        else:
            row = (_EXIT, 0, 0, 0, 0, 0, 0)
        kind, size, align, address, nbytes, tag, reason = row
        self.kinds.append(kind)
        self.times.append(event.t)
        self.budgets.append(event.budget)
        self.sizes.append(size)
        self.aligns.append(align)
        self.addresses.append(address)
        self.nbytes.append(nbytes)
        self.tags.append(tag)
        self.reasons.append(reason)

    def __iter__(self) -> Iterator[TraceEvent]:
        strings, enters = self.strings, self.enters
        make = tuple.__new__  # what the NamedTuple constructors call, without their frame
        for kind, t, budget, size, align, address, nbytes, tag, reason in zip(
                self.kinds, self.times, self.budgets, self.sizes, self.aligns, self.addresses,
                self.nbytes, self.tags, self.reasons):
            if kind == _ALLOC:
                yield make(Alloc, (t, budget, size, align, strings[tag],
                                   None if address < 0 else address, nbytes, strings[reason]))
            elif kind == _FREE:
                yield make(Free, (t, budget, address))
            elif kind == _ENTER:
                yield enters[size]
            elif kind == _RESIZE:
                yield make(Resize, (t, budget, address, size, align, nbytes))
            else:
                yield make(Exit, (t, budget))


def _split_by_root(trace: TraceSource, max_bytes: int,
                   tell: Callable[[str], None]) -> dict[int, _TreeEvents]:
    """Each root's events (its own and its descendants'), roots in the order of entry."""
    def read_progress(lines: int, nbytes: int) -> None:
        tell(f"reading: {lines:,} lines, {format_size(nbytes)}")

    trees: dict[int, _TreeEvents] = {}
    root_of: dict[int, int] = {}

    def split(events: Iterable[TraceEvent]) -> None:
        for event in events:
            if type(event) is Enter:
                root = root_of[event.parent] if event.parent is not None else event.budget
                root_of[event.budget] = root
                if root not in trees:
                    trees[root] = _TreeEvents()
                trees[root].append(event)
            else:
                trees[root_of[event.budget]].append(event)

    if isinstance(trace, (Trace, TraceReader)):
        split(trace.events if isinstance(trace, Trace) else trace)
    else:
        with TraceReader(trace, max_bytes=max_bytes, progress=read_progress) as reader:
            split(reader)
    return trees


def _last_uses(events: Iterable[TraceEvent]) -> dict[int, int]:
    """Budget id -> the index of the last event that allocates through it (a granted
    allocation, a probe, a resize)."""
    last: dict[int, int] = {}
    for index, event in enumerate(events):
        if type(event) is Resize or (type(event) is Alloc and (
                event.ptr is not None or event.reason in PROBE_REASONS)):
            last[event.budget] = index
    return last


def _fit_root(events: _TreeEvents, tell: Callable[[int], None]) -> list[Fit]:
    """Fit one root and its descendants on the events of that tree (see :func:`fit`)."""
    steps = 0
    last_uses = _last_uses(events)

    def run(limits: dict[int, int], granted_peaks: bool = False) -> ReplayResult:
        nonlocal steps
        steps += 1
        tell(steps)
        return _Replay(limits, granted_peaks=granted_peaks, last_uses=last_uses).run(events)

    root = events.enters[0]
    members = [event.budget for event in events.enters]
    free = _unlimited(root, events, members, run)
    limits = {}
    for bid in members[1:]:
        child = free.budgets[bid]
        limits[bid] = round_up(max(child.peak, child.reserve, child.align), child.align)
    align = root.align
    ceiling = free.budgets[root.budget].limit

    def denied(limit: int) -> bool:
        limits[root.budget] = limit
        return bool(run(limits).denials)

    need = round_up(max(free.budgets[root.budget].peak, align), align)
    low, high, step = need - align, need, align  # below the peak is always denied
    while denied(high):  # step up, doubling, from the peak
        if high >= ceiling:
            raise ReplayError(f"budget {root.name!r} is denied at every limit up to "
                              f"{format_size(ceiling)}, which granted everything with its "
                              f"children unlimited: is the trace consistent?")
        low, high, step = high, min(high + step, ceiling), step * 2
    while high - low > align:  # then bisect
        middle = (low + high) // 2 // align * align
        if denied(middle):
            low = middle
        else:
            high = middle
    limits[root.budget] = high
    return [Fit(bid, b.name, b.parent, b.recorded_limit, b.align, b.reserve, b.granted_peak,
                b.largest_probe, limits[bid])
            for bid, b in free.budgets.items()]


def _unlimited(root: Enter, events: _TreeEvents, members: list[int],
               run: Callable[[dict[int, int], bool], ReplayResult]) -> ReplayResult:
    """A replay with every budget of the tree at one ceiling (at first the root's recorded
    limit plus its tree's largest probe), doubled until nothing is denied."""
    largest = max((e.nbytes for e in events
                   if type(e) is Alloc and e.ptr is None and e.reason in PROBE_REASONS),
                  default=0)
    ceiling = round_up(root.limit + largest, root.align)
    for doublings in range(_MAX_DOUBLINGS):
        try:
            result = run(dict.fromkeys(members, ceiling), True)
        except ReplayError:
            before = (f"; at {format_size(ceiling // 2)} the replay still had denials"
                      if doublings else "")
            raise ReplayError(f"cannot fit budget {root.name!r}: host memory cannot map "
                              f"{format_size(ceiling)}, even untouched{before}") from None
        if not result.denials:
            return result
        ceiling *= 2
    raise ReplayError(f"cannot fit budget {root.name!r}: denied even at "  # pragma: no cover
                      f"{format_size(ceiling)}")
