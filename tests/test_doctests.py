"""The examples in docstrings run and give what they show: every module of the package with an
example that is not marked ``+SKIP`` (those need a GPU, TensorRT or PyTorch)."""

from __future__ import annotations

import doctest
import importlib
import importlib.machinery
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpubudget"


def _has_examples(source: str) -> bool:
    return any(line.lstrip().startswith(">>> ") and "+SKIP" not in line
               for line in source.splitlines())


MODULES = sorted(
    ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for path in PACKAGE.rglob("*.py") if _has_examples(path.read_text(encoding="utf-8")))


def test_the_modules_with_examples_are_found() -> None:
    assert {"gpubudget", "gpubudget.budget", "gpubudget._budget.view", "gpubudget.units",
            "gpubudget.tracefile.reader"} <= set(MODULES)
    assert "gpubudget.torch" not in MODULES  # its examples need a GPU and are skipped


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(name)
    if str(module.__file__).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        pytest.skip(f"{name} is compiled: doctest cannot see its functions' docstrings; the "
                    f"pure-Python run checks them")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
