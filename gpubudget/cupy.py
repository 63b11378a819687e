"""CuPy inside budgets: ``with gpubudget.cupy.allocations(budget):`` routes CuPy's memory.

>>> import cupy as cp                                          # doctest: +SKIP
>>> from gpubudget import gpu_budget, cupy as gbc             # doctest: +SKIP
>>> with gpu_budget("1GiB", name="preprocess") as budget:     # doctest: +SKIP
...     with gbc.allocations():
...         x = cp.ones((1024, 1024), cp.float32)             # a block of the budget
...     float(x.sum())
1048576.0

Under :class:`allocations`, every CuPy allocation the calling thread makes on the budget's
device (CuPy's allocator is per thread) is a block of the budget, tagged with the current
:func:`gpubudget.label` or ``"cupy"``; other devices keep the allocator they had. A denial
raises CuPy's ``OutOfMemoryError`` (also a :class:`~gpubudget.errors.AllocationDenied`) naming
the budget, its limit and why. Arrays may outlive the block: each frees its block back to
the budget when CuPy frees it, stream-ordered on the stream that was current when it was
allocated (the legacy default stream, 0, included). No CuPy pool caches on top of the
budget: what CuPy holds is what arrays use, and ``report().usage`` says so. CuPy is optional
and imported on first use.

:func:`empty` and :func:`array_on` put single arrays on budget blocks without routing.
"""

from __future__ import annotations

import importlib
import math
import threading
import weakref
from types import TracebackType
from typing import Any, Final

from . import interrupts
from .budget import Budget
from .errors import AllocationDenied, BudgetError
from .interrupts import STATE
from .scope import current_budget, current_label

__all__ = ["allocations", "array_on", "empty"]

SOURCE: Final = "cupy"
_lock = threading.Lock()
_held: weakref.WeakKeyDictionary[Budget, _Held] = weakref.WeakKeyDictionary()
_errors: dict[type, type] = {}  # CuPy's OutOfMemoryError -> our subclass of it


def _cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise ImportError("gpubudget.cupy needs CuPy (pip install cupy-cuda13x)") from exc


class _Held:
    """Bytes of one budget that CuPy arrays hold (charged, aligned); its usage probe."""

    __slots__ = ("bytes", "lock")

    def __init__(self) -> None:
        self.bytes = 0
        self.lock = threading.Lock()

    def change(self, delta: int) -> None:
        with self.lock:
            self.bytes += delta

    def probe(self) -> tuple[int, int]:
        return self.bytes, self.bytes  # nothing cached: all of it is in arrays


def _held_of(budget: Budget) -> _Held:
    with _lock:
        held = _held.get(budget)
        if held is None:
            held = _held[budget] = _Held()
            budget.report_usage(SOURCE, held.probe)
        return held


class _Block:
    """Owns one budget block under a CuPy array; frees it when CuPy drops the memory."""

    __slots__ = ("budget", "address", "nbytes", "stream", "held")

    def __init__(self, budget: Budget, address: int, nbytes: int, stream: int,
                 held: _Held) -> None:
        self.budget = budget
        self.address = address
        self.nbytes = nbytes
        self.stream = stream
        self.held = held

    @interrupts.callback
    def __del__(self) -> None:  # runs inside CuPy's deallocation: never raises
        try:
            if self.budget.free(self.address, stream=self.stream):
                self.held.change(-self.nbytes)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                interrupts.defer()
        if STATE.pending:
            interrupts.pass_on()


class _Router:
    """The allocator function CuPy calls under :class:`allocations`."""

    def __init__(self, cp: Any, budget: Budget, device: int, previous: Any) -> None:
        self.cp = cp
        self.budget = budget
        self.device = device
        self.previous = previous  # CuPy's allocator for other devices and empty arrays
        self.held = _held_of(budget)

    def __call__(self, size: int) -> Any:
        cp = self.cp
        if size == 0 or cp.cuda.runtime.getDevice() != self.device:
            return self.previous(size)
        stream = cp.cuda.get_current_stream().ptr
        try:
            address = self.budget.allocate(size, tag=current_label() or SOURCE,
                                           stream=stream, raise_on_denial=True)
        except AllocationDenied as denied:
            raise _out_of_memory(cp, denied) from None
        nbytes = self.budget.size_of(address)
        self.held.change(nbytes)
        owner = _Block(self.budget, address, nbytes, stream, self.held)
        memory = cp.cuda.UnownedMemory(address, size, owner, self.device)
        return cp.cuda.MemoryPointer(memory, 0)


