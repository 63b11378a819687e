"""Reading a trace into a :class:`~gpubudget.viewer.model.ViewModel`: its accounting replayed
(``used`` with reserves, as the ledger charges it), every block's life, the roots' regions,
a growable root's mapped granules and, for a trace written under the driver door, what the
door charged each budget (see :mod:`gpubudget.viewer.model`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..tracefile import (
    MAX_TRACE_BYTES,
    Alloc,
    Door,
    Enter,
    Exit,
    Free,
    Map,
    Resize,
    TraceReader,
    Unmap,
)
from .model import UNKNOWN, ViewBudget, ViewModel

__all__ = ["TraceState", "model_from_trace"]


class TraceState:
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
        self.spans: dict[int, tuple[int, int]] = {}  # root -> (entered, released) events
        self.placed: dict[int, tuple[int, int]] = {}  # root -> (base, bytes), where known
        # root -> runs of granules mapped now: (start, end, the event they were mapped at)
        self.runs: dict[int, list[tuple[int, int, int]]] = {}

    def charge(self, at: int, budget: int | None, delta: int) -> None:
        """Add ``delta`` to ``budget``'s used, and what it changes to its ancestors'."""
        model = self.model
        while budget is not None and delta:
            member = model.budgets[budget]
            before = self.used[budget]
            self.used[budget] = before + delta
            model.point(at, budget, self.used[budget], self.own[budget])
            delta = max(self.used[budget], member.reserve) - max(before, member.reserve)
            budget = member.parent

    def release(self, at: int, budget: int) -> None:
        """Release exited budgets with no block, from ``budget`` up."""
        model = self.model
        current: int | None = budget
        while current is not None:
            member = model.budgets[current]
            if (member.exited is None or self.blocks[current] or self.released[current]
                    or self.unreleased[current]):
                return
            self.released[current] = True
            if member.parent is None:
                self.spans[current] = (self.spans[current][0], at)
                self.close_root(current, at)
            else:
                self.unreleased[member.parent] -= 1
            if member.parent is not None and member.reserve:
                self.charge(at, member.parent, -max(self.used[current], member.reserve))
            current = member.parent

    def enter(self, event: Enter) -> None:
        model = self.model
        at = model.tick(event.t)
        parent = self.index[event.parent] if event.parent is not None else None
        self.index[event.budget] = budget = len(model.budgets)
        model.budgets.append(ViewBudget(event.name, parent, event.limit, event.reserve,
                                        model.times[at]))
        self.used.append(0)
        self.own.append(0)
        self.blocks.append(0)
        self.released.append(False)
        self.unreleased.append(0)
        if parent is not None:
            self.unreleased[parent] += 1
            self.roots.append(self.roots[parent])
        else:
            self.roots.append(budget)
            self.spans[budget] = (at, UNKNOWN)
            if event.base is not None:
                self.placed[budget] = (event.base, event.span)
        model.point(at, budget, 0, 0)
        if parent is not None and event.reserve:
            self.charge(at, parent, event.reserve)

    def alloc(self, event: Alloc) -> None:
        model, budget = self.model, self.index[event.budget]
        member = model.budgets[budget]
        if event.ptr is None:
            member.denied += 1
            model.denials.append((max(event.t, model.times[-1]) if model.times else event.t,
                                  budget, event.nbytes, event.reason or "",
                                  model.tag_id(event.tag)))
            return
        at = model.tick(event.t)
        member.allocations += 1
        stack = model.stack_id(getattr(event, "stack", None))
        self.live[(self.roots[budget], event.ptr)] = model.block(
            budget, event.nbytes, model.tag_id(event.tag), event.ptr, at, stack, event.size)
        self.own[budget] += event.nbytes
        self.blocks[budget] += 1
        self.charge(at, budget, event.nbytes)

    def free(self, event: Free | Resize) -> None:
        model, budget = self.model, self.index[event.budget]
        at = model.tick(event.t)
        block = self.live.pop((self.roots[budget], event.ptr))
        model.end_block(block, at)
        nbytes = int(model.block_size[block])
        self.own[budget] -= nbytes
        self.blocks[budget] -= 1
        if type(event) is Free:
            model.budgets[budget].frees += 1
        self.charge(at, budget, -nbytes)
        if type(event) is Resize:  # the block's new life, same address and stack
            self.live[(self.roots[budget], event.ptr)] = model.block(
                budget, event.nbytes, int(model.block_tag[block]), event.ptr, at,
                int(model.block_stack[block]), event.size)
            self.own[budget] += event.nbytes
            self.blocks[budget] += 1
            self.charge(at, budget, event.nbytes)
        else:
            self.release(at, budget)

    def mapped(self, event: Map | Unmap) -> None:
        """Granules mapped or unmapped: the runs of the root that hold them end, what they
        keep beyond the change goes on as new runs, and a mapping starts a run."""
        model = self.model
        at = model.tick(event.t)
        root = self.index[event.budget]
        start, end = event.ptr, event.ptr + event.nbytes
        runs = self.runs.setdefault(root, [])
        kept = []
        for first, last, since in runs:
            if last <= start or first >= end:
                kept.append((first, last, since))
                continue
            model.mappings.append((root, first, last - first, since, at))
            kept += [(a, b, at) for a, b in ((first, start), (end, last)) if a < b]
        if type(event) is Map:
            kept.append((start, end, at))
        self.runs[root] = kept

    def close_root(self, root: int, at: int) -> None:
        """Root ``root`` was released at event ``at`` (-1: still held at the end): its exact
        region, and the runs still mapped, end there."""
        for first, last, since in self.runs.pop(root, []):
            self.model.mappings.append((root, first, last - first, since, at))
        placed = self.placed.pop(root, None)
        if placed is not None:
            self.model.regions.append((root, placed[0], placed[1], self.spans[root][0], at))

    def door(self, event: Door) -> None:
        """A ``door`` line (the trace written under the driver door): what the door had
        charged the budget when it exited, by library, and its refusals, drawn in its row
        of the budget tree as from a report. No event of the timelines: the door's bytes
        are not the budget's blocks."""
        from ..report import DoorUsage  # here: most traces have no door line

        self.model.budgets[self.index[event.budget]].door = DoorUsage.from_trace(event)

    def exit(self, event: Exit) -> None:
        at = self.model.tick(event.t)
        budget = self.index[event.budget]
        self.model.budgets[budget].exited = self.model.times[at]
        self.release(at, budget)


