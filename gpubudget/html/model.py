"""What the viewer and the Perfetto export draw, taken from a trace or a report: the budgets,
every change of a budget's ``used`` (a *point*), every block's life, and the denials.

A trace gives everything: points for a budget and all its ancestors at each event, blocks
from their allocation to their free, with their stacks where the trace carries them. A
report gives its timeline (``EVENT_LOG_LIMIT`` events at most): a budget's points at its own
events (the root's at every event), and its blocks only as they were when it was taken.

Columns are kept in ``array`` objects (8 bytes a number), so a trace of a million events
costs tens of megabytes here, not hundreds.
"""

from __future__ import annotations

import math
import os
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..tracefile import MAX_TRACE_BYTES, Alloc, Enter, Exit, Free, Resize, TraceReader

if TYPE_CHECKING:
    from ..report import BudgetReport

__all__ = ["ViewBudget", "ViewModel", "model_from_report", "model_from_trace"]

_NO_TAG = -1


@dataclass
class ViewBudget:
    """One budget: as entered, and its counts."""

    name: str
    parent: int | None
    """Index of its parent in :attr:`ViewModel.budgets`."""
    limit: int
    reserve: int
    entered: float
    exited: float | None = None
    peak: int = 0
    allocations: int = 0
    frees: int = 0
    denied: int = 0


@dataclass
class ViewModel:
    """Budgets, points, blocks and denials; times in seconds since the first event."""

    title: str
    source: str
    """``trace`` or ``report``: how complete the blocks are (see the module docstring)."""
    budgets: list[ViewBudget] = field(default_factory=list)
    point_t: array[float] = field(default_factory=lambda: array("d"))
    point_budget: array[int] = field(default_factory=lambda: array("l"))
    point_used: array[float] = field(default_factory=lambda: array("d"))
    """The budget's ``used`` after the change (children's and reserves included)."""
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
    block_stack: array[int] = field(default_factory=lambda: array("l"))
    denials: list[tuple[float, int, int, str, int]] = field(default_factory=list)
    """``(t, budget, bytes, reason, tag)``."""
    tags: list[str] = field(default_factory=list)
    frames: list[str] = field(default_factory=list)
    stacks: list[list[int]] = field(default_factory=list)
    """Each a list of frame indices, outermost first."""
    end: float = 0.0
    """The time of the last event."""
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

    def point(self, t: float, budget: int, used: int, own: int) -> None:
        self.point_t.append(t)
        self.point_budget.append(budget)
        self.point_used.append(used)
        self.point_own.append(own)
        member = self.budgets[budget]
        if used > member.peak:
            member.peak = used

    def block(self, budget: int, size: int, tag: int, address: int, start: float,
              stack: int) -> int:
        self.block_budget.append(budget)
        self.block_size.append(size)
        self.block_tag.append(tag)
        self.block_address.append(address)
        self.block_start.append(start)
        self.block_end.append(math.nan)
        self.block_stack.append(stack)
        return len(self.block_budget) - 1

    @property
    def events(self) -> int:
        """Points, blocks and denials together: what the page has to draw."""
        return len(self.point_t) + len(self.block_budget) + len(self.denials)


