"""``BudgetReport.plot``: a PNG of used bytes over time (matplotlib, optional extra ``plot``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import BudgetReport

__all__ = ["plot_report"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(
            "BudgetReport.plot needs matplotlib: pip install 'gpubudget[plot]'"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def plot_report(report: BudgetReport, path: str) -> None:
    """Draw ``report``'s timeline into ``path`` (PNG).

    Lines: the report's budget (its ``used`` as the events recorded it: for a root, the tree's
    total) and each child's own ``used``, as steps; each limit is a dashed line of the same
    colour; denials are red crosses at the refusing budget's level.
    """
    plt = _pyplot()
    events = report.timeline
    budgets = [report] + [child for child in report.walk()[1:]]
    peak = max([b.limit for b in budgets] + [e.total for e in events] + [1])
    unit, scale = next((u, s) for u, s in _UNITS if peak >= s)
    figure, axes = plt.subplots(figsize=(10, 5), dpi=100)
    end = events[-1].time if events else 1.0
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, budget in enumerate(budgets):
        colour = colours[index % len(colours)]
        if budget is report and report.children:
            points = [(e.time, e.total) for e in events]  # the whole tree under this root
        else:
            points = [(e.time, e.used) for e in events if e.budget == budget.name and e.kind != "deny"]
        times = [0.0] + [t for t, _ in points] + [end]
        values = [0] + [v for _, v in points] + [points[-1][1] if points else 0]
        axes.step(times, [v / scale for v in values], where="post", color=colour,
                  label=f"{budget.name} (peak {budget.peak / scale:.2f} {unit})")
        axes.axhline(budget.limit / scale, color=colour, linestyle="--", linewidth=1)
    denials = [e for e in events if e.kind == "deny"]
    if denials:
        axes.scatter([e.time for e in denials], [(e.used + e.size) / scale for e in denials],
                     marker="x", color="red", zorder=5, label=f"denied ({len(denials)})")
    axes.set_xlabel("seconds")
    axes.set_ylabel(f"used ({unit})")
    axes.set_title(f"gpubudget: {report.name} — dashed lines are limits")
    axes.set_ylim(bottom=0, top=peak / scale * 1.08)
    axes.legend(loc="upper left", fontsize="small")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
