"""docs/hosts.md: its examples run and give what they show; the numbers it states are the
code's."""

from __future__ import annotations

import doctest
from pathlib import Path

from gpubudget.hostledger import book
from gpubudget.hostledger.layout import LOG_LENGTH, SLOTS, VERSION
from gpubudget.hostledger.sizing import HEADROOM, MIN_HEADROOM
from gpubudget.units import MiB

PAGE = Path(__file__).resolve().parent.parent / "docs" / "hosts.md"


def test_the_examples_run() -> None:
    result = doctest.testfile(str(PAGE), module_relative=False,
                              optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_the_numbers_it_states_are_the_codes() -> None:
    text = PAGE.read_text(encoding="utf-8")
    assert f"headroom of {HEADROOM // MiB} MiB" in text
    assert f"at least {MIN_HEADROOM // MiB} MiB" in text
    assert f"the last {LOG_LENGTH} changes" in text and f"{SLOTS:,} roots" in text
    assert f"more than {book.LOCK_SECONDS:g} s" in text
    assert f"later ones {book.STUCK_SECONDS * 1000:g} ms" in text
    assert f"format is version {VERSION}" in text
    from gpubudget.hostledger.children import PAGE_WAIT
    from gpubudget.hostledger.layout import PAGE_ROWS, PAGES

    assert f"{PAGES:,} pages of {PAGE_ROWS - 1} rows" in text
    assert f"({PAGES * (PAGE_ROWS - 1):,} children of live roots" in text
    assert f"more than {PAGE_WAIT * 1000:g} ms" in text