def _out_of_memory(cp: Any, denied: AllocationDenied) -> BaseException:
    """CuPy's ``OutOfMemoryError``, also an ``AllocationDenied``, with our message."""
    base = cp.cuda.memory.OutOfMemoryError
    with _lock:
        cls = _errors.get(base)
        if cls is None:
            def __init__(self: Any, denied: AllocationDenied) -> None:
                MemoryError.__init__(self, str(denied))
                self.budget, self.refused_by = denied.budget, denied.refused_by
                self.reason, self.size, self.charged = denied.reason, denied.size, denied.charged

            cls = _errors[base] = type("BudgetOutOfMemoryError", (base, AllocationDenied),
                                       {"__init__": __init__, "__module__": __name__})
    error: BaseException = cls(denied)
    return error


def _target(budget: Budget | None, what: str) -> Budget:
    target = budget if budget is not None else current_budget()
    if target is None:
        raise BudgetError(f"{what} needs a budget: call it inside `with gpu_budget(...)` "
                          f"or pass budget=")
    if not isinstance(target, Budget):
        raise TypeError(f"budget must be a gpubudget.Budget, got {target!r}")
    if target.state not in ("open", "exited"):
        raise BudgetError(f"{what}: budget {target.name!r} is {target.state}")
    return target


class allocations:  # noqa: N801 - used like a function: ``with allocations():``
    """Route this thread's CuPy allocations on ``budget``'s device to ``budget`` (default:
    the current one) inside the ``with`` block; see the module docstring.

    Raises ``BudgetError`` outside any budget, or for a budget in host memory (CuPy needs
    device memory), and ``ImportError`` without CuPy.
    """

    __slots__ = ("_budget", "_entered")

    def __init__(self, budget: Budget | None = None) -> None:
        if budget is not None and not isinstance(budget, Budget):
            raise TypeError(f"budget must be a gpubudget.Budget or None, got {budget!r}")
        self._budget = budget
        self._entered: list[Any] = []  # CuPy's using_allocator context managers

    def __enter__(self) -> Budget:
        cp = _cupy()
        budget = _target(self._budget, "gpubudget.cupy.allocations()")
        device = budget.device
        if device is None:
            raise BudgetError(f"budget {budget.name!r} is in host memory, which CuPy cannot "
                              f"use; enter it on a CUDA device (backend='pycuda')")
        manager = cp.cuda.using_allocator(_Router(cp, budget, device, cp.cuda.get_allocator()))
        manager.__enter__()
        self._entered.append(manager)
        return budget

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._entered.pop().__exit__(exc_type, exc, tb)


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


def empty(shape: int | tuple[int, ...], dtype: Any = "float32", *,
          budget: Budget | None = None, tag: str | None = None) -> Any:
    """An uninitialised CuPy array in a new block of ``budget`` (default: the current one),
    freed back to the budget when the array is collected. Raises CuPy's
    ``OutOfMemoryError`` (an :class:`~gpubudget.errors.AllocationDenied`) when the budget
    refuses."""
    cp = _cupy()
    target = _target(budget, "gpubudget.cupy.empty()")
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(math.prod(shape_t) * cp.dtype(dtype).itemsize, 1)
    try:
        address = target.allocate(nbytes, tag=tag or current_label() or SOURCE,
                                  raise_on_denial=True)
    except AllocationDenied as denied:
        raise _out_of_memory(cp, denied) from None
    held = _held_of(target)
    charged = target.size_of(address)
    held.change(charged)
    return array_on(address, shape_t, dtype,
                    owner=_Block(target, address, charged, 0, held))
