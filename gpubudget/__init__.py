"""gpubudget: scoped GPU memory budgets for TensorRT and anything else that allocates.

>>> from gpubudget import gpu_budget
>>> with gpu_budget("4GiB", align=256, name="shared", backend="host") as pool:
...     with gpu_budget("2GiB", name="detector") as detector:
...         block = detector.allocate(512 * 2**20, tag="weights")
>>> pool.used == detector.used == 512 * 2**20
True
"""

from __future__ import annotations

from typing import Final

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
from .report import BudgetReport, Denial, LiveBlock
from .scope import bind, current_budget, current_label, label, use
from .units import format_size, parse_size

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
