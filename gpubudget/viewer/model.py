"""What the viewer and the Perfetto export draw, taken from a trace or a report: the budgets,
every change of a budget's ``used`` (a *point*), every block's life, and the denials.

A trace gives everything: points for a budget and all its ancestors at each event, blocks
from their allocation to their free, with their stacks where the trace carries them. A
report gives its timeline (``EVENT_LOG_LIMIT`` events at most): a budget's points at its own
events (the root's at every event), and its blocks only as they were when it was taken.
:mod:`~gpubudget.viewer.tracemodel` reads a trace into this model; a PyTorch memory snapshot
gives its own (:mod:`~gpubudget.viewer.torchsnap`).

Every event that changes something gets an index into :attr:`ViewModel.times` (its time,
never earlier than the one before: threads may write a trace slightly out of order); points
and blocks name their events by index as well as by time, which is what the page carries.
Each root's *region* is the address range its blocks sit in: where a trace records where a
root's memory starts (its ``enter`` line's ``base``), that and the root's range; else (a
report, a trace written before roots said so) it is taken to start at the lowest address any
of its blocks had (the first block of a fresh arena sits at its start) and to span the root's
limit. A growable root's trace also says which granules it had mapped when (``map`` and
``unmap`` lines): each run of them mapped is a *mapping* over the events it lasted.

Columns are kept in ``array`` objects (8 bytes a number), so a trace of a million events
costs tens of megabytes here, not hundreds.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..units import format_size

if TYPE_CHECKING:
    from ..report import DoorUsage
    from ..report import BudgetReport

__all__ = ["UNKNOWN", "ViewBudget", "ViewModel", "model_from_report"]

_NO_TAG = -1
UNKNOWN = -1  # an event index not known (yet): a block still live, a root still open
"""An event index where there is none: a block allocated before the record began, or one
still live at its end; a region that spans the whole record."""


@dataclass
class ViewBudget:
    """One budget: as entered, and its counts."""

    name: str
    parent: int | None
    """Index of its parent in :attr:`ViewModel.budgets`."""
    limit: int
    """Its limit; 0 where there is none (a PyTorch snapshot's device)."""
    reserve: int
    entered: float
    exited: float | None = None
    peak: int = 0
    allocations: int = 0
    frees: int = 0
    denied: int = 0
    door: DoorUsage | None = None
    """Under the driver door (a report taken in ``gpubudget run``): what libraries took
    through it in the budget's scope, by library, and its refusals."""


@dataclass
class ViewModel:
    """Budgets, points, blocks and denials; times in seconds since the first event."""

    title: str
    source: str
    """``trace``, ``report`` or ``torch`` (a PyTorch snapshot): how complete the blocks
    are, and what ``used`` means (see the module docstring)."""
    budgets: list[ViewBudget] = field(default_factory=list)
    times: array[float] = field(default_factory=lambda: array("d"))
    """The time of each event, in order (never decreasing)."""
    point_t: array[float] = field(default_factory=lambda: array("d"))
    point_at: array[int] = field(default_factory=lambda: array("l"))
    """The event (index into :attr:`times`) of each point."""
    point_budget: array[int] = field(default_factory=lambda: array("l"))
    point_used: array[float] = field(default_factory=lambda: array("d"))
    """The budget's ``used`` after the change (children's and reserves included); for a
    PyTorch snapshot, the bytes its caching allocator had reserved from the device."""
    point_own: array[float] = field(default_factory=lambda: array("d"))
    """Bytes of the budget's own blocks after the change."""
    block_budget: array[int] = field(default_factory=lambda: array("l"))
    block_size: array[float] = field(default_factory=lambda: array("d"))
    block_tag: array[int] = field(default_factory=lambda: array("l"))
    block_address: array[float] = field(default_factory=lambda: array("d"))
    block_start: array[float] = field(default_factory=lambda: array("d"))
    """When the block was allocated; NaN where unknown (a report's older blocks)."""
    block_end: array[float] = field(default_factory=lambda: array("d"))
    """When it was freed; NaN while live at the end."""
    block_from: array[int] = field(default_factory=lambda: array("l"))
    """The event of its allocation, -1 where unknown."""
    block_to: array[int] = field(default_factory=lambda: array("l"))
    """The event of its free, -1 while live at the end."""
    block_stack: array[int] = field(default_factory=lambda: array("l"))
    block_requested: array[float] = field(default_factory=lambda: array("d"))
    """The bytes asked for, before rounding to the block's size; -1 where not known."""
    block_stream: array[int] = field(default_factory=lambda: array("l"))
    """The CUDA stream the block was allocated on (a PyTorch snapshot's); 0 where the
    record does not say (a trace, a report)."""
    denials: list[tuple[float, int, int, str, int]] = field(default_factory=list)
    """``(t, budget, bytes, reason, tag)``."""
    regions: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """``(root, address, bytes, from, to)``: address ranges a root's blocks sit in, from
    event ``from`` to event ``to`` (-1: from the start, to the end)."""
    mappings: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    """``(root, address, bytes, from, to)``: runs of a growable root's granules mapped, as
    :attr:`regions` (a trace's growable roots only)."""
    tags: list[str] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)
    stacks: list[list[int]] = field(default_factory=list)
    """Each a list of frame indices, outermost first."""
    end: float = 0.0
    """The time of the last event (a denial's included)."""
    time_unit: str = "s"
    """``s``, or ``event`` where the record has no clock (times are event numbers)."""
    notes: list[str] = field(default_factory=list)
    """Sentences the page shows about where the data came from."""
    _tag_ids: dict[str, int] = field(default_factory=dict, repr=False)
    _frame_ids: dict[str, int] = field(default_factory=dict, repr=False)
    _stack_ids: dict[tuple[int, ...], int] = field(default_factory=dict, repr=False)

    def tag_id(self, tag: str | None) -> int:
        if tag is None:
            return _NO_TAG
        found = self._tag_ids.get(tag)
        if found is None:
            found = self._tag_ids[tag] = len(self.tags)
            self.tags.append(tag)
        return found

    def stack_id(self, stack: Iterable[str] | None) -> int:
        """The index of ``stack`` (frames interned), -1 for none."""
        if not stack:
            return -1
        frames = []
        for frame in stack:
            found = self._frame_ids.get(frame)
            if found is None:
                found = self._frame_ids[frame] = len(self.frames)
                self.frames.append(frame)
            frames.append(found)
        key = tuple(frames)
        index = self._stack_ids.get(key)
        if index is None:
            index = self._stack_ids[key] = len(self.stacks)
            self.stacks.append(frames)
        return index

    def tick(self, t: float) -> int:
        """A new event at ``t`` (raised to the last event's time if earlier): its index."""
        times = self.times
        if times and t < times[-1]:
            t = times[-1]
        times.append(t)
        return len(times) - 1

    def point(self, at: int, budget: int, used: int, own: int) -> None:
        self.point_t.append(self.times[at])
        self.point_at.append(at)
        self.point_budget.append(budget)
        self.point_used.append(used)
        self.point_own.append(own)
        member = self.budgets[budget]
        if used > member.peak:
            member.peak = used

    def block(self, budget: int, size: int, tag: int, address: int, at: int,
              stack: int, requested: int = -1, stream: int = 0) -> int:
        """A block allocated at event ``at`` (-1: before the record began): its index;
        ``requested`` the bytes asked for (-1: not known), ``stream`` its stream."""
        self.block_budget.append(budget)
        self.block_size.append(size)
        self.block_tag.append(tag)
        self.block_address.append(address)
        self.block_start.append(self.times[at] if at >= 0 else math.nan)
        self.block_end.append(math.nan)
        self.block_from.append(at)
        self.block_to.append(UNKNOWN)
        self.block_stack.append(stack)
        self.block_requested.append(requested)
        self.block_stream.append(stream)
        return len(self.block_budget) - 1

    def end_block(self, block: int, at: int) -> None:
        """Block ``block`` was freed at event ``at``."""
        self.block_end[block] = self.times[at]
        self.block_to[block] = at

    def root_of(self, budget: int) -> int:
        while (parent := self.budgets[budget].parent) is not None:
            budget = parent
        return budget

    def infer_regions(self, spans: dict[int, tuple[int, int]]) -> None:
        """One region per root that has blocks and none yet: from its lowest block address,
        its limit long (or to its highest block end, if further), over ``spans[root]``
        (events)."""
        known = {region[0] for region in self.regions}
        low: dict[int, float] = {}
        high: dict[int, float] = {}
        roots = [self.root_of(b) for b in range(len(self.budgets))]
        for budget, address, size in zip(self.block_budget, self.block_address,
                                         self.block_size):
            if address < 0:  # not known (a report's block freed before it was taken)
                continue
            root = roots[budget]
            if root in known:
                continue
            if address < low.get(root, math.inf):
                low[root] = address
            if address + size > high.get(root, -math.inf):
                high[root] = address + size
        for root, base in sorted(low.items()):
            size = max(self.budgets[root].limit, int(high[root] - base))
            first, last = spans.get(root, (UNKNOWN, UNKNOWN))
            self.regions.append((root, int(base), size, first, last))

    @property
    def events(self) -> int:
        """Points, blocks and denials together: what the page has to draw."""
        return len(self.point_t) + len(self.block_budget) + len(self.denials)


