"""Replay a trace (:mod:`gpubudget.tracefile`) against budgets in host memory, and ``fit``:
the smallest limit of every budget under which the replay has no denial.

Replay opens the recorded budgets in the recorded order, under their recorded parents,
on the host backend without touching memory (``MAP_NORESERVE``, so a trace of a 141 GB GPU
replays on a laptop), and repeats every allocation, free and resize. Each budget is entered
and exited in a context of its own (``parent=`` names its parent), so budgets recorded in
several threads replay in the order the trace gives. Allocations that were denied in the
recording are replayed too (then freed at once): they are memory the program wanted. Denials
for a bad size, alignment or tag are skipped: no limit fixes those.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from .backends.host import HostBackend
from .budget import Budget
from .errors import BudgetError
from .report import BudgetReport
from .tracefile import Trace, read_trace
from .units import DEFAULT_ALIGN, round_up

__all__ = ["Fit", "Recorded", "ReplayResult", "fit", "replay"]

_BACKEND: Final = HostBackend(noreserve=True)
_LIMIT_REASONS: Final = ("over_limit", "fragmented", "inactive", "released")
_MAX_DOUBLINGS: Final = 16
"""How often ``fit`` doubles a root's ceiling looking for a limit with no denial."""


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
    peak: int = 0
    """Its peak ``used`` in the replay."""
    denials: int = 0
    """Requests refused in the replay (its own, and its entry if that was refused)."""


@dataclass(frozen=True)
class ReplayResult:
    """What a replay produced: one report per root, and every recorded budget by id."""

    reports: tuple[BudgetReport, ...]
    budgets: dict[int, Recorded]

    @property
    def denials(self) -> dict[int, int]:
        """Budget id -> requests refused in the replay, for the budgets that refused any."""
        return {bid: b.denials for bid, b in self.budgets.items() if b.denials}

    def root_of(self, budget: int) -> int:
        while (parent := self.budgets[budget].parent) is not None:
            budget = parent
        return budget


class _Replay:
    """One replay's state: the budgets opened, and the recorded address -> replayed block."""

    def __init__(self, limits: dict[int, int]) -> None:
        self.limits = limits
        self.recorded: dict[int, Recorded] = {}
        self.opened: dict[int, tuple[Budget, contextvars.Context]] = {}
        self.blocks: dict[int, tuple[Budget, int]] = {}
        self.denied: dict[int, int] = {}

    def run(self, events: Iterable[dict[str, Any]]) -> ReplayResult:
        handlers = {"enter": self.enter, "alloc": self.alloc, "free": self.free,
                    "resize": self.resize, "exit": self.exit}
        for event in events:
            handlers[event["ev"]](event)
        reports = tuple(budget.report() for budget, _ in self.opened.values()
                        if budget.parent is None)
        peaks = {bid: budget.peak for bid, (budget, _) in self.opened.items()}
        for budget, address in self.blocks.values():  # give the host mappings back
            budget.free(address)
        for bid in reversed(list(self.opened)):
            self.exit({"b": bid})
        budgets = {bid: Recorded(r.id, r.name, r.parent, r.limit, r.recorded_limit, r.reserve,
                                 r.align, peaks.get(bid, 0), self.denied.get(bid, 0))
                   for bid, r in self.recorded.items()}
        return ReplayResult(reports, budgets)

    def deny(self, bid: int) -> None:
        self.denied[bid] = self.denied.get(bid, 0) + 1

    def enter(self, event: dict[str, Any]) -> None:
        bid, parent_id = int(event["b"]), event["parent"]
        recorded = int(event["limit"])
        limit = self.limits.get(bid, recorded)
        align = int(event.get("align") or DEFAULT_ALIGN)
        reserve = int(event.get("reserve") or 0)
        parent_id = None if parent_id is None else int(parent_id)
        self.recorded[bid] = Recorded(bid, str(event["name"]), parent_id, limit, recorded,
                                      reserve, align)
        parent = self.opened.get(parent_id) if parent_id is not None else None
        if parent_id is not None and parent is None:
            self.deny(bid)  # its parent could not be opened
            return
        budget = Budget(limit, align=align, name=str(event["name"]),
                        reserve=min(reserve, limit) or None,
                        backend=_BACKEND if parent is None else None,
                        parent=parent[0] if parent is not None else None)
        context = contextvars.Context()
        try:
            context.run(budget.__enter__)
        except BudgetError:
            self.deny(bid)
            return
        self.opened[bid] = (budget, context)

    def alloc(self, event: dict[str, Any]) -> None:
        bid = int(event["b"])
        if event["ptr"] is None and event.get("reason") not in _LIMIT_REASONS:
            return  # a bad request: no limit would have granted it
        opened = self.opened.get(bid)
        if opened is None:
            self.deny(bid)
            return
        budget = opened[0]
        address = budget.allocate(int(event["size"]), int(event["align"] or 0),
                                  tag=event.get("tag"))
        if address is None:
            self.deny(bid)
        elif event["ptr"] is None:
            budget.free(address)  # a recorded denial, replayed as a probe
        else:
            self.blocks[int(event["ptr"])] = (budget, address)

    def free(self, event: dict[str, Any]) -> None:
        found = self.blocks.pop(int(event["ptr"]), None)
        if found is not None:
            found[0].free(found[1])

    def resize(self, event: dict[str, Any]) -> None:
        found = self.blocks.get(int(event["ptr"]))
        if found is not None:
            moved = found[0].resize(found[1], int(event["size"]), int(event["align"] or 0))
            if moved is None:
                self.deny(int(event["b"]))
            else:
                self.blocks[int(event["ptr"])] = (found[0], moved)

    def exit(self, event: dict[str, Any]) -> None:
        opened = self.opened.get(int(event["b"]))
        if opened is not None and opened[0].state == "open":
            budget, context = opened
            context.run(budget.__exit__, None, None, None)


