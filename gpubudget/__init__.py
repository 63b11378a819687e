"""gpubudget: scoped GPU memory budgets for TensorRT and anything else that allocates.

>>> from gpubudget import gpu_budget
>>> with gpu_budget("4GiB", align=256, name="shared", backend="host") as pool:
...     with gpu_budget("2GiB", name="detector") as detector:
...         block = detector.allocate(512 * 2**20, tag="weights")
>>> pool.used == detector.used == 512 * 2**20
True
"""

from __future__ import annotations

from .budget import Budget, gpu_budget
from .errors import BackendError, BudgetError, BudgetNestingError, GpuBudgetError
from .report import BudgetReport, Denial, LiveBlock
from .scope import bind, current_budget, current_label, label
from .units import format_size, parse_size

__all__ = [
    "BackendError",
    "Budget",
    "BudgetError",
    "BudgetNestingError",
    "BudgetReport",
    "Denial",
    "GpuBudgetError",
    "LiveBlock",
    "bind",
    "current_budget",
    "current_label",
    "format_size",
    "gpu_budget",
    "label",
    "parse_size",
]

__version__ = "0.1.0"
