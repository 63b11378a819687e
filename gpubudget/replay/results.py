"""What a replay gives and takes: the recorded budgets, the result, the error, and the
backend whose clock is the trace's (see the package's docstring)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, Union

from ..adapter import hand_clock
from ..backends.host import HostBackend, HostReservation
from ..report import BudgetReport
from ..tracefile import LIMIT_REASONS, Trace, TraceError, TraceReader

if TYPE_CHECKING:
    from ..budget import Budget
    from ..report import DoorUsage

__all__ = ["PROBE_REASONS", "Recorded", "ReplayBackend", "ReplayError", "ReplayResult",
           "TraceSource", "as_recorded", "with_door"]
PROBE_REASONS: Final = LIMIT_REASONS
"""Denial reasons whose requests are replayed as probes (a larger limit would grant them)."""
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
        self.clock: Final = hand_clock()
        """The recorded time of the event being replayed: what budgets on this backend stamp
        their timelines with (a clock set by hand, which the C core reads without calling)."""
        self.reserved_at: int | None = None
        """The address of the last memory reserved (a root's arena starts there, rounded
        up to its alignment)."""

    def reserve(self, nbytes: int) -> HostReservation:
        """Map ``nbytes``, untouched, and remember where."""
        reservation = super().reserve(nbytes)
        self.reserved_at = reservation.address
        return reservation

    @property
    def now(self) -> float:
        """The ``t`` of the event being replayed, in seconds."""
        return self.clock.now

    @now.setter
    def now(self, t: float) -> None:
        self.clock.now = t


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


def as_recorded(report: BudgetReport, recorded: dict[int, int],
                stacks: dict[int, tuple[str, ...]]) -> BudgetReport:
    """``report`` (of a replay) with each live block at the address it was recorded at
    (``recorded``: replayed address -> recorded one), in the order of those addresses, and
    with the stack recorded for it (``stacks``, by replayed address: a replay cannot hand a
    stack to ``Budget.allocate``). A replay places its blocks in a host mapping of its own,
    at addresses that change from run to run; the recorded ones do not, and name the blocks
    as the program saw them."""
    made: dict[int, BudgetReport] = {}
    for item in reversed(report.walk()):  # children before parents: no recursion
        blocks = sorted((replace(block, address=recorded.get(block.address, block.address),
                                 stack=block.stack if block.stack is not None
                                 else stacks.get(block.address))
                         for block in item.live_blocks), key=lambda block: block.address)
        made[id(item)] = replace(item, live_blocks=tuple(blocks),
                                 children=tuple(made.pop(id(child))
                                                for child in item.children))
    return made[id(report)]


def with_door(report: BudgetReport, budget: Budget,
              door: dict[Budget, DoorUsage]) -> BudgetReport:
    """``report`` (of the replayed ``budget``) with the driver door's numbers that the trace
    recorded (``door``: replayed budget -> its ``door`` line's numbers) on each budget's
    report. A replay has no door: these are the recording's, as the budget's exit saw them.
    The report and the budgets are walked side by side: a report's children are its
    budget's, in the same order (taken at one moment: a replay runs in one thread)."""
    pairs: list[tuple[BudgetReport, Budget | None]] = []
    stack: list[tuple[BudgetReport, Budget | None]] = [(report, budget)]
    while stack:  # parents before children, without recursion
        item, member = stack.pop()
        pairs.append((item, member))
        children = member.children if member is not None else ()
        if len(children) != len(item.children):
            children = ()  # not the same tree (never, in one thread): shown without the door
        stack.extend((child, children[index] if children else None)
                     for index, child in enumerate(item.children))
    made: dict[int, BudgetReport] = {}
    for item, member in reversed(pairs):  # children before parents
        made[id(item)] = replace(
            item, driver_door=door.get(member, item.driver_door) if member is not None
            else item.driver_door,
            children=tuple(made.pop(id(child)) for child in item.children))
    return made[id(report)]
