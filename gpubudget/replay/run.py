"""Replaying a trace: budgets re-entered under their recorded parents, on a backend that
touches no memory and whose clock is the trace's (see the package's docstring); the loop,
and :func:`replay`."""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable
from dataclasses import replace

from ..budget import Budget
from ..adapter import hooks, separate_roots
from ..errors import BudgetError, GpuBudgetError
from ..report import BudgetReport, DoorUsage
from ..tracefile import (
    MAX_TRACE_BYTES,
    Sink,
    Alloc,
    Door,
    Enter,
    Exit,
    Free,
    Resize,
    Trace,
    TraceEvent,
    TraceReader,
)
from ..units import format_size, round_up
from .results import (
    PROBE_REASONS,
    as_recorded,
    Recorded,
    ReplayBackend,
    ReplayError,
    ReplayResult,
    TraceSource,
    with_door,
)

__all__ = ["PROBE_REASONS", "Recorded", "ReplayBackend", "ReplayError", "ReplayResult",
           "Replayer", "TraceSource", "last_uses_of", "replay"]


class _Member:
    """One recorded budget during a replay. It knows its parent, never its whole chain of
    ancestors: a chain 10,000 deep costs 10,000 members, not 50 million references."""

    __slots__ = ("entry", "limit", "parent", "budget", "open", "context", "denials",
                 "largest_probe", "granted_peak", "after_release")

    def __init__(self, entry: Enter, limit: int, parent: _Member | None) -> None:
        self.entry = entry
        self.limit = limit
        self.parent = parent
        self.budget: Budget | None = None  # None when its entry was refused
        self.open = False  # entered and not yet exited by the replay: its budget is "open"
        self.context = contextvars.Context()
        self.context.run(separate_roots)  # a replay's roots: no thread-trap warning
        self.denials = 0
        self.largest_probe = 0
        self.granted_peak = 0
        self.after_release = 0

    def note_granted(self) -> None:
        """After a change that the recording granted: raise the granted peaks of this budget
        and its ancestors (a walk up the parents, as the core's own charge walks them)."""
        member: _Member | None = self
        while member is not None:
            budget = member.budget
            if budget is not None and budget.used > member.granted_peak:
                member.granted_peak = budget.used
            member = member.parent


class _Denied(Exception):
    """Raised out of a replay that only asks whether anything is denied, at the first."""