def model_from_report(report: BudgetReport, *, title: str | None = None) -> ViewModel:
    """The model of ``report`` and its descendants (see the module docstring).

    A report's timeline names no addresses: each ``alloc`` event becomes a block of its
    budget, size and tag, each ``free`` ends the latest live one of the same three (a
    resize's change in size is a block of its own). The blocks still live at the end take
    the addresses and stacks of the report's live blocks of the same budget, size and tag;
    a live block that none matches was allocated before the timeline's first event.
    """
    model = ViewModel(title or report.name, "report")
    index: dict[int, int] = {}
    by_name: dict[str, int] = {}
    stack: list[tuple[BudgetReport, int | None]] = [(report, None)]
    last = report.timeline[-1].time if report.timeline else 0.0
    while stack:  # parents before children, without recursion
        item, parent = stack.pop()
        stack.extend((child, len(model.budgets)) for child in reversed(item.children))
        index[id(item)] = len(model.budgets)
        by_name.setdefault(item.name, len(model.budgets))
        model.budgets.append(ViewBudget(item.name, parent, item.limit, item.reserve, 0.0,
                                        None if item.state in ("new", "open") else last,
                                        0, item.allocations, item.frees, item.denied,
                                        item.driver_door))
    own = [0] * len(model.budgets)
    start = model.tick(report.timeline[0].time if report.timeline else 0.0)
    live: dict[tuple[int, int, int], list[int]] = {}  # (budget, size, tag) -> blocks
    for event in report.timeline:
        budget = by_name.get(event.budget, 0)
        tag = model.tag_id(event.tag)
        if event.kind == "deny":
            model.denials.append((event.time, budget, event.size, "", tag))
            continue
        at = model.tick(event.time)
        key = (budget, event.size, tag)
        if event.kind == "alloc":
            live.setdefault(key, []).append(model.block(budget, event.size, tag, -1, at, -1))
            own[budget] += event.size
        else:
            found = live.get(key)
            if found:
                model.end_block(found.pop(), at)
            else:  # allocated before the timeline's first event
                model.end_block(model.block(budget, event.size, tag, -1, -1, -1), at)
            own[budget] = max(0, own[budget] - event.size)
        model.point(at, budget, event.used, own[budget])
        if budget != 0:
            model.point(at, 0, event.total, own[0])
    for item in report.walk():
        budget = index[id(item)]
        for block in item.live_blocks:
            tag = model.tag_id(block.tag)
            found = live.get((budget, block.size, tag))
            if found:
                taken = found.pop()
                model.block_address[taken] = block.address
                model.block_stack[taken] = model.stack_id(block.stack)
            else:
                model.block(budget, block.size, tag, block.address, -1,
                            model.stack_id(block.stack))
    model.end = max(model.times[-1], max((d[0] for d in model.denials), default=0.0))
    for left in live.values():  # live by the timeline, not in the report: a resize's
        for orphan in left:       # parts; they end with it
            model.end_block(orphan, len(model.times) - 1)
    if len(model.point_t) == 0:
        model.point(start, 0, report.used, sum(b.size for b in report.live_blocks))
    for item in report.walk():  # the report's peaks, which the timeline may not reach
        member = model.budgets[index[id(item)]]
        member.peak = max(member.peak, item.peak)
    model.infer_regions({})
    if report.mapped is not None:
        model.notes.append(f"{report.name} is growable: {format_size(report.mapped)} of its "
                           f"{format_size(report.limit)} of addresses mapped when the report "
                           f"was taken (at most {format_size(report.mapped_peak or 0)})")
    return model

