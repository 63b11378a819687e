"""CuPy inside budgets: ``with gpubudget.cupy.allocations(budget):`` routes CuPy's memory.

>>> import cupy as cp                                          # doctest: +SKIP
>>> from gpubudget import gpu_budget, cupy as gbc             # doctest: +SKIP
>>> with gpu_budget("1GiB", name="preprocess") as budget:     # doctest: +SKIP
...     with gbc.allocations():
...         x = cp.ones((1024, 1024), cp.float32)             # memory of the budget
...     float(x.sum())
1048576.0

Each budget gets a ``cupy.cuda.MemoryPool`` whose allocator is the budget: the pool asks the
budget for chunks, splits them among arrays and caches what arrays free, so arrays cost what
they cost in CuPy's own pool. Under :class:`allocations`, every CuPy allocation the calling
thread makes on the budget's device (CuPy's allocator is per thread) comes from that pool;
other devices keep the allocator they had. Chunks are tagged with the current
:func:`gpubudget.label` or ``"cupy"``. The budget is charged for the chunks;
``report().usage`` shows how much of them arrays use and how much the pool caches.

Denial. When the budget refuses a chunk, the pool's cache goes back to the budget and the
request is asked once more; then CuPy's ``OutOfMemoryError`` is raised (also an
:class:`~gpubudget.errors.AllocationDenied`) naming the budget, its limit and why.

Lifetime. Arrays may outlive the blocks. Once the budget's scope has ended and no
``allocations`` block uses its pool, the pool's cache goes back to the budget; chunks still
under arrays return when those arrays are gone and :func:`release_cached` runs (a later
``allocations`` block of any budget does it too). Returning a chunk synchronizes its device
first, as ``cudaFree`` does. CuPy is optional and imported on first use.

:func:`empty` and :func:`array_on` put single arrays on budget blocks without a pool.
"""

from __future__ import annotations

import importlib
import math
import threading
import weakref
from typing import Any, ClassVar, Final

from . import interrupts
from .budget import Budget
from .errors import AllocationDenied
from .interrupts import STATE
from .routing import RoutedPool, Routing, target_budget
from .scope import current_label

__all__ = ["allocations", "array_on", "empty", "release_cached"]

SOURCE: Final = "cupy"
_lock = threading.Lock()
_draining: list[_Pool] = []  # retired pools whose chunks arrays still use
_errors: dict[type, type] = {}  # CuPy's OutOfMemoryError -> our subclass of it


def _cupy() -> Any:
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise ImportError("gpubudget.cupy needs CuPy (pip install cupy-cuda13x)") from exc


class _Block:
    """Owns one budget block under CuPy memory; gives it back when CuPy drops the memory.

    ``stream`` orders the free after the work queued there (``empty``); ``None`` means a pool
    chunk, returned after synchronizing the device, as ``cudaFree`` would."""

    __slots__ = ("pool", "budget", "address", "nbytes", "stream")

    def __init__(self, pool: _Pool | None, budget: Budget, address: int, nbytes: int,
                 stream: int | None) -> None:
        self.pool = pool
        self.budget = budget
        self.address = address
        self.nbytes = nbytes
        self.stream = stream

    @interrupts.callback
    def __del__(self) -> None:  # runs inside CuPy's deallocation: never raises
        try:
            if self.pool is not None:
                self.pool.synchronize()
            if self.budget.free(self.address, stream=self.stream) and self.pool is not None:
                self.pool.change(-self.nbytes)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, KeyboardInterrupt):
                interrupts.defer()
        if STATE.pending:
            interrupts.pass_on()


