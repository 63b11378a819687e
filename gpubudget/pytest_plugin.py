"""A pytest plugin (installed with the package, entry point ``pytest11``): run a test inside a
budget and fail it on a denial, a leak, or a peak over its limit, the report in the failure.

Mark a test::

    @pytest.mark.gpu_budget("2GiB", peak="1.5GiB")
    def test_inference():
        ...

The test runs inside ``with gpu_budget("2GiB", name=<the test's name>):`` (so allocations
routed to the current budget, by the CuPy and PyTorch adapters or ``current_budget()``,
are charged to it); when it ends, it fails if any request was denied (``denials=True``
allows them), if blocks are still live in the budget (``leaks=True`` allows them), or if the
peak went over ``peak=`` (when given). The failure message holds the budget's report. Other
keyword arguments (``backend=``, ``align=``, ``track_stacks=``, ...) go to ``gpu_budget``. A
test that fails by itself keeps its own failure.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Final

import pytest

from .budget import gpu_budget
from .report import BudgetReport
from .units import format_size, parse_size

__all__ = ["MARKER", "budget_failures"]

MARKER: Final = "gpu_budget"
_OWN_OPTIONS: Final = ("peak", "denials", "leaks")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}(limit, *, peak=None, denials=False, leaks=False, **budget): run "
        "the test inside a gpubudget budget; fail it on a denial, a leak or a peak over peak=")


def budget_failures(report: BudgetReport, *, peak: int | None = None, denials: bool = False,
                    leaks: bool = False) -> list[str]:
    """Why a test that ran in the budget of ``report`` fails: one sentence per reason, none
    when it passes.

    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("64KiB", name="test", backend="host") as budget:
    ...     _ = budget.allocate(4096)
    ...     _ = budget.allocate(2**20)
    >>> for line in budget_failures(budget.report(), peak=1024):
    ...     print(line)
    1 request(s) denied (largest 1.00 MiB)
    1 block(s) still live when the test ended (4.00 KiB)
    peak 4.00 KiB, over the 1.00 KiB allowed
    """
    found = []
    if report.totals.denied and not denials:
        largest = max(item.largest_denied for item in report.walk())
        found.append(f"{report.totals.denied} request(s) denied (largest "
                     f"{format_size(largest)})")
    held = [block for item in report.walk() for block in item.live_blocks]
    if held and not leaks:
        found.append(f"{len(held)} block(s) still live when the test ended "
                     f"({format_size(sum(block.size for block in held))})")
    if peak is not None and report.peak > peak:
        found.append(f"peak {format_size(report.peak)}, over the {format_size(peak)} allowed")
    return found


def _options(marker: pytest.Mark, name: str) -> tuple[tuple[Any, ...], dict[str, Any],
                                                       dict[str, Any]]:
    """``gpu_budget``'s arguments, and this plugin's own options, from the marker."""
    kwargs = dict(marker.kwargs)
    own: dict[str, Any] = {key: kwargs.pop(key) for key in _OWN_OPTIONS if key in kwargs}
    if own.get("peak") is not None:
        own["peak"] = parse_size(own["peak"], what="gpu_budget marker's peak")
    kwargs.setdefault("name", name)
    return marker.args, kwargs, own


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    args, kwargs, own = _options(marker, item.name)
    budget = gpu_budget(*args, **kwargs)
    with budget:
        result = yield  # the test's own failure propagates from here, unchanged
    report = budget.report()
    failures = budget_failures(report, **own)
    if failures:
        pytest.fail(f"gpubudget: {'; '.join(failures)}\n\n{report}", pytrace=False)
    return result
