"""``BudgetReport.plot``: used bytes over time, as PNG, SVG or PDF (matplotlib, optional
extra ``plot``).

Names and tags are drawn as plain text: characters that are not printable are escaped and
``$`` never starts matplotlib's math mode, whatever a budget is called.
"""

from __future__ import annotations

import importlib
import os
import warnings
from typing import TYPE_CHECKING, Any, Final

from .text import printable
from .units import GiB, KiB, MiB

if TYPE_CHECKING:
    from .report import BudgetReport

__all__ = ["MAX_LINES", "PLOT_FORMATS", "plot_format", "plot_report", "time_unit"]

PLOT_FORMATS: Final = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
"""File suffix -> the format written."""
MAX_LINES: Final = 12
"""Budgets drawn at most: the report's own, then its descendants with the highest peaks."""
_NAME_SHOWN: Final = 40
"""Characters of a name shown in the legend and title, at most."""
_UNITS: Final = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))
_TIME_UNITS: Final = (("hours", 3600.0), ("minutes", 60.0), ("seconds", 1.0),
                      ("milliseconds", 1e-3), ("microseconds", 1e-6))
"""Units of the time axis: the largest that the run's length reaches (at least 2 of it)."""


def time_unit(end: float) -> tuple[str, float]:
    """The unit the time axis of a run ``end`` seconds long is drawn in, and its length in
    seconds: whole numbers on the ticks, never an offset or a power of ten beside them.

    >>> time_unit(3e-5), time_unit(0.25), time_unit(7200.0)
    (('microseconds', 1e-06), ('milliseconds', 0.001), ('hours', 3600.0))
    """
    return next(((name, length) for name, length in _TIME_UNITS if end >= 2 * length),
                _TIME_UNITS[-1])


def plot_format(path: str | os.PathLike[str]) -> str:
    """The format a plot written to ``path`` gets, from its suffix (case ignored):
    ``png``, ``svg`` or ``pdf``; ``ValueError`` naming the choices for any other.

    >>> plot_format("run.svg"), plot_format("RUN.PNG")
    ('svg', 'png')
    """
    suffix = os.path.splitext(os.fspath(path))[1].lower()
    found = PLOT_FORMATS.get(suffix)
    if found is None:
        raise ValueError(f"cannot plot to {printable(os.fspath(path))!r}: the format follows "
                         f"the file's suffix, one of {', '.join(PLOT_FORMATS)}")
    return found


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise ImportError(
            "BudgetReport.plot needs matplotlib: pip install 'gpubudget[plot]'"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def _text(name: str) -> str:
    """``name`` as plain text for matplotlib: printable, short, no math mode."""
    shown = printable(name)
    if len(shown) > _NAME_SHOWN:
        shown = shown[: _NAME_SHOWN - 1] + "…"
    return shown.replace("$", r"\$")


def _drawn(report: BudgetReport) -> tuple[list[BudgetReport], int]:
    """The budgets to draw (the report's own first) and how many others are left out."""
    others = list(report.walk()[1:])
    if len(others) < MAX_LINES:
        return [report] + others, 0
    others.sort(key=lambda b: -b.peak)
    return [report] + others[: MAX_LINES - 1], len(others) - (MAX_LINES - 1)


def _peak_words(budget: BudgetReport, drawn: int, scale: int, unit: str) -> str:
    """The legend's words on a line's height: ``peak`` when the line's highest point is the
    report's ``peak``; else both, named (``reset_peak()`` was called since the line's
    highest point, or the oldest events were dropped from the timeline)."""
    if budget.peak == drawn:
        return f"peak {drawn / scale:.2f} {unit}"
    why = " since reset_peak()" if budget.peak < drawn else ""
    return f"highest drawn {drawn / scale:.2f} {unit}; peak{why} {budget.peak / scale:.2f} {unit}"


def plot_report(report: BudgetReport, path: str | os.PathLike[str]) -> None:
    """Draw ``report``'s timeline into ``path``, in the format its suffix names
    (:func:`plot_format`).

    Lines: the report's budget (its ``used`` as the events recorded it: for a root, the tree's
    total) and each descendant's own ``used``, as steps (at most :data:`MAX_LINES`, the
    highest peaks, the others counted in the title); each limit is a dashed line of the same
    colour; denials are red crosses at the refusing budget's level. Each legend entry gives
    the highest value its line draws, and the report's ``peak`` beside it when they differ
    (after ``reset_peak()``). Time runs from the first event kept, as recorded (a replayed
    trace keeps its recorded times), in the unit of :func:`time_unit`.
    """
    kind = plot_format(path)
    plt = _pyplot()
    events = report.timeline
    budgets, left_out = _drawn(report)
    peak = max([b.limit for b in budgets] + [e.total for e in events] + [1])
    unit, scale = next((u, s) for u, s in _UNITS if peak >= s)
    end = events[-1].time if events else 1.0
    time_name, seconds = time_unit(end)
    # SVG keeps text as text (searchable, smaller); glyphs missing from the font only warn.
    with warnings.catch_warnings(), plt.rc_context({"svg.fonttype": "none"}):
        warnings.simplefilter("ignore", UserWarning)
        figure, axes = plt.subplots(figsize=(10, 5), dpi=100)
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for index, budget in enumerate(budgets):
            colour = colours[index % len(colours)]
            if budget is report and report.children:
                points = [(e.time, e.total) for e in events]  # the whole tree under this root
            else:
                points = [(e.time, e.used) for e in events
                          if e.budget == budget.name and e.kind != "deny"]
            times = [0.0] + [t for t, _ in points] + [end]
            values = [0] + [v for _, v in points] + [points[-1][1] if points else 0]
            # A leading space: matplotlib leaves labels that start with "_" out of legends.
            axes.step([t / seconds for t in times], [v / scale for v in values],
                      where="post", color=colour,
                      label=f" {_text(budget.name)} ({_peak_words(budget, max(values), scale, unit)})")
            axes.axhline(budget.limit / scale, color=colour, linestyle="--", linewidth=1)
        denials = [e for e in events if e.kind == "deny"]
        if denials:
            axes.scatter([e.time / seconds for e in denials], [(e.used + e.size) / scale for e in denials],
                         marker="x", color="red", zorder=5, label=f"denied ({len(denials)})")
        axes.set_xlabel(time_name)
        axes.ticklabel_format(axis="x", style="plain", useOffset=False)
        axes.set_ylabel(f"used ({unit})")
        more = f"; {left_out} more budgets not drawn" if left_out else ""
        axes.set_title(f"gpubudget: {_text(report.name)} — dashed lines are limits{more}")
        axes.set_ylim(bottom=0, top=peak / scale * 1.08)
        axes.legend(loc="upper left", fontsize="small")
        axes.grid(alpha=0.3)
        figure.tight_layout()
        try:
            figure.savefig(os.fspath(path), format=kind)
        finally:
            plt.close(figure)
