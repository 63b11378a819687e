"""Exceptions raised by gpubudget at the Python API.

::

    Exception
     └── GpuBudgetError                 anything gpubudget raises on purpose
          ├── BudgetError               (also MemoryError) a budget cannot get its memory:
          │                             the device refused the root reservation, the parent
          │                             cannot set aside a child's ``reserve=``, or no budget
          │                             is active where one is required
          ├── BudgetNestingError        (also RuntimeError) a budget exited out of order
          └── BackendError              a backend is unknown or unusable

Bad arguments raise the built-in ``ValueError``/``TypeError`` with the offending input quoted.
Nothing here is ever raised inside a TensorRT callback: callbacks answer ``None``/``False``.
"""

from __future__ import annotations

__all__ = ["BackendError", "BudgetError", "BudgetNestingError", "GpuBudgetError"]


class GpuBudgetError(Exception):
    """Base class of every exception gpubudget raises on purpose."""


class BudgetError(GpuBudgetError, MemoryError):
    """A budget could not obtain the memory it needs (raised at entry, never in a callback)."""


class BudgetNestingError(GpuBudgetError, RuntimeError):
    """A budget was exited while a budget entered inside it was still active."""


class BackendError(GpuBudgetError):
    """A memory backend is unknown or cannot be used on this machine."""
