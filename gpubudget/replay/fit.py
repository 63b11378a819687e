"""``fit``: the smallest limit of every budget under which a trace replays without a denial,
root by root, on each root's own events."""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from ..tracefile import (
    MAX_TRACE_BYTES,
    Alloc,
    Enter,
    Exit,
    Free,
    Resize,
    Trace,
    TraceEvent,
    TraceReader,
)
from ..units import format_size, round_up
from .run import (
    PROBE_REASONS,
    ReplayError,
    Replayer,
    TraceSource,
    last_uses_of,
)

__all__ = ["Fit", "fit", "reading_progress"]
_MAX_DOUBLINGS: Final = 64
"""How often ``fit`` doubles a root's ceiling at most (the host's address space ends first)."""


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
    A replay of that search stops at its first denial, which says how much the refused
    request lacked (its size less the largest free hole, or less what the ledger had left):
    the limits below that are skipped, were everything placed as it was. That is a guess,
    checked at the end: the limit just below the one returned is replayed and denied, or
    the search bisects again without guesses. The search assumes that a larger limit never
    denies what a smaller one granted, true of best fit mostly though not always (so
    another search order can end on another limit, a little above or below); the limit
    returned was replayed without a denial, and the one an alignment below with one.

    Each root is fitted on its own events, so the cost is linear in the number of roots,
    and a replay walks no budget's chain of ancestors but the core's own.
    Results come root by root, each root before its descendants, in the order of entry.
    ``progress`` receives a short message at each replay. A last line cut short (the writing
    process was killed) is skipped, as a :class:`~gpubudget.tracefile.TraceReader` does: to
    be told, pass an open reader and read its ``cut_short`` afterwards.

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
        self.stacks = array("l")  # indexes into ``stack_list``; 0 is None
        self.strings: list[str | None] = [None]
        self._string_index: dict[str | None, int] = {None: 0}
        self.stack_list: list[tuple[str, ...] | None] = [None]
        self._stack_index: dict[tuple[str, ...] | None, int] = {None: 0}
        self.probes = False  # whether any allocation was denied for a limit
        self.resizes = False

    def __len__(self) -> int:
        return len(self.kinds)

    def _string(self, text: str | None) -> int:
        index = self._string_index.get(text)
        if index is None:
            index = self._string_index[text] = len(self.strings)
            self.strings.append(text)
        return index

    def _stack(self, stack: tuple[str, ...] | None) -> int:
        index = self._stack_index.get(stack)
        if index is None:
            index = self._stack_index[stack] = len(self.stack_list)
            self.stack_list.append(stack)
        return index

    def append(self, event: TraceEvent) -> None:
        stack = 0
        if type(event) is Alloc:
            row = (_ALLOC, event.size, event.align,
                   -1 if event.ptr is None else event.ptr, event.nbytes,
                   self._string(event.tag), self._string(event.reason))
            if event.stack is not None:
                stack = self._stack(event.stack)
            if event.ptr is None and event.reason in PROBE_REASONS:
                self.probes = True
        elif type(event) is Free:
            row = (_FREE, 0, 0, event.ptr, 0, 0, 0)
        elif type(event) is Enter:
            row = (_ENTER, len(self.enters), 0, 0, 0, 0, 0)
            self.enters.append(event)
        elif type(event) is Resize:
            row = (_RESIZE, event.size, event.align, event.ptr, event.nbytes, 0, 0)
            self.resizes = True
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
        self.stacks.append(stack)

    def __iter__(self) -> Iterator[TraceEvent]:
        strings, enters, stacks = self.strings, self.enters, self.stack_list
        make = tuple.__new__  # what the NamedTuple constructors call, without their frame
        for kind, t, budget, size, align, address, nbytes, tag, reason, stack in zip(
                self.kinds, self.times, self.budgets, self.sizes, self.aligns, self.addresses,
                self.nbytes, self.tags, self.reasons, self.stacks):
            if kind == _ALLOC:
                yield make(Alloc, (t, budget, size, align, strings[tag],
                                   None if address < 0 else address, nbytes, strings[reason],
                                   stacks[stack]))
            elif kind == _FREE:
                yield make(Free, (t, budget, address))
            elif kind == _ENTER:
                yield enters[size]
            elif kind == _RESIZE:
                yield make(Resize, (t, budget, address, size, align, nbytes))
            else:
                yield make(Exit, (t, budget))


def reading_progress(tell: Callable[[str], None]) -> Callable[[int, int], None]:
    """A :class:`~gpubudget.tracefile.TraceReader` progress callback that gives ``tell`` the
    message :func:`fit` gives while it reads a file."""
    def read_progress(lines: int, nbytes: int) -> None:
        tell(f"reading: {lines:,} lines, {format_size(nbytes)}")

    return read_progress


def _split_by_root(trace: TraceSource, max_bytes: int,
                   tell: Callable[[str], None]) -> dict[int, _TreeEvents]:
    """Each root's events (its own and its descendants'), roots in the order of entry."""
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
        with TraceReader(trace, max_bytes=max_bytes, progress=reading_progress(tell)) as reader:
            split(reader)
    return trees