def _load(trace: Trace | str | os.PathLike[str]) -> Trace:
    return trace if isinstance(trace, Trace) else read_trace(trace)


def replay(
    trace: Trace | str | os.PathLike[str], *, limits: dict[int, int] | None = None
) -> ReplayResult:
    """Replay ``trace``; ``limits`` overrides recorded limits by budget id."""
    return _Replay(limits or {}).run(_load(trace).events)


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


def fit(trace: Trace | str | os.PathLike[str]) -> list[Fit]:
    """The smallest limit for every budget of ``trace`` under which replay has no denial.

    A child's limit only counts bytes, so its smallest limit is its peak ``used`` (at least
    its reserve) in a replay that nothing limits. A root's limit is also the size of the
    arena its tree is placed in, so fragmentation can ask for more than the peak: it is found
    by bisection, over multiples of the root's alignment, with its children at their fitted
    limits. Bisection assumes that a larger limit never denies what a smaller one granted,
    true of best fit in practice though not guaranteed; the answer is checked once more.
    Each root is fitted on its own events only, so many roots cost no more than one long one.
    """
    data = _load(trace)
    first = replay(data)
    if not first.budgets:
        raise ValueError("the trace holds no budget")
    by_root: dict[int, list[dict[str, Any]]] = {}
    for event in data.events:
        bid = int(event["b"])
        if bid in first.budgets:
            by_root.setdefault(first.root_of(bid), []).append(event)
    fitted: dict[int, Fit] = {}
    for root, events in by_root.items():
        for found in _fit_root(root, events):
            fitted[found.budget] = found
    return [fitted[bid] for bid in first.budgets]


def _fit_root(root: int, events: list[dict[str, Any]]) -> list[Fit]:
    """Fit one root and its descendants on the events of that tree."""
    first = _Replay({}).run(events)
    members = list(first.budgets)
    ceiling = max(first.budgets[root].limit, 2 * max(first.budgets[root].peak, 1))
    for _ in range(_MAX_DOUBLINGS):
        free = _Replay(dict.fromkeys(members, ceiling)).run(events)
        if not free.denials:
            break
        ceiling *= 2
    else:
        raise ValueError(f"budget {first.budgets[root].name!r} is denied even with "
                         f"2**{_MAX_DOUBLINGS} times its peak: is the trace consistent?")
    limits = {}
    for bid in members:
        if bid != root:
            recorded = free.budgets[bid]
            need = max(recorded.peak, recorded.reserve, recorded.align)
            limits[bid] = round_up(need, recorded.align)
    align = free.budgets[root].align
    low = max(free.budgets[root].peak, align) - 1  # denied at peak - 1: a lower bound
    high = ceiling
    while high - low > align:
        middle = (low + high) // 2 // align * align
        if middle <= low:
            break
        limits[root] = middle
        if _Replay(limits).run(events).denials:
            low = middle
        else:
            high = middle
    limits[root] = high
    if _Replay(limits).run(events).denials:  # pragma: no cover - see fit's docstring
        limits[root] = ceiling
    return [Fit(bid, free.budgets[bid].name, free.budgets[bid].parent,
                free.budgets[bid].recorded_limit, free.budgets[bid].peak, limits[bid])
            for bid in members]
