"""A budget's counters as PyTorch users know them (``memory_stats``), a one-row-per-budget
table (``memory_summary``), and the reset of the accumulated counters.

One rule for both: every number given for a budget covers its subtree, the budget and every
budget entered inside it (released ones included), as ``used`` and ``peak`` do, which are
charged to every ancestor. ``torch.cuda.memory_stats()`` describes a device;
:func:`memory_stats` describes a budget's subtree, with the same key style
(``"allocated_bytes.all.current"``) for the numbers that have a meaning here; each row of
:func:`memory_summary` is what ``memory_stats`` says of that row's budget (counting from
entry). The counters of :func:`reset_accumulated_stats` are kept per budget object, so a
reset changes what ``memory_stats`` says and nothing else (the report and the summary keep
counting from the start).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Final

from ..text import printable
from ..units import format_size

if TYPE_CHECKING:
    from .._core import Node
    from ..report import BudgetReport
    from .view import BudgetView

__all__ = ["STAT_KEYS", "memory_stats", "memory_summary", "reset_accumulated_stats"]

STAT_KEYS: Final = (
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "allocated_bytes.all.allocated",
    "allocated_bytes.all.freed",
    "allocation.all.current",
    "allocation.all.allocated",
    "allocation.all.freed",
    "num_ooms",
)
"""The keys of :func:`memory_stats`, in its order."""
_NAME_COLUMN: Final = 40
"""Characters of a budget's name (with its tree prefix) the summary shows at most."""

# Budget -> its subtree's (allocations, frees, denials, bytes allocated, bytes freed) at its
# last reset_accumulated_stats(); a budget never reset is not in it.
_baselines: weakref.WeakKeyDictionary[BudgetView, tuple[int, ...]] = (
    weakref.WeakKeyDictionary())


def _counted(node: Node) -> tuple[tuple[int, ...], int]:
    """The subtree's accumulated counts (as ``Node.own_counts`` orders them) and its live
    blocks now."""
    with node.lock:
        members = node.subtree()
        counts = tuple(sum(column) for column in zip(*(m.own_counts() for m in members)))
        blocks = sum(m.stats.blocks for m in members)
    return counts, blocks


def memory_stats(budget: BudgetView) -> dict[str, int]:
    """The counters of ``budget`` and the budgets inside it; see
    :meth:`gpubudget.Budget.memory_stats`."""
    node = budget._node
    (allocations, frees, denied, allocated, freed), blocks = _counted(node)
    base = _baselines.get(budget, (0, 0, 0, 0, 0))
    with node.lock:
        used, peak = node.account.used, node.account.peak
    return {
        "allocated_bytes.all.current": used,
        "allocated_bytes.all.peak": peak,
        "allocated_bytes.all.allocated": allocated - base[3],
        "allocated_bytes.all.freed": freed - base[4],
        "allocation.all.current": blocks,
        "allocation.all.allocated": allocations - base[0],
        "allocation.all.freed": frees - base[1],
        "num_ooms": denied - base[2],
    }


def reset_accumulated_stats(budget: BudgetView) -> None:
    """Start ``budget``'s accumulated counters again from zero; see
    :meth:`gpubudget.Budget.reset_accumulated_stats`."""
    _baselines[budget] = _counted(budget._node)[0]


def memory_summary(report: BudgetReport) -> str:
    """One row per budget of ``report``'s tree, parents before children, each counting its
    subtree (the report's :attr:`~gpubudget.BudgetReport.totals`); see
    :meth:`gpubudget.Budget.memory_summary`."""
    rows: list[tuple[str, BudgetReport]] = []
    stack: list[tuple[BudgetReport, str, str]] = [(report, "", "")]
    while stack:  # a loop, not a recursion: trees may be deep
        item, first, rest = stack.pop()
        name = first + printable(item.name)
        if len(name) > _NAME_COLUMN:
            name = name[: _NAME_COLUMN - 1] + "…"
        rows.append((name, item))
        last = len(item.children) - 1
        for index in range(last, -1, -1):
            stack.append((item.children[index], rest + ("└─ " if index == last else "├─ "),
                          rest + ("   " if index == last else "│  ")))
    width = max(len("budget"), *(len(name) for name, _ in rows))
    header = (f"{'budget':<{width}}  {'state':<8}{'used':>11}{'peak':>11}{'limit':>11}"
              f"{'allocs':>9}{'frees':>9}{'denied':>8}{'live':>7}")
    lines = [header]
    for name, item in rows:
        totals = item.totals
        lines.append(
            f"{name:<{width}}  {item.state:<8}{format_size(item.used):>11}"
            f"{format_size(item.peak):>11}{format_size(item.limit):>11}{totals.allocations:>9}"
            f"{totals.frees:>9}{totals.denied:>8}{totals.live_blocks:>7}")
    return "\n".join(lines)