def _fit_root(events: _TreeEvents, tell: Callable[[int], None]) -> list[Fit]:
    """Fit one root and its descendants on the events of that tree (see :func:`fit`)."""
    steps = 0
    last_uses = last_uses_of(events)

    def run(limits: dict[int, int], granted_peaks: bool) -> Replayer:
        nonlocal steps
        steps += 1
        tell(steps)
        replay = Replayer(limits, granted_peaks=granted_peaks, last_uses=last_uses,
                         reports=False)
        replay.run(events)
        return replay

    root = events.enters[0]
    members = [event.budget for event in events.enters]
    # Peaks counting only what was granted differ from the peaks only where probes (or a
    # resize that moves in the replay) raised them: track them apart only then.
    granted = events.probes or events.resizes
    unlimited = _unlimited(root, events, members, lambda limits: run(limits, granted))
    # What the search and the result need of it, then let it go: its budgets hold the
    # core's state for the whole tree, which the next replays rebuild.
    numbers = {bid: (member.entry, member.budget.peak if member.budget is not None else 0,
                     member.granted_peak, member.largest_probe, member.limit)
               for bid, member in unlimited.members.items()}
    del unlimited
    limits = {}
    for bid in members[1:]:
        entry, peak = numbers[bid][:2]
        limits[bid] = round_up(max(peak, entry.reserve, entry.align), entry.align)
    align = root.align
    ceiling = numbers[root.budget][4]

    def shortfall(limit: int) -> int:
        """0 if the tree replays at ``limit`` without a denial; else at least one alignment:
        how much more the request refused first lacked (see ``Replayer.missing``)."""
        nonlocal steps
        steps += 1
        tell(steps)
        limits[root.budget] = limit
        replay = Replayer(limits, last_uses=last_uses, reports=False)
        if not replay.denied(events):
            return 0
        return max(align, round_up(replay.shortfall, align))

    need = round_up(max(numbers[root.budget][1], align), align)
    low, high = _search(need, align, ceiling, shortfall, root.name)
    limits[root.budget] = high
    return [Fit(bid, entry.name, entry.parent, entry.limit, entry.align, entry.reserve,
                granted_peak if granted else peak, largest_probe, limits[bid])
            for bid, (entry, peak, granted_peak, largest_probe, _) in numbers.items()]


def _search(need: int, align: int, ceiling: int,
            shortfall: Callable[[int], int], name: str) -> tuple[int, int]:
    """The smallest limit (a multiple of ``align``, from ``need`` up to ``ceiling``) that
    ``shortfall`` grants, and the largest below it that it was seen to deny.

    Tries ``need`` (the peak: nothing below can do), then steps up, doubling, then
    bisects between the last step denied and the first granted. A denied replay says what its first refusal lacked: the limits below that are skipped, were
    everything placed as it was. That is a guess, so the limit just below the answer is
    replayed at the end, and if it is granted the bisection goes on without guesses.
    """
    low = need - align  # below the peak is always denied
    seen = low  # the largest limit replayed and denied (or ruled out by the peak)
    high, step = need, align
    while lacking := shortfall(high):  # step up, doubling, from the peak
        if high >= ceiling:
            raise ReplayError(f"budget {name!r} is denied at every limit up to "
                              f"{format_size(ceiling)}, which granted everything with its "
                              f"children unlimited: is the trace consistent?")
        seen, low = high, high + lacking - align
        high, step = min(max(high + step, low + align), ceiling), step * 2
    guessing = True
    while True:
        low = min(low, high - align)  # a guess beyond the first limit granted
        while high - low > align:  # then bisect
            middle = (low + high) // 2 // align * align
            lacking = shortfall(middle)
            if lacking:
                seen = middle
                low = middle + lacking - align if guessing else middle
            else:
                high = middle
            low = min(low, high - align)
        if low <= seen or not guessing:
            return low, high
        if shortfall(low):  # the guess held: the limit below the answer is denied
            return low, high
        guessing, low, high = False, seen, low  # it did not: bisect again, by replays only


def _unlimited(root: Enter, events: _TreeEvents, members: list[int],
               run: Callable[[dict[int, int]], Replayer]) -> Replayer:
    """A replay with every budget of the tree at one ceiling (at first the root's recorded
    limit plus its tree's largest probe), doubled until nothing is denied."""
    largest = max((e.nbytes for e in events
                   if type(e) is Alloc and e.ptr is None and e.reason in PROBE_REASONS),
                  default=0) if events.probes else 0
    ceiling = round_up(root.limit + largest, root.align)
    for doublings in range(_MAX_DOUBLINGS):
        try:
            result = run(dict.fromkeys(members, ceiling))
        except ReplayError:
            before = (f"; at {format_size(ceiling // 2)} the replay still had denials"
                      if doublings else "")
            raise ReplayError(f"cannot fit budget {root.name!r}: host memory cannot map "
                              f"{format_size(ceiling)}, even untouched{before}") from None
        if not any(member.denials for member in result.members.values()):
            return result
        ceiling *= 2
    raise ReplayError(f"cannot fit budget {root.name!r}: denied even at "  # pragma: no cover
                      f"{format_size(ceiling)}")
