"""The examples in docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "gpubudget",
    "gpubudget.units",
    "gpubudget.arena",
    "gpubudget.budget",
    "gpubudget.scope",
    "gpubudget.report",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
