"""CuPy interop: CuPy arrays placed on budget blocks.

>>> from gpubudget import gpu_budget, cupy as gbc          # doctest: +SKIP
>>> with gpu_budget("1GiB") as budget:                       # doctest: +SKIP
...     x = gbc.empty((1024, 1024), "float32", tag="x")       # a block of the current budget
...     x[:] = 1
...     float(x.sum())
1048576.0

CuPy is optional and imported on first use.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

from .budget import Budget
from .errors import BudgetError
from .scope import current_budget

__all__ = ["array_on", "empty"]


def _cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise ImportError("gpubudget.cupy needs CuPy (pip install cupy-cuda13x)") from exc


def array_on(address: int, shape: int | tuple[int, ...], dtype: Any = "float32", *,
             owner: object = None) -> Any:
    """A CuPy array viewing device memory at ``address`` (for example a budget block).

    The caller keeps the block alive for as long as the array is used; ``owner`` is kept
    referenced by the array's memory object, so an object that frees the block when it dies
    can be passed here.
    """
    cp = _cupy()
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape_t) * cp.dtype(dtype).itemsize
    memory = cp.cuda.UnownedMemory(address, nbytes, owner, cp.cuda.runtime.getDevice())
    return cp.ndarray(shape_t, dtype, cp.cuda.MemoryPointer(memory, 0))


class _BlockOwner:
    """Frees a budget block when the CuPy array on it is garbage-collected."""

    __slots__ = ("budget", "address")

    def __init__(self, budget: Budget, address: int) -> None:
        self.budget = budget
        self.address = address

    def __del__(self) -> None:
        self.budget.free(self.address)


def empty(shape: int | tuple[int, ...], dtype: Any = "float32", *,
          budget: Budget | None = None, tag: str | None = None) -> Any:
    """An uninitialised CuPy array in a new block of ``budget`` (default: the current one),
    freed back to the budget when the array is collected. Raises ``BudgetError`` when the
    budget refuses (see its report for why)."""
    cp = _cupy()
    target = budget if budget is not None else current_budget()
    if target is None:
        raise BudgetError("gpubudget.cupy.empty() needs a budget: call it inside gpu_budget()")
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(math.prod(shape_t) * cp.dtype(dtype).itemsize, 1)
    address = target.allocate(nbytes, tag=tag)
    if address is None:
        raise BudgetError(
            f"budget {target.name!r} refused {nbytes} bytes for a CuPy array of shape {shape_t}"
        )
    return array_on(address, shape_t, dtype, owner=_BlockOwner(target, address))