class Replayer:
    """One replay's state: the budgets opened, and the recorded address -> replayed block.

    ``granted_peaks``: track each budget's peak counting only what the recording granted
    (see :attr:`Recorded.granted_peak`). ``stop_at_denial``: a replay that only asks
    whether anything is denied (``fit``'s search) stops at the first denial, and then
    :meth:`run` returns ``None``. ``reports``: build the roots' reports (``fit`` needs none).
    """

    def __init__(self, limits: dict[int, int], *, granted_peaks: bool = False,
                 last_uses: dict[int, int] | None = None, stop_at_denial: bool = False,
                 reports: bool = True) -> None:
        self.limits = limits
        self.granted_peaks = granted_peaks
        self.stop_at_denial = stop_at_denial
        self.reports = reports
        self.last_uses = last_uses or {}  # budget id -> index of the last event using it
        self.unpins: dict[int, list[Budget]] = {}  # event index -> budgets to unpin after it
        self.index = 0  # of the event being replayed
        self.backend = ReplayBackend()
        self.members: dict[int, _Member] = {}
        self.roots: list[int] = []
        self.blocks: dict[int, tuple[_Member, int, int]] = {}  # -> (member, address, bytes)
        self.stacks: dict[int, tuple[str, ...]] = {}  # replayed address -> recorded stack
        self.shortfall = 0  # stop_at_denial: how much more limit the refused request needed
        self.door: dict[int, Door] = {}  # budget id -> its trace's door line (the driver door)

    def run(self, events: Iterable[TraceEvent | Door]) -> ReplayResult:
        """Replay ``events`` (up to the first denial, with ``stop_at_denial``); the roots'
        reports and every budget's numbers."""
        try:
            try:
                self.play(events)
            except _Denied:
                pass
            reports = tuple(self.report(root) for root in self.roots) if self.reports else ()
            budgets = {bid: self.recorded(member) for bid, member in self.members.items()}
        finally:
            self.close()
        return ReplayResult(reports, tuple(self.roots), budgets)

    def sink(self) -> Sink | None:
        """What the C scanner replays granted allocations and frees into, as :meth:`play`
        does (see ``gpubudget/tracefile/_scan.c``): the tables, the clock, :meth:`deny`;
        ``None`` for a replay whose loop keeps count of the events (pins, granted peaks)."""
        if self.granted_peaks or self.last_uses:
            return None
        return (self.members, self.blocks, self.stacks, self.backend.clock, self.deny)

    def denied(self, events: Iterable[TraceEvent]) -> bool:
        """Whether replaying ``events`` is refused anything (stops at the first refusal, and
        :attr:`shortfall` says what the refused request lacked, 0 if unknown)."""
        self.stop_at_denial = True
        return bool(self.run(events).denials)

    def play(self, events: Iterable[TraceEvent | Door]) -> None:
        """The loop: granted allocations and frees inline (most events), the rest by
        method."""
        backend = self.backend
        unpins = self.unpins
        members = self.members
        blocks = self.blocks
        stacks = self.stacks
        granted_peaks = self.granted_peaks
        index = -1
        for event in events:
            index += 1
            backend.now = event.t
            if type(event) is Alloc:
                if event.ptr is None:
                    self.index = index
                    self.probe(event)
                else:
                    member = members[event.budget]
                    budget = member.budget
                    if budget is None or budget.state == "released":
                        self.index = index
                        self.refused_or_released(member)
                    else:
                        # With a tag, allocate reads no context variable: no context to run
                        # it in (without one it reads the current label: the member's none).
                        address = (budget.allocate(event.size, event.align, tag=event.tag)
                                   if event.tag is not None else member.context.run(
                                       budget.allocate, event.size, event.align))
                        if address is None:
                            self.deny(member, event.nbytes)
                        else:
                            blocks[event.ptr] = (member, address, event.nbytes)
                            if event.stack is not None:
                                stacks[address] = event.stack
                            if granted_peaks:
                                member.note_granted()
            elif type(event) is Free:
                found = blocks.pop(event.ptr, None)
                if found is not None and found[0].budget is not None:
                    found[0].budget.free(found[1])
                    if stacks:
                        stacks.pop(found[1], None)
            else:
                self.index = index
                if type(event) is Enter:
                    self.enter(event)
                elif type(event) is Exit:
                    self.exit(event)
                elif type(event) is Resize:
                    self.resize(event)
                elif type(event) is Door:
                    self.door[event.budget] = event  # for the reports: nothing to replay
            if unpins and index in unpins:
                for budget in unpins.pop(index):
                    hooks(budget).unpin()

    def deny(self, member: _Member, nbytes: int = 0) -> None:
        """Count a refusal of ``nbytes`` (0: an entry) by ``member``; stop the replay there
        if it only asks whether anything is refused."""
        member.denials += 1
        if self.stop_at_denial:
            self.shortfall = self.missing(nbytes) if nbytes else 0
            raise _Denied

    def missing(self, nbytes: int) -> int:
        """How much more limit the root being replayed needed to grant ``nbytes`` now, were
        everything placed as it is: less than the request minus the largest free hole (the
        one after the last block included), or the request minus what its ledger has left;
        0 where it cannot tell. ``fit`` skips the limits below that, and checks the limit
        it returns still. (The root is the last entered: ``fit`` replays one tree.)"""
        root = self.members[self.roots[-1]] if self.roots else None
        start = self.backend.reserved_at
        if root is None or root.budget is None or start is None:
            return 0
        align = root.entry.align
        base = round_up(start, align)
        ends = sorted((address, size) for _, address, size in self.blocks.values())
        largest = at = 0
        for address, size in ends:
            largest = max(largest, address - base - at)
            at = max(at, address - base + size)
        largest = max(largest, round_up(root.limit, align) - at)
        short = nbytes - largest
        over = root.budget.used + nbytes - root.limit
        if over > 0:
            short = over if short <= 0 else min(short, over)
        return max(short, 0)

    def report(self, root: int) -> BudgetReport:
        budget = self.members[root].budget
        assert budget is not None  # a root whose entry fails ends the replay
        recorded = {address: ptr for ptr, (_, address, _) in self.blocks.items()}
        report = as_recorded(budget.report(), recorded, self.stacks)
        door = {member.budget: DoorUsage.from_trace(line) for bid, line in self.door.items()
                if (member := self.members.get(bid)) is not None  # events cut down: not
                and member.budget is not None}  # every door line's budget is replayed
        return with_door(report, budget, door) if door else report

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
                hooks(budget).unpin()
        self.unpins.clear()
        for member, address, _ in self.blocks.values():
            if member.budget is not None:
                member.budget.free(address)
        self.blocks.clear()
        for member in reversed(list(self.members.values())):
            if member.budget is not None and member.budget.state == "open":
                member.context.run(member.budget.__exit__, None, None, None)

    def enter(self, event: Enter) -> None:
        limit = self.limits.get(event.budget, event.limit)
        parent = self.members.get(event.parent) if event.parent is not None else None
        member = self.members[event.budget] = _Member(event, limit, parent)
        if parent is None:
            self.roots.append(event.budget)
        elif parent.budget is None:
            self.deny(member)  # its parent could not be opened
            return
        # A replay is never traced (trace=False), even where GPUBUDGET_TRACE asks every root
        # to be: that could be the very file being read.
        budget = Budget(limit, align=event.align, name=event.name,
                        reserve=min(event.reserve, limit) or None,
                        backend=self.backend if parent is None else None,
                        parent=parent.budget if parent is not None else None,
                        trace=False if parent is None else None)
        try:
            member.context.run(budget.__enter__)
        except BudgetError as exc:
            if parent is None:
                raise ReplayError(f"cannot replay root budget {event.name!r}: its limit of "
                                  f"{format_size(limit)} cannot be mapped in host memory, "
                                  f"even untouched ({exc})") from None
            self.deny(member)  # its reserve did not fit in its parent
            return
        except GpuBudgetError:
            self.deny(member)
            return
        member.budget = budget
        member.open = True
        if self.granted_peaks and parent is not None:
            parent.note_granted()  # its reserve, set aside in its ancestors
        last = self.last_uses.get(event.budget, -1)
        if last > self.index:  # see replay(): kept from release until its last use
            hooks(budget).pin()
            self.unpins.setdefault(last, []).append(budget)

    def refused_or_released(self, member: _Member) -> None:
        """An allocation through a budget whose entry was refused, or already released."""
        if member.budget is None:
            self.deny(member)
        else:  # see replay(): kept alive in the recording
            member.after_release += 1

    def probe(self, event: Alloc) -> None:
        """A request the recording denied: allocated and freed at once, if a limit denied
        it (see the module docstring)."""
        if event.reason not in PROBE_REASONS:
            return  # not a matter of limits: see the module docstring
        member = self.members[event.budget]
        if event.nbytes > member.largest_probe:
            member.largest_probe = event.nbytes
        budget = member.budget
        if budget is None or budget.state == "released":
            self.refused_or_released(member)
            return
        address = member.context.run(budget.allocate, event.size, event.align, tag=event.tag)
        if address is None:
            self.deny(member, event.nbytes)
        else:
            budget.free(address)

    def resize(self, event: Resize) -> None:
        found = self.blocks.get(event.ptr)
        if found is None or found[0].budget is None:
            return  # its allocation was denied in this replay: counted there
        member, address, _ = found
        assert member.budget is not None
        moved = member.budget.resize(address, event.size, event.align)
        if moved is None:
            self.deny(self.members[event.budget], event.nbytes)
        else:
            self.blocks[event.ptr] = (member, moved, event.nbytes)
            if moved != address and address in self.stacks:
                self.stacks[moved] = self.stacks.pop(address)
            if self.granted_peaks:
                member.note_granted()

    def exit(self, event: Exit) -> None:
        member = self.members[event.budget]
        member.open = False
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
        replayer = Replayer(limits or {}, last_uses=last_uses_of(trace.events))
        replayer.door = {line.budget: line for line in trace.door}
        return replayer.run(trace.events)
    replayer = Replayer(limits or {})
    if isinstance(trace, TraceReader):
        return replace(replayer.run(trace.events(sink=replayer.sink(), door=True)),
                       cut_short=trace.cut_short)
    with TraceReader(trace, max_bytes=max_bytes, progress=progress) as reader:
        return replace(replayer.run(reader.events(sink=replayer.sink(), door=True)),
                       cut_short=reader.cut_short)

def last_uses_of(events: Iterable[TraceEvent]) -> dict[int, int]:
    """Budget id -> the index of the last event that allocates through it (a granted
    allocation, a probe, a resize)."""
    last: dict[int, int] = {}
    for index, event in enumerate(events):
        if type(event) is Resize or (type(event) is Alloc and (
                event.ptr is not None or event.reason in PROBE_REASONS)):
            last[event.budget] = index
    return last
