"""Replay a trace (:mod:`gpubudget.tracefile`) against budgets in host memory, and ``fit``:
the smallest limit of every budget under which the replay has no denial.

Replay opens the recorded budgets in the recorded order, under their recorded parents,
on the host backend without touching memory (``MAP_NORESERVE``, so a trace of a 141 GB GPU
replays on a laptop), and repeats every allocation, free and resize. Allocations that were
denied in the recording are replayed too (then freed at once): they are memory the program
wanted. Denials for a bad size or alignment are skipped: no limit fixes those.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .backends.host import HostBackend
from .budget import Budget
from .errors import BudgetError
from .report import BudgetReport
from .tracefile import Trace, read_trace

__all__ = ["Fit", "ReplayResult", "fit", "replay"]

_BACKEND = HostBackend(noreserve=True)
_LIMIT_REASONS = ("over_limit", "fragmented", "inactive", "released")


@dataclass(frozen=True)
class ReplayResult:
    """What a replay produced: one report per root, and its denials per budget id."""

    reports: tuple[BudgetReport, ...]
    denials: dict[int, int] = field(default_factory=dict)
    """Recorded budget id -> allocations refused during the replay."""
    names: dict[int, str] = field(default_factory=dict)
    parents: dict[int, int | None] = field(default_factory=dict)
    limits: dict[int, int] = field(default_factory=dict)
    """The recorded limits."""
    peaks: dict[int, int] = field(default_factory=dict)
    reserves: dict[int, int] = field(default_factory=dict)
    aligns: dict[int, int] = field(default_factory=dict)

    def root_of(self, budget: int) -> int:
        while (parent := self.parents[budget]) is not None:
            budget = parent
        return budget


def _load(trace: Trace | str | os.PathLike[str]) -> Trace:
    return trace if isinstance(trace, Trace) else read_trace(trace)


def replay(
    trace: Trace | str | os.PathLike[str], *, limits: dict[int, int] | None = None
) -> ReplayResult:
    """Replay ``trace``; ``limits`` overrides recorded limits by budget id."""
    data = _load(trace)
    overrides = limits or {}
    budgets: dict[int, Budget] = {}
    blocks: dict[int, tuple[Budget, int]] = {}
    denials: dict[int, int] = {}
    names: dict[int, str] = {}
    parents: dict[int, int | None] = {}
    limits_seen: dict[int, int] = {}
    reserves: dict[int, int] = {}
    aligns: dict[int, int] = {}

    def deny(budget_id: int) -> None:
        denials[budget_id] = denials.get(budget_id, 0) + 1

    for event in data.events:
        kind = event["ev"]
        bid = int(event["b"])
        if kind == "enter":
            parent_id = event["parent"]
            names[bid] = str(event["name"])
            parents[bid] = None if parent_id is None else int(parent_id)
            limits_seen[bid] = int(event["limit"])
            reserves[bid] = int(event.get("reserve") or 0)
            aligns[bid] = int(event.get("align") or 256)
            parent = budgets.get(int(parent_id)) if parent_id is not None else None
            if parent_id is not None and parent is None:
                deny(bid)  # its parent could not be opened
                continue
            limit = overrides.get(bid, limits_seen[bid])
            reserve = min(reserves[bid], limit) or None
            budget = Budget(limit, align=aligns[bid], name=names[bid],
                            reserve=reserve, backend=_BACKEND)
            try:
                budget._open(parent)
            except BudgetError:
                deny(bid)
                continue
            budgets[bid] = budget
        elif kind == "alloc":
            budget_or_none = budgets.get(bid)
            reason = event.get("reason")
            if event["ptr"] is None and reason not in _LIMIT_REASONS:
                continue  # a bad request: no limit would have granted it
            if budget_or_none is None:
                deny(bid)
                continue
            address = budget_or_none.allocate(int(event["size"]), int(event["align"] or 0),
                                              tag=event.get("tag"))
            if address is None:
                deny(bid)
            elif event["ptr"] is None:
                budget_or_none.free(address)  # a recorded denial, replayed as a probe
            else:
                blocks[int(event["ptr"])] = (budget_or_none, address)
        elif kind == "free":
            found = blocks.pop(int(event["ptr"]), None)
            if found is not None:
                found[0].free(found[1])
        elif kind == "resize":
            found = blocks.get(int(event["ptr"]))
            if found is not None:
                moved = found[0].resize(found[1], int(event["size"]), int(event["align"] or 0))
                if moved is None:
                    deny(bid)
                else:
                    blocks[int(event["ptr"])] = (found[0], moved)
        elif kind == "exit":
            if bid in budgets:
                budgets[bid]._close_scope()
    reports = tuple(b.report() for b in budgets.values() if b.parent is None)
    peaks = {bid: budget.peak for bid, budget in budgets.items()}
    for budget, address in blocks.values():  # give the host mappings back
        budget.free(address)
    for budget in reversed(list(budgets.values())):
        budget._close_scope()
    return ReplayResult(reports, denials, names, parents, limits_seen, peaks, reserves, aligns)


@dataclass(frozen=True)
class Fit:
    """The fitted limit of one recorded budget."""

    budget: int
    name: str
    parent: int | None
    recorded_limit: int
    peak: int
    """Its peak ``used`` when nothing limits the replay."""
    limit: int
    """The smallest limit under which the replay has no denial (see :func:`fit`)."""


def _denials_in(result: ReplayResult, root: int) -> int:
    return sum(n for bid, n in result.denials.items() if result.root_of(bid) == root)


def fit(trace: Trace | str | os.PathLike[str]) -> list[Fit]:
    """The smallest limit for every budget of ``trace`` under which replay has no denial.

    A child's limit only counts bytes, so its smallest limit is its peak ``used`` (at least
    its reserve) in a replay that nothing limits. A root's limit is also the size of the
    arena its tree is placed in, so fragmentation can ask for more than the peak: it is found
    by bisection, over multiples of the root's alignment, with its children at their fitted
    limits. Bisection assumes that a larger limit never denies what a smaller one granted,
    true of best fit in practice though not guaranteed; the answer is checked once more.
    """
    data = _load(trace)
    first = replay(data)
    if not first.names:
        raise ValueError("the trace holds no budget")
    roots = [bid for bid, parent in first.parents.items() if parent is None]
    # A generous ceiling for every root: double until nothing is denied.
    ceiling = {bid: max(first.limits[bid], 2 * max(first.peaks.get(bid, 0), 1)) for bid in roots}
    unbounded: dict[int, int] = {}
    for _ in range(16):
        unbounded = {bid: ceiling[bid] for bid in roots}
        for bid in first.names:
            if bid not in ceiling:
                unbounded[bid] = ceiling[first.root_of(bid)]
        free = replay(data, limits=unbounded)
        if not free.denials:
            break
        for bid in roots:
            if _denials_in(free, bid):
                ceiling[bid] *= 2
    else:
        raise ValueError("the trace is denied even with 2**16 times its peak: is it consistent?")
    fitted: dict[int, int] = {}
    for bid in free.names:
        if bid not in ceiling:
            align = free.aligns[bid]
            need = max(free.peaks.get(bid, 0), free.reserves[bid], align)
            fitted[bid] = -(-need // align) * align
    for root in roots:
        align = free.aligns[root]
        limits = {**unbounded, **fitted}
        low = max(free.peaks.get(root, 0), align) - 1  # denied at peak - 1: a lower bound
        high = ceiling[root]
        while high - low > align:
            middle = (low + high) // 2 // align * align
            if middle <= low:
                break
            limits[root] = middle
            if _denials_in(replay(data, limits=limits), root):
                low = middle
            else:
                high = middle
        limits[root] = high
        if _denials_in(replay(data, limits=limits), root):  # pragma: no cover - see docstring
            high = ceiling[root]
        fitted[root] = high
    return [
        Fit(bid, free.names[bid], free.parents[bid], free.limits[bid],
            free.peaks.get(bid, 0), fitted[bid])
        for bid in free.names
    ]
