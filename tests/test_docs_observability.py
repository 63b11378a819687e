"""docs/observability.md shows what the tools print: its `top` is the renderer's, its
metrics are the collector's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpubudget.cli.top import TopOptions, render
from tests.test_top import two_devices

PAGE = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()


def test_the_top_shown_is_what_top_prints_at_that_width() -> None:
    block = PAGE.split("$ gpubudget top --once\n", 1)[1].split("```", 1)[0].splitlines()
    width = max(len(line) for line in block)
    printed = render(two_devices(), TopOptions(), 100)
    assert width <= 100 and block[1:] == printed[1:]  # the first line holds the time
    assert block[0].startswith("gpubudget top · ") and block[0].endswith(" · sort used ▼")


def test_the_tree_of_children_shown_is_what_top_prints() -> None:
    from tests.test_top import family_view

    block = PAGE.split("$ gpubudget top --once     # a process with two roots", 1)[1]
    lines = block.split("\n", 1)[1].split("```", 1)[0].splitlines()
    assert lines[1:] == render(family_view(), TopOptions(), 100)[1:]
    from gpubudget.hostledger.children import PAGE_WAIT
    from gpubudget.hostledger.layout import PAGE_ROWS, PAGES

    assert f"room for {PAGES * (PAGE_ROWS - 1):,} children" in PAGE
    assert f"in pages of {PAGE_ROWS - 1}" in PAGE and f"more than {PAGE_WAIT * 1000:g} ms" in PAGE


def test_the_metrics_listed_are_the_collectors() -> None:
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    from gpubudget.metrics import families
    from tests.test_top import view

    listed = set(re.findall(r"^\| `(gpubudget_[a-z_]+)`", PAGE, flags=re.M))
    made = {family.name + ("_total" if family.type == "counter" else "")
            for family in families(view(), {"GPU-8f3c": "0"})}
    assert listed == made
