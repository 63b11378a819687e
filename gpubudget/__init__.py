"""gpubudget: scoped GPU memory budgets for TensorRT and anything else that allocates.

>>> from gpubudget import gpu_budget
>>> with gpu_budget("4GiB", align=256, name="shared", backend="host") as pool:
...     with gpu_budget("2GiB", name="detector") as detector:
...         block = detector.allocate(512 * 2**20, tag="weights")
>>> pool.used == detector.used == 512 * 2**20
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from . import _core
from ._core import EVENT_LOG_LIMIT
from .budget import TRACE_ENV, Budget, gpu_budget
from .errors import (
    AllocationDenied,
    BackendError,
    BudgetError,
    BudgetNestingError,
    GpuBudgetError,
    InvariantError,
    TraceError,
    TraceWriteError,
)
from .scope import bind, current_budget, current_label, label, use
from .units import format_size, parse_size

if TYPE_CHECKING:  # at run time, loaded when first named (below): reports need dataclasses
    from .report import BudgetReport, Denial, LiveBlock

__all__ = [
    "EVENT_LOG_LIMIT",
    "compiled",
    "TRACE_ENV",
    "AllocationDenied",
    "BackendError",
    "Budget",
    "BudgetError",
    "BudgetNestingError",
    "BudgetReport",
    "Denial",
    "GpuBudgetError",
    "InvariantError",
    "LiveBlock",
    "TraceError",
    "TraceWriteError",
    "bind",
    "current_budget",
    "current_label",
    "format_size",
    "gpu_budget",
    "label",
    "parse_size",
    "use",
]

__version__ = "0.1.0"

compiled: Final = _core.native is not None
"""Whether the allocation core's hot path runs as C (the ``_native`` extension) or as pure
Python; see the README."""

_LATER: Final = {"BudgetReport": "report", "Denial": "report", "LiveBlock": "report"}
"""Public names whose module loads when one of them is first named, not at import."""
_SUBMODULES: Final = ("report", "tracefile")
"""Submodules that ``import gpubudget`` loaded before they were left for first use: still
found as its attributes (``gpubudget.tracefile.read_trace``) without importing them."""

if not TYPE_CHECKING:  # mypy sees the names imported above, and no catch-all
    def __getattr__(name: str) -> object:
        from importlib import import_module

        if name in _SUBMODULES:
            return import_module(f".{name}", __name__)  # now an attribute of the package
        module = _LATER.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(import_module(f".{module}", __name__), name)
        globals()[name] = value  # found directly from now on
        return value

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(_LATER))
