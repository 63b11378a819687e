"""The summary at the top of the viewer's page, written as plain HTML: every budget's peak
against its limit (a bar), its allocations, denials and leaks. It is there before the
script has drawn anything (a screenshot taken at load, a browser without script), and the
script hides it once the page is drawn.

A *leak* here is a block still live when the record ends whose budget's ``with`` block had
exited: what ``BudgetReport.leaks`` lists.
"""

from __future__ import annotations

from typing import Final

from ..units import format_size
from .model import ViewModel

__all__ = ["leaks_per_budget", "overview_html"]

ROWS_SHOWN: Final = 40
"""Budgets listed at most (parents first); the rest are counted."""


def _text(text: str) -> str:
    return (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def leaks_per_budget(model: ViewModel) -> list[int]:
    """Per budget, its blocks live at the end of the record after its scope exited.

    Examples
    --------
    >>> from gpubudget import gpu_budget
    >>> from gpubudget.viewer import model_from_report
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     block = pool.allocate(1000)
    >>> leaks_per_budget(model_from_report(pool.report()))
    [1]
    """
    counts = [0] * len(model.budgets)
    exited = [b.exited is not None for b in model.budgets]
    for budget, to in zip(model.block_budget, model.block_to):
        if to < 0 and exited[budget]:
            counts[budget] += 1
    return counts


def _depths(model: ViewModel) -> list[int]:
    depths = [0] * len(model.budgets)
    for index, budget in enumerate(model.budgets):  # parents come before children
        if budget.parent is not None:
            depths[index] = depths[budget.parent] + 1
    return depths


def _order(model: ViewModel) -> list[int]:
    children: list[list[int]] = [[] for _ in model.budgets]
    roots: list[int] = []
    for index, budget in enumerate(model.budgets):
        (roots if budget.parent is None else children[budget.parent]).append(index)
    order: list[int] = []
    stack = roots[::-1]
    while stack and len(order) < ROWS_SHOWN:
        index = stack.pop()
        order.append(index)
        stack.extend(children[index][::-1])
    return order


def overview_html(model: ViewModel, compare: ViewModel | None = None) -> str:
    """The summary of ``model`` as an HTML fragment (a ``<section>``)."""
    leaks = leaks_per_budget(model)
    depths = _depths(model)
    torch = model.source == "torch"
    rows = []
    for index in _order(model):
        budget = model.budgets[index]
        scale = max(budget.limit, budget.peak, 1)
        share = 100.0 * budget.peak / scale
        limit = format_size(budget.limit) if budget.limit else "—"
        cells = [
            f'<td style="padding-left:{6 + 14 * min(depths[index], 8)}px">'
            f'{_text(budget.name)}</td>',
            f'<td class="num">{limit}</td>',
            f'<td class="num">{format_size(budget.peak)}</td>',
            f'<td><div class="bar"><div style="width:{share:.1f}%"></div></div></td>',
            f'<td class="num">{budget.allocations:,}</td>',
            f'<td class="num{" denied" if budget.denied else ""}">{budget.denied:,}</td>',
            f'<td class="num{" denied" if leaks[index] else ""}">{leaks[index]:,}</td>',
        ]
        rows.append("<tr>" + "".join(cells) + "</tr>")
    more = len(model.budgets) - len(rows)
    if more > 0:
        rows.append(f'<tr><td colspan="7">… and {more:,} more budgets</td></tr>')
    peak = "peak reserved" if torch else "peak used"
    head = ("<tr><th>budget</th><th class=\"num\">limit</th>"
            f"<th class=\"num\">{peak}</th><th>of its limit</th><th class=\"num\">allocations"
            "</th><th class=\"num\">denied</th><th class=\"num\">leaked blocks</th></tr>")
    said = [", ".join(_counted(n, what) for n, what in (
        (len(model.budgets), "budget"), (len(model.block_budget), "block"),
        (len(model.denials), "denial"), (sum(leaks), "leaked block")))]
    said += model.notes
    if compare is not None:
        said.append(f"compared with {compare.title}")
    return ('<section id="overview"><p>' + _text("; ".join(said)) + "</p>"
            '<table class="overview"><thead>' + head + "</thead><tbody>" + "".join(rows) +
            "</tbody></table><p class=\"help\">Drawing the timeline…</p></section>")


def _counted(count: int, what: str) -> str:
    """``count`` and ``what``, plural unless there is one.

    >>> _counted(1, "denial"), _counted(2, "leaked block")
    ('1 denial', '2 leaked blocks')
    """
    return f"{count:,} {what}{'' if count == 1 else 's'}"
