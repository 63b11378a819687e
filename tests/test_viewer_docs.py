"""docs/viewer.md stays true: its examples run and give what they show, and the views and
options it names are the page's."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

from gpubudget.viewer import page_html, model_from_report
from gpubudget import gpu_budget

DOC = Path(__file__).resolve().parent.parent / "docs" / "viewer.md"


def test_the_examples_run() -> None:
    result = doctest.testfile(str(DOC), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 8 and result.failed == 0


def test_what_it_names_is_on_the_page() -> None:
    text = DOC.read_text(encoding="utf-8")
    with gpu_budget("1MiB", name="pool", backend="host") as pool:
        block = pool.allocate(1000, tag="t")
    page = page_html(model_from_report(pool.report()))
    assert block is not None and pool.free(block)
    for tab in ("Blocks", "Leaks", "Denials", "Compare"):
        assert f"*{tab}*" in text and f'data-tab="{tab.lower()}"' in page
    for option in ("tag", "innermost frame", "budget"):
        assert f'">{option}</option>' in page
    assert "*Colour by*" in text and "*Tags first*" in text and "tags first" in page
    assert "*the chosen moment*" in text and "the chosen moment" in page
    assert re.search(r"--compare OTHER", text)
