"""What the CuPy and PyTorch adapters share: a framework's pool per budget, and the ``with``
block that routes a thread's allocations of that framework into it.

A framework allocates through a pool of its own (CuPy's ``MemoryPool``, PyTorch's
``MemPool``\\ s) whose allocator is the budget. :class:`RoutedPool` counts the
``allocations`` blocks using it and, each time the budget's scope has ended and the last
block has left, retires what the pool holds idle (what retiring means is the framework's);
a block may still enter an exited budget, so a pool is retired as often as it falls idle.
Once retired with nothing left, the adapter forgets it (:meth:`Routing.forget`): the map of
pools does not keep budgets alive. :class:`Routing` is the ``with`` block: it finds the
budget, takes its pool, and enters the framework's own routing.

Locks. The class lock of a :class:`Routing` subclass guards only its budget -> pool map and
who joins a pool (a pool's users change under both, so a pool is never forgotten while a
block joins it); a pool's own lock guards only its counters. Neither is ever held while the
framework or a budget is called (a pool is made, installed and retired outside both), so a
call that comes back into gpubudget (CuPy freeing a chunk) cannot find a lock its own thread
holds. The order, where both are held: the class lock, then the pool's.
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
    """A framework's pool for one budget; see the module docstring.

    Made outside every lock, possibly by two threads at once for one budget: only the one
    that wins the race is :meth:`install`-ed and the other is dropped, so making one must
    have no effect of its own (a framework object whose end has effects, such as PyTorch's
    ``MemPool``, is made only once the pool is in use).
    """

    source: ClassVar[str]

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.lock = threading.Lock()
        self.users = 0  # allocations blocks inside which the pool is in use

    def install(self) -> None:
        """The pool is now the budget's: report its usage, retire it when the scope ends."""
        self.budget.report_usage(self.source, self.usage)
        self.budget.call_on_exit(self.retire_if_unused)

    def join(self) -> None:
        """One more block uses the pool (called with the class lock held)."""
        with self.lock:
            self.users += 1

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
        self.retire_if_unused()

    def retire_if_unused(self) -> None:
        """Once the scope has ended and no block uses the pool: :meth:`retire` what it holds
        idle. A block that enters and leaves the exited budget later retires it again."""
        with self.lock:
            if self.users or self.budget.state == "open":
                return
        self.retire()

    def unused(self) -> bool:
        """Whether the budget's scope has ended and no block uses the pool."""
        with self.lock:
            return not self.users and self.budget.state != "open"

    @abstractmethod
    def usage(self) -> tuple[int, ...]:
        """What the pool holds of the budget (see ``AdapterHooks.report_usage``)."""

    @abstractmethod
    def retire(self) -> None:
        """Give what the pool holds idle back to the budget (the framework's way); never
        disturb what a block entered meanwhile uses."""


class Routing(ABC, Generic[P]):
    """``with`` block: this thread's allocations of one framework go to a budget's pool.

    One object may be entered by several threads at once, and again inside itself: what
    each ``__exit__`` undoes is found per thread.
    """

    framework: ClassVar[str]
    _pools: ClassVar[weakref.WeakKeyDictionary[Budget, Any]]
    _lock: ClassVar[threading.Lock]

    __slots__ = ("_budget", "_entered")

    def __init__(self, budget: Budget | None = None) -> None:
        if budget is not None and not isinstance(budget, Budget):
            raise TypeError(f"budget must be a gpubudget.Budget or None, got {budget!r}")
        self._budget = budget
        self._entered: dict[int, list[tuple[P, Any]]] = {}

    def __enter__(self) -> Budget:
        module = self.framework_module()
        budget = target_budget(self._budget, f"gpubudget.{self.framework}.allocations()")
        self.prepare(module)
        pool = self._pool_of(module, budget)
        try:
            manager = self.route(module, pool)
            manager.__enter__()
        except BaseException:
            pool.leave()
            raise
        entered = self._entered.setdefault(threading.get_ident(), [])
        entered.append((pool, manager))
        return budget

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._leave(exc_type, exc, tb)

    def _leave(self, exc_type: type[BaseException] | None, exc: BaseException | None,
               tb: TracebackType | None) -> None:
        ident = threading.get_ident()
        entered = self._entered.get(ident)
        if not entered:
            raise RuntimeError(f"gpubudget.{self.framework}.allocations() exited in a thread "
                               f"that did not enter it")
        pool, manager = entered.pop()
        if not entered:
            del self._entered[ident]
        try:
            manager.__exit__(exc_type, exc, tb)
        finally:
            if exc is not None:
                self.explain(exc, pool)
            pool.leave()

    def _pool_of(self, module: Any, budget: Budget) -> P:
        """The budget's pool, joined; a new one made (outside the lock) if it has none."""
        with self._lock:
            pool: P | None = self._pools.get(budget)
            if pool is not None:
                pool.join()
                return pool
        fresh = self.new_pool(module, budget)
        with self._lock:
            pool = self._pools.get(budget)
            ours = pool is None  # else another thread made one meanwhile: ours is dropped
            if ours:
                self._pools[budget] = pool = fresh
            assert pool is not None
            pool.join()
        if ours:
            fresh.install()
        return pool

    @classmethod
    def forget(cls, pool: RoutedPool) -> bool:
        """Drop ``pool`` from the budget -> pool map if no block uses it (a block entered
        later makes a new one); ``False`` if one does."""
        with cls._lock:
            with pool.lock:
                if pool.users:
                    return False
            if cls._pools.get(pool.budget) is pool:
                del cls._pools[pool.budget]
        return True

    @classmethod
    def pools(cls) -> list[Any]:
        """The pools of budgets that have one now."""
        with cls._lock:
            return list(cls._pools.values())

    @classmethod
    @abstractmethod
    def framework_module(cls) -> Any:
        """The framework's module, or ``ImportError`` saying what is missing."""

    def prepare(self, module: Any) -> None:
        """Before a block takes its pool, with no lock held (nothing, here)."""

    @abstractmethod
    def new_pool(self, module: Any, budget: Budget) -> P:
        """A new pool of the framework for ``budget``, with no effect until installed."""

    @abstractmethod
    def route(self, module: Any, pool: P) -> Any:
        """The framework's context manager that routes this thread into ``pool``."""

    def explain(self, exc: BaseException, pool: P) -> None:
        """Add to ``exc`` leaving the block what the budget knows of it (nothing, here)."""
