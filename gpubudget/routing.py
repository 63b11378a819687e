"""What the CuPy and PyTorch adapters share: a framework's pool per budget, and the ``with``
block that routes a thread's allocations of that framework into it.

A framework allocates through a pool of its own (CuPy's ``MemoryPool``, PyTorch's
``MemPool``) whose allocator is the budget. :class:`RoutedPool` counts the ``allocations``
blocks using it and retires it once the budget's scope has ended and none does; what
retiring means (giving the cache back) is the framework's. :class:`Routing` is the ``with``
block: it finds the budget, takes its pool, and enters the framework's own routing.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Any, ClassVar, Generic, TypeVar

from .budget import Budget
from .errors import BudgetError
from .scope import current_budget

__all__ = ["RoutedPool", "Routing", "target_budget"]

P = TypeVar("P", bound="RoutedPool")


def target_budget(budget: Budget | None, what: str, device: bool = True) -> Budget:
    """``budget``, else the current one, checked: it can allocate, and (``device``) its
    memory is a CUDA device's."""
    target = budget if budget is not None else current_budget()
    if target is None:
        raise BudgetError(f"{what} needs a budget: call it inside `with gpu_budget(...)` "
                          f"or pass budget=")
    if not isinstance(target, Budget):
        raise TypeError(f"budget must be a gpubudget.Budget, got {target!r}")
    if target.state not in ("open", "exited"):
        raise BudgetError(f"{what}: budget {target.name!r} is {target.state}")
    if device and target.device is None:
        raise BudgetError(f"{what}: budget {target.name!r} is in host memory, which a GPU "
                          f"framework cannot use; enter it on a CUDA device (backend='pycuda')")
    return target


class RoutedPool(ABC):
    """A framework's pool for one budget; see the module docstring."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.lock = threading.Lock()
        self.users = 0  # allocations blocks inside which the pool is in use
        self.retired = False
        if budget.state == "open":  # else the end of the allocations block retires it
            budget.call_on_exit(self.retire_if_unused)

    def join(self) -> None:
        with self.lock:
            self.users += 1

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
        self.retire_if_unused()

    def retire_if_unused(self) -> None:
        """Once the scope has ended and no block uses the pool: :meth:`retire` it, once."""
        with self.lock:
            if self.users or self.retired or self.budget.state == "open":
                return
            self.retired = True
        self.retire()

    @abstractmethod
    def retire(self) -> None:
        """Give what the pool caches back to the budget (the framework's way)."""


class Routing(ABC, Generic[P]):
    """``with`` block: this thread's allocations of one framework go to a budget's pool."""

    framework: ClassVar[str]
    _pools: ClassVar[weakref.WeakKeyDictionary[Budget, Any]]
    _lock: ClassVar[threading.Lock]

    __slots__ = ("_budget", "_entered")

    def __init__(self, budget: Budget | None = None) -> None:
        if budget is not None and not isinstance(budget, Budget):
            raise TypeError(f"budget must be a gpubudget.Budget or None, got {budget!r}")
        self._budget = budget
        self._entered: list[tuple[P, Any]] = []

    def __enter__(self) -> Budget:
        module = self.framework_module()
        budget = target_budget(self._budget, f"gpubudget.{self.framework}.allocations()")
        with self._lock:
            pool: P | None = self._pools.get(budget)
            if pool is None or pool.retired:
                pool = self._pools[budget] = self.new_pool(module, budget)
            pool.join()
        try:
            manager = self.route(module, pool)
            manager.__enter__()
        except BaseException:
            pool.leave()
            raise
        self._entered.append((pool, manager))
        return budget

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        pool, manager = self._entered.pop()
        try:
            manager.__exit__(exc_type, exc, tb)
        finally:
            if exc is not None:
                self.explain(exc, pool)
            pool.leave()

    @classmethod
    @abstractmethod
    def framework_module(cls) -> Any:
        """The framework's module, or ``ImportError`` saying what is missing."""

    @abstractmethod
    def new_pool(self, module: Any, budget: Budget) -> P:
        """A new pool of the framework for ``budget``."""

    @abstractmethod
    def route(self, module: Any, pool: P) -> Any:
        """The framework's context manager that routes this thread into ``pool``."""

    def explain(self, exc: BaseException, pool: P) -> None:
        """Add to ``exc`` leaving the block what the budget knows of it (nothing, here)."""