def model_from_trace(path: str | os.PathLike[str], *, title: str | None = None,
                     max_bytes: int = MAX_TRACE_BYTES,
                     progress: Callable[[int, int], None] | None = None) -> ViewModel:
    """Read the trace file at ``path`` (validated as :class:`~gpubudget.tracefile.TraceReader`
    does: a :class:`~gpubudget.errors.TraceError` in one line for a bad one) into a model.

    Examples
    --------
    >>> import os, tempfile
    >>> from gpubudget import gpu_budget
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with gpu_budget("1MiB", name="pool", backend="host", trace=path) as pool:
    ...     block = pool.allocate(1000, tag="weights")
    >>> model = model_from_trace(path)
    >>> [b.name for b in model.budgets], list(model.block_size), model.tags
    (['pool'], [1024.0], ['weights'])
    """
    model = ViewModel(title or os.path.basename(os.fspath(path)), "trace")
    state = TraceState(model)
    handlers: dict[type, Any] = {Enter: state.enter, Alloc: state.alloc, Free: state.free,
                                 Resize: state.free, Exit: state.exit, Map: state.mapped,
                                 Unmap: state.mapped, Door: state.door}
    with TraceReader(path, max_bytes=max_bytes, progress=progress) as reader:
        for event in reader.events_with_mappings(door=True):
            handlers[type(event)](event)
    model.end = max(model.times[-1] if model.times else 0.0,
                    max((d[0] for d in model.denials), default=0.0))
    for root in list(state.placed):  # held at the end
        state.close_root(root, UNKNOWN)
    model.infer_regions(state.spans)
    return model
