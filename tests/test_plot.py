"""The plot: the format follows the suffix, any name draws as plain text, many budgets are
capped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpubudget import BudgetReport, gpu_budget
from gpubudget.plot import MAX_LINES, plot_format, plot_report, time_unit

KiB = 1024


def test_the_format_follows_the_suffix() -> None:
    assert [plot_format(p) for p in ("a.png", "b.SVG", "c.Pdf", Path("d/e.svg"))] == [
        "png", "svg", "pdf", "svg"]
    for path in ("out.jpg", "out", "out.png.txt", "\x1b[2J.gif"):
        with pytest.raises(ValueError, match="the format follows the file's suffix, one of "
                                             r"\.png, \.svg, \.pdf") as caught:
            plot_format(path)
        assert "\x1b" not in str(caught.value)


def report_of(*names: str) -> BudgetReport:
    with gpu_budget("64KiB", name=names[0]) as root:
        for name in names[1:]:
            with gpu_budget("16KiB", name=name) as child:
                block = child.allocate(4 * KiB)
                assert child.allocate(32 * KiB) is None
                assert block is not None and child.free(block)
    return root.report()


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_each_format_is_written(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / f"plot{suffix}"
    plot_report(report_of("root", "child"), path)
    data = path.read_bytes()
    assert data.startswith({".png": b"\x89PNG", ".svg": b"<?xml", ".pdf": b"%PDF"}[suffix])


def test_names_draw_as_plain_text_whatever_they_hold(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    names = ("cost $\\frac{1}$ each", "_private", "tab\there\x1b[2J", "模型")
    path = tmp_path / "names.svg"
    plot_report(report_of(*names), path)  # mathtext would refuse "$\frac{1}$"
    text = path.read_text()
    assert "cost $\\frac{1}$ each" in text  # drawn as written, not as math
    assert "_private (peak" in text  # a leading "_" would leave it out of the legend
    assert "tab\\there\\x1b[2J" in text and "\x1b" not in text
    assert "模型" in text


def test_many_budgets_are_capped(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    children = [f"child{index:02}" for index in range(20)]
    path = tmp_path / "many.svg"
    plot_report(report_of("root", *children), path)
    text = path.read_text()
    left_out = 20 - (MAX_LINES - 1)
    assert f"{left_out} more budgets not drawn" in text
    assert sum(1 for name in children if f"{name} (peak" in text) == MAX_LINES - 1


def test_a_report_without_events(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with gpu_budget("64KiB", name="idle") as root:
        pass
    path = tmp_path / "idle.png"
    root.report().plot(str(path))
    assert path.read_bytes().startswith(b"\x89PNG")


def test_the_time_axis_is_in_a_readable_unit_without_an_offset(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "short.svg"
    report = report_of("root", "child")  # a run of some microseconds (more on a busy machine)
    plot_report(report, path)
    text = path.read_text()
    name, _ = time_unit(report.timeline[-1].time)
    assert name in ("microseconds", "milliseconds") and name in text
    assert ">seconds<" not in text
    words = re.sub(r'(?:id|href|xlink:href|clip-path)="[^"]*"|url\(#[^)]*\)', "", text)
    assert "1e" not in words.replace("1e3", "") and "×10" not in words  # no offset, no exponent


def test_the_legend_says_the_peak_the_line_draws_after_reset_peak(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with gpu_budget("64KiB", name="phases") as pool:
        block = pool.allocate(8 * KiB)
        assert block is not None and pool.free(block)
        pool.reset_peak()
        assert pool.allocate(4 * KiB) is not None
    path = tmp_path / "phases.svg"
    plot_report(pool.report(), path)
    text = path.read_text()
    assert "highest drawn 8.00 KiB; peak since reset_peak() 4.00 KiB" in text
    plot_report(report_of("root", "child"), path)  # without a reset: the peak alone
    assert "highest drawn" not in path.read_text() and "(peak 4.00 KiB)" in path.read_text()
