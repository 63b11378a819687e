"""The examples in docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib
import importlib.machinery

import pytest

MODULES = [
    "gpubudget",
    "gpubudget.units",
    "gpubudget.arena",
    "gpubudget.budget",
    "gpubudget.scope",
    "gpubudget.report",
    "gpubudget.tracefile.format",
    "gpubudget.replay.run",
    "gpubudget.replay.fit",
    "gpubudget.plot",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    if str(module.__file__).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        pytest.skip(f"{name} is compiled: doctest cannot see its functions' docstrings; the "
                    f"pure-Python run checks them")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