class _Pool(RoutedPool):
    """One budget's CuPy ``MemoryPool``; its allocator gives the budget's blocks."""

    def __init__(self, cp: Any, budget: Budget, device: int) -> None:
        self.cp = cp
        self.device = device
        self.charged = 0  # bytes of the budget's blocks the pool holds
        self.pool: Any = cp.cuda.MemoryPool(self._chunk)
        super().__init__(budget)
        budget.report_usage(SOURCE, self.usage)

    def _chunk(self, size: int) -> Any:
        """The pool's allocator: a new chunk of ``size`` bytes from the budget."""
        tag = current_label() or SOURCE
        try:
            address = self.budget.allocate(size, tag=tag, raise_on_denial=True)
        except AllocationDenied:
            self.free_cache()  # the pool's cache goes back to the budget, then once more
            try:
                address = self.budget.allocate(size, tag=tag, raise_on_denial=True)
            except AllocationDenied as denied:
                raise _out_of_memory(self.cp, denied) from None
        nbytes = self.budget.size_of(address)
        self.change(nbytes)
        owner = _Block(self, self.budget, address, nbytes, None)
        memory = self.cp.cuda.UnownedMemory(address, size, owner, self.device)
        return self.cp.cuda.MemoryPointer(memory, 0)

    def change(self, delta: int) -> None:
        with self.lock:
            self.charged += delta

    def synchronize(self) -> None:
        self.cp.cuda.Device(self.device).synchronize()

    def in_use(self) -> int:
        with self.cp.cuda.Device(self.device):
            return int(self.pool.used_bytes())

    def usage(self) -> tuple[int, int]:
        """(bytes charged for chunks, bytes of them under live arrays)."""
        return self.charged, self.in_use()

    def free_cache(self) -> None:
        with self.cp.cuda.Device(self.device):
            self.pool.free_all_blocks()

    def retire(self) -> None:
        """Give the cache back; keep the pool while arrays still use its chunks (dropping
        it would free them under the arrays)."""
        with _lock:
            _draining.append(self)
        release_cached()


class _Router:
    """The allocator function CuPy calls under one :class:`allocations` block."""

    __slots__ = ("device", "pool", "previous")

    def __init__(self, pool: _Pool, previous: Any) -> None:
        self.device = pool.device
        self.pool = pool.pool.malloc
        self.previous = previous  # CuPy's allocator for other devices

    def __call__(self, size: int) -> Any:
        if _current_device() != self.device:
            return self.previous(size)
        return self.pool(size)


def _current_device() -> int:
    device: int = _cupy().cuda.runtime.getDevice()
    return device


def release_cached() -> None:
    """Give the chunks that budgets' CuPy pools cache back to the budgets, and let go of the
    retired pools whose arrays are all gone."""
    with _lock:
        pools = list(allocations._pools.values()) + list(_draining)
    done = []
    for pool in pools:
        pool.free_cache()
        if pool.retired and pool.in_use() == 0:
            done.append(pool)
    with _lock:
        for pool in done:
            if pool in _draining:
                _draining.remove(pool)


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


class allocations(Routing[_Pool]):  # noqa: N801 - used like a function
    """Route this thread's CuPy allocations on ``budget``'s device to ``budget`` (default:
    the current one) inside the ``with`` block; see the module docstring.

    Raises ``BudgetError`` outside any budget, or for a budget in host memory (CuPy needs
    device memory), and ``ImportError`` without CuPy.
    """

    __slots__ = ()
    framework = "cupy"
    _pools: ClassVar[weakref.WeakKeyDictionary[Budget, _Pool]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = _lock

    @classmethod
    def framework_module(cls) -> Any:
        return _cupy()

    def new_pool(self, module: Any, budget: Budget) -> _Pool:
        if _draining:
            release_cached()
        assert budget.device is not None
        return _Pool(module, budget, budget.device)

    def route(self, module: Any, pool: _Pool) -> Any:
        return module.cuda.using_allocator(_Router(pool, module.cuda.get_allocator()))


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
    target = target_budget(budget, "gpubudget.cupy.empty()")
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = max(math.prod(shape_t) * cp.dtype(dtype).itemsize, 1)
    try:
        address = target.allocate(nbytes, tag=tag or current_label() or SOURCE,
                                  raise_on_denial=True)
    except AllocationDenied as denied:
        raise _out_of_memory(cp, denied) from None
    return array_on(address, shape_t, dtype,
                    owner=_Block(None, target, address, target.size_of(address), 0))
