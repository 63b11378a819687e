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

A marker that cannot work is a usage error when the tests are collected, before any runs,
naming each test: a misspelt keyword (``peek=``), no limit, a bad size, ``denials`` or
``leaks`` not ``True``/``False``, a ``peak`` above the limit (the peak never exceeds the
limit, so it would check nothing). Warnings from entering the budget (such as the one saying
that budgets run in host memory, without a GPU) point at the marked test.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import warnings
from collections.abc import Generator
from typing import Any, Final

import pytest

from .budget import Budget, gpu_budget
from .report import BudgetReport
from .units import format_size, parse_size

__all__ = ["MARKER", "budget_failures", "marker_options"]

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


def marker_options(args: tuple[Any, ...], kwargs: dict[str, Any], name: str
                   ) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """``gpu_budget``'s arguments and this plugin's own options from a marker's, checked:
    a ``ValueError`` that says what is wrong with the marker (see the module docstring).

    >>> marker_options(("2GiB",), {"peek": "1GiB"}, "test_model")
    Traceback (most recent call last):
    ...
    ValueError: gpu_budget marker: unknown keyword peek= (did you mean peak=?)
    >>> marker_options(("2GiB",), {"peak": "3GiB"}, "test_model")
    Traceback (most recent call last):
    ...
    ValueError: gpu_budget marker: peak='3GiB' (3.00 GiB) is above the limit (2.00 GiB): a peak never exceeds the limit, so it would check nothing
    """
    kwargs = dict(kwargs)
    known = [key for key in inspect.signature(Budget.__init__).parameters if key != "self"]
    for key in kwargs:
        if key not in known and key not in _OWN_OPTIONS:
            close = difflib.get_close_matches(key, [*_OWN_OPTIONS, *known], n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise ValueError(f"{MARKER} marker: unknown keyword {key}={hint}")
    own: dict[str, Any] = {key: kwargs.pop(key) for key in _OWN_OPTIONS if key in kwargs}
    if not args and "limit" not in kwargs:
        raise ValueError(f"{MARKER} marker without a limit: @pytest.mark.{MARKER}(\"2GiB\", "
                         f"...)")
    if len(args) > 1:
        raise ValueError(f"{MARKER} marker: one positional argument (the limit), got "
                         f"{len(args)}: {args!r}")
    for key in ("denials", "leaks"):
        if key in own and not isinstance(own[key], bool):
            raise ValueError(f"{MARKER} marker: {key} must be True or False, got "
                             f"{own[key]!r}")
    kwargs.setdefault("name", name)
    try:
        limit = gpu_budget(*args, **kwargs).limit  # checks every argument; enters nothing
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{MARKER} marker: {exc}") from None
    if own.get("peak") is not None:
        given = own["peak"]
        try:
            own["peak"] = parse_size(given, what="peak")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{MARKER} marker: {exc}") from None
        if limit and own["peak"] > limit:
            raise ValueError(f"{MARKER} marker: peak={given!r} ({format_size(own['peak'])}) "
                             f"is above the limit ({format_size(limit)}): a peak never "
                             f"exceeds the limit, so it would check nothing")
    return args, kwargs, own


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Check every marker before any test runs: a bad one is a usage error naming its
    test."""
    errors = []
    for item in items:
        marker = item.get_closest_marker(MARKER)
        if marker is None:
            continue
        try:
            marker_options(marker.args, dict(marker.kwargs), item.name)
        except ValueError as exc:
            errors.append(f"{item.nodeid}: {exc}")
    if errors:
        raise pytest.UsageError(*errors)


def _where(item: pytest.Item) -> tuple[str, int]:
    """The file and line of the marked test (its first decorator's line)."""
    code = getattr(getattr(item, "function", None), "__code__", None)
    if code is not None:
        return code.co_filename, code.co_firstlineno
    path, line, _ = item.reportinfo()
    return str(path), (line or 0) + 1


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return (yield)
    args, kwargs, own = marker_options(marker.args, dict(marker.kwargs), item.name)
    budget = gpu_budget(*args, **kwargs)
    with contextlib.ExitStack() as scope:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scope.enter_context(budget)
        filename, line = _where(item)
        for warning in caught:  # said where the test is, not in pytest's machinery
            warnings.warn_explicit(warning.message, warning.category, filename, line)
        result = yield  # the test's own failure propagates from here, unchanged
    report = budget.report()
    failures = budget_failures(report, **own)
    if failures:
        pytest.fail(f"gpubudget: {'; '.join(failures)}\n\n{report}", pytrace=False)
    return result