class _TraceState:
    """Replays a trace's accounting (``used`` with reserves, as the ledger charges it)."""

    def __init__(self, model: ViewModel) -> None:
        self.model = model
        self.index: dict[int, int] = {}  # trace budget id -> index in model.budgets
        self.used: list[int] = []
        self.own: list[int] = []
        self.blocks: list[int] = []  # live blocks per budget
        self.released: list[bool] = []
        self.unreleased: list[int] = []  # children entered and not yet released
        self.live: dict[tuple[int, int], int] = {}  # (root index, address) -> block index
        self.roots: list[int] = []

    def charge(self, t: float, budget: int | None, delta: int) -> None:
        """Add ``delta`` to ``budget``'s used, and what it changes to its ancestors'."""
        model = self.model
        while budget is not None and delta:
            member = model.budgets[budget]
            before = self.used[budget]
            self.used[budget] = before + delta
            model.point(t, budget, self.used[budget], self.own[budget])
            delta = max(self.used[budget], member.reserve) - max(before, member.reserve)
            budget = member.parent

    def release(self, t: float, budget: int) -> None:
        """Release exited budgets with no block, from ``budget`` up."""
        model = self.model
        current: int | None = budget
        while current is not None:
            member = model.budgets[current]
            if (member.exited is None or self.blocks[current] or self.released[current]
                    or self.unreleased[current]):
                return
            self.released[current] = True
            if member.parent is not None:
                self.unreleased[member.parent] -= 1
            if member.parent is not None and member.reserve:
                self.charge(t, member.parent, -max(self.used[current], member.reserve))
            current = member.parent

    def enter(self, event: Enter) -> None:
        model = self.model
        parent = self.index[event.parent] if event.parent is not None else None
        self.index[event.budget] = len(model.budgets)
        model.budgets.append(ViewBudget(event.name, parent, event.limit, event.reserve,
                                        event.t))
        self.used.append(0)
        self.own.append(0)
        self.blocks.append(0)
        self.released.append(False)
        self.unreleased.append(0)
        if parent is not None:
            self.unreleased[parent] += 1
        self.roots.append(self.roots[parent] if parent is not None else len(self.roots))
        model.point(event.t, len(model.budgets) - 1, 0, 0)
        if parent is not None and event.reserve:
            self.charge(event.t, parent, event.reserve)

    def alloc(self, event: Alloc) -> None:
        model, budget = self.model, self.index[event.budget]
        member = model.budgets[budget]
        if event.ptr is None:
            member.denied += 1
            model.denials.append((event.t, budget, event.nbytes, event.reason or "",
                                  model.tag_id(event.tag)))
            return
        member.allocations += 1
        stack = model.stack_id(getattr(event, "stack", None))
        self.live[(self.roots[budget], event.ptr)] = model.block(
            budget, event.nbytes, model.tag_id(event.tag), event.ptr, event.t, stack)
        self.own[budget] += event.nbytes
        self.blocks[budget] += 1
        self.charge(event.t, budget, event.nbytes)

    def free(self, event: Free | Resize) -> None:
        model, budget = self.model, self.index[event.budget]
        block = self.live.pop((self.roots[budget], event.ptr))
        model.block_end[block] = event.t
        nbytes = int(model.block_size[block])
        self.own[budget] -= nbytes
        self.blocks[budget] -= 1
        if type(event) is Free:
            model.budgets[budget].frees += 1
        self.charge(event.t, budget, -nbytes)
        if type(event) is Resize:  # the block's new life, same address and stack
            self.live[(self.roots[budget], event.ptr)] = model.block(
                budget, event.nbytes, int(model.block_tag[block]), event.ptr, event.t,
                int(model.block_stack[block]))
            self.own[budget] += event.nbytes
            self.blocks[budget] += 1
            self.charge(event.t, budget, event.nbytes)
        else:
            self.release(event.t, budget)

    def exit(self, event: Exit) -> None:
        budget = self.index[event.budget]
        self.model.budgets[budget].exited = event.t
        self.release(event.t, budget)


def model_from_trace(path: str | os.PathLike[str], *, title: str | None = None,
                     max_bytes: int = MAX_TRACE_BYTES,
                     progress: Callable[[int, int], None] | None = None) -> ViewModel:
    """Read the trace file at ``path`` (validated as :class:`~gpubudget.tracefile.TraceReader`
    does: a :class:`~gpubudget.errors.TraceError` in one line for a bad one) into a model."""
    model = ViewModel(title or os.path.basename(os.fspath(path)), "trace")
    state = _TraceState(model)
    handlers: dict[type, Any] = {Enter: state.enter, Alloc: state.alloc, Free: state.free,
                                 Resize: state.free, Exit: state.exit}
    end = 0.0
    with TraceReader(path, max_bytes=max_bytes, progress=progress) as reader:
        for event in reader:
            handlers[type(event)](event)
            end = event.t
    model.end = end
    return model


def model_from_report(report: BudgetReport, *, title: str | None = None) -> ViewModel:
    """The model of ``report`` and its descendants (see the module docstring)."""
    model = ViewModel(title or report.name, "report")
    index: dict[int, int] = {}
    by_name: dict[str, int] = {}
    stack: list[tuple[BudgetReport, int | None]] = [(report, None)]
    while stack:  # parents before children, without recursion
        item, parent = stack.pop()
        stack.extend((child, len(model.budgets)) for child in reversed(item.children))
        index[id(item)] = len(model.budgets)
        by_name.setdefault(item.name, len(model.budgets))
        model.budgets.append(ViewBudget(item.name, parent, item.limit, item.reserve, 0.0,
                                        None if item.state in ("new", "open") else
                                        report.timeline[-1].time if report.timeline else 0.0,
                                        0, item.allocations, item.frees, item.denied))
    own = [0] * len(model.budgets)
    for event in report.timeline:
        budget = by_name.get(event.budget, 0)
        if event.kind == "deny":
            model.denials.append((event.time, budget, event.size, "", model.tag_id(event.tag)))
            continue
        own[budget] = max(0, own[budget] + (event.size if event.kind == "alloc" else -event.size))
        model.point(event.time, budget, event.used, own[budget])
        if budget != 0:
            model.point(event.time, 0, event.total, own[0])
    for item in report.walk():
        for block in item.live_blocks:
            model.block(index[id(item)], block.size, model.tag_id(block.tag), block.address,
                        math.nan, model.stack_id(block.stack))
    for item in report.walk():  # the report's peaks, which the timeline may not reach
        member = model.budgets[index[id(item)]]
        member.peak = max(member.peak, item.peak)
    model.end = report.timeline[-1].time if report.timeline else 0.0
    return model
