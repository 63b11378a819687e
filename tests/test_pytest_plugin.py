"""The pytest plugin: a test marked gpu_budget fails when it overspends, passes when the limit
is raised, and its failure holds the report (run in a separate pytest with pytester)."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True)
def _this_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pytest that pytester starts imports gpubudget from this checkout, not from
    wherever the package is installed (the plugin's entry point names a module only)."""
    root = str(Path(__file__).resolve().parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p))


def _plugin_flags() -> tuple[str, ...]:
    """``-p gpubudget.pytest_plugin`` where the package runs without being installed (its
    ``pytest11`` entry point unknown: a source tree on ``PYTHONPATH``), nothing where pytest
    loads it by itself."""
    installed = any(entry.value == "gpubudget.pytest_plugin"
                    for entry in importlib.metadata.entry_points(group="pytest11"))
    return () if installed else ("-p", "gpubudget.pytest_plugin")

_TEST = """
import pytest
from gpubudget import current_budget

@pytest.mark.gpu_budget({limit!r}, backend="host", {extra})
def test_inference():
    budget = current_budget()
    assert budget is not None and budget.name == "test_inference"
    block = budget.allocate("3MiB", tag="activations")
    assert block is not None, "the allocation was denied"
    {free}
"""


def _run(pytester: pytest.Pytester, limit: str, extra: str = "",
         free: str = "budget.free(block)") -> pytest.RunResult:
    pytester.makepyfile(test_model=_TEST.format(limit=limit, extra=extra, free=free))
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", *_plugin_flags())


def test_a_test_that_overspends_fails_and_passes_with_a_higher_limit(
        pytester: pytest.Pytester) -> None:
    over = _run(pytester, "2MiB")
    over.assert_outcomes(failed=1)
    over.stdout.fnmatch_lines(["*the allocation was denied*"])  # its own failure comes first
    raised = _run(pytester, "4MiB")
    raised.assert_outcomes(passed=1)


def test_a_denial_the_test_tolerates_still_fails_it_with_the_report(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_model="""
        import pytest
        from gpubudget import current_budget

        @pytest.mark.gpu_budget("2MiB", backend="host")
        def test_falls_back():
            budget = current_budget()
            big = budget.allocate("3MiB")
            small = budget.allocate("1MiB") if big is None else big
            budget.free(small)
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", *_plugin_flags())
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*gpubudget: 1 request(s) denied (largest 3.00 MiB)*",
        "test_falls_back [[]host[]] (released): used 0 B of 2.00 MiB, peak 1.00 MiB*",
        "*denied 1x, over the limit of 'test_falls_back'*"])


def test_a_leak_and_a_peak_over_the_limit_fail(pytester: pytest.Pytester) -> None:
    leak = _run(pytester, "4MiB", free="pass")
    leak.assert_outcomes(failed=1)
    leak.stdout.fnmatch_lines(["*1 block(s) still live when the test ended (3.00 MiB)*"])
    allowed = _run(pytester, "4MiB", extra="leaks=True", free="pass")
    allowed.assert_outcomes(passed=1)
    peak = _run(pytester, "4MiB", extra='peak="2MiB"')
    peak.assert_outcomes(failed=1)
    peak.stdout.fnmatch_lines(["*peak 3.00 MiB, over the 2.00 MiB allowed*"])
    _run(pytester, "4MiB", extra='peak="3MiB"').assert_outcomes(passed=1)


def test_marker_mistakes_are_usage_errors_at_collection_naming_each_test(
        pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_marks="""
        import pytest

        @pytest.mark.gpu_budget("4MiB", backend="host", peek="2MiB")
        def test_misspelt():
            raise AssertionError("never runs")

        @pytest.mark.gpu_budget(backend="host")
        def test_no_limit():
            raise AssertionError("never runs")

        @pytest.mark.gpu_budget("2MiB", backend="host", peak="3MiB")
        def test_peak_above_the_limit():
            raise AssertionError("never runs")

        @pytest.mark.gpu_budget("lots", backend="host", denials="yes")
        def test_bad_values():
            raise AssertionError("never runs")

        @pytest.mark.gpu_budget("4MiB", backend="host", peak="1MiB")
        def test_fine():
            raise AssertionError("never runs either: the session stops at collection")
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", *_plugin_flags())
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([
        "ERROR: test_marks.py::test_misspelt: gpu_budget marker: unknown keyword peek= (did "
        "you mean peak=?)",
        "ERROR: test_marks.py::test_no_limit: gpu_budget marker without a limit: *",
        "ERROR: test_marks.py::test_peak_above_the_limit: gpu_budget marker: peak='3MiB' "
        "(3.00 MiB) is above the limit (2.00 MiB)*",
        "ERROR: test_marks.py::test_bad_values: gpu_budget marker: denials must be True or "
        "False, got 'yes'"])
    assert "never runs" not in result.stdout.str() + result.stderr.str()
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_a_bad_size_in_a_marker_names_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_size="""
        import pytest

        @pytest.mark.gpu_budget("lots", backend="host")
        def test_model():
            pass
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", *_plugin_flags())
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: test_size.py::test_model: gpu_budget marker: *'lots'*"])


def test_the_host_memory_warning_points_at_the_marked_test(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpubudget.backends import cuda_usable

    if cuda_usable():
        pytest.skip("a usable GPU: budgets run on it, and nothing warns")
    monkeypatch.delenv("GPUBUDGET_BACKEND", raising=False)
    pytester.makepyfile(test_host="""
        import pytest

        @pytest.mark.gpu_budget("4MiB")
        def test_model():
            pass
    """)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-W",
                                           "always::RuntimeWarning", *_plugin_flags())
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(["test_host.py::test_model",
                                 "  */test_host.py:3: RuntimeWarning: gpubudget: no usable CUDA "
                                 "device or PyCUDA; budgets are simulated in host memory*"])
    assert "pluggy" not in result.stdout.str()
