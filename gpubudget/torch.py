"""PyTorch inside budgets: ``with gpubudget.torch.allocations(budget):`` routes its memory.

>>> import torch                                               # doctest: +SKIP
>>> from gpubudget import gpu_budget, torch as gbt             # doctest: +SKIP
>>> with gpu_budget("2GiB", name="detector") as budget:        # doctest: +SKIP
...     with gbt.allocations():
...         x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
...     budget.used >= 256 * 2**20
True

Each budget gets a ``torch.cuda.MemPool`` whose allocator is the budget: PyTorch asks it for
segments (``torch._C._cuda_customAllocator`` takes two C callbacks; gpubudget's are
``ctypes`` functions, no compiled library needed). Inside :class:`allocations` the calling
thread's PyTorch allocations on the budget's device go to that pool (PyTorch routes per
thread). PyTorch caches segments: the budget is charged for the segments, and
``report().usage`` shows how much of them live tensors hold and how much is cached.

Denial. When the budget refuses a segment, PyTorch frees its own cached segments of the pool
and asks again, then raises ``torch.OutOfMemoryError``; the denial, with the budget that
refused and why, is in the report, and an ``OutOfMemoryError`` leaving an ``allocations``
block gets a note saying which budget refused. Nothing raises through the C callbacks: an
internal error is recorded and answered with a null pointer.

Lifetime. Tensors may outlive the blocks. Once the budget's scope has ended and no
``allocations`` block uses its pool any more, gpubudget drops the pool and calls
``torch.cuda.empty_cache()``: cached segments return to the budget; segments still holding
tensors return when PyTorch frees them (after the tensors are gone, at the next
``torch.cuda.empty_cache()``, which :func:`release_cached` calls). The budget releases when
the last has returned. At interpreter exit the callbacks go inert.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import threading
import weakref
from typing import Any, ClassVar, Final

from . import interrupts
from .budget import Budget
from .routing import RoutedPool, Routing
from .scope import current_label

__all__ = ["allocations", "release_cached"]

SOURCE: Final = "torch"
TESTED_WITH: Final = "2.11"
_ALLOC: Final = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE: Final = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_void_p)
_lock = threading.Lock()
_kept: list[_Pool] = []  # pools PyTorch may still call: until retired with no segment left


def _torch() -> Any:
    """PyTorch, with the private allocator API this adapter needs, or a clear error."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        raise ImportError("gpubudget.torch needs PyTorch with CUDA") from exc
    missing = [name for name, found in (
        ("torch.cuda.MemPool", hasattr(torch.cuda, "MemPool")),
        ("torch.cuda.use_mem_pool", hasattr(torch.cuda, "use_mem_pool")),
        ("torch._C._cuda_customAllocator", hasattr(torch._C, "_cuda_customAllocator")),
    ) if not found]
    if missing:
        raise ImportError(
            f"gpubudget.torch needs {', '.join(missing)}, which PyTorch {torch.__version__} "
            f"does not have (a CPU-only build, or an older release); it is tested with "
            f"PyTorch {TESTED_WITH}, built with CUDA")
    return torch


class _Pool(RoutedPool):
    """One budget's ``MemPool`` and the C callbacks that charge its segments."""

    def __init__(self, torch: Any, budget: Budget) -> None:
        self.torch = torch
        self.segments: dict[int, int] = {}  # address -> charged bytes
        self.closed = False  # interpreter exit: answer without touching anything
        self._alloc = _ALLOC(self._allocate)
        self._free = _FREE(self._release)
        allocator = torch._C._cuda_customAllocator(
            ctypes.cast(self._alloc, ctypes.c_void_p).value,
            ctypes.cast(self._free, ctypes.c_void_p).value)
        self.mempool: Any = torch.cuda.MemPool(allocator)
        super().__init__(budget)
        budget.report_usage(SOURCE, self.usage)

    @interrupts.callback
    def _allocate(self, size: int, device: int, stream: int) -> int | None:
        if self.closed:
            return None
        address = None
        try:
            address = self.budget.allocate(size, tag=current_label() or SOURCE)
            if address is not None:
                charged = self.budget.size_of(address)
                with self.lock:
                    self.segments[address] = charged
        except BaseException as exc:  # noqa: BLE001 - nothing may cross the C callback
            self._failed("alloc", exc)
            if address is not None and address not in self.segments:
                self.budget.free(address)  # all or nothing: PyTorch gets no pointer
            address = None
        interrupts.pass_on()
        return address

    @interrupts.callback
    def _release(self, address: int, size: int, device: int, stream: int) -> None:
        if self.closed:
            return
        try:
            with self.lock:
                self.segments.pop(address, None)
                done = self.mempool is None and not self.segments
            self.budget.free(address)  # PyTorch synchronizes before it releases a segment
            if done:
                _forget(self)
        except BaseException as exc:  # noqa: BLE001
            self._failed("free", exc)
        interrupts.pass_on()

    def _failed(self, where: str, exc: BaseException) -> None:
        try:
            if isinstance(exc, KeyboardInterrupt):
                interrupts.defer()
                self.budget.record_denial(0, "interrupted")
            else:
                self.budget.record_error(f"torch {where}: {type(exc).__name__}: {exc}")
        except BaseException:  # noqa: BLE001
            pass

    def usage(self) -> tuple[int, int]:
        """(bytes charged for segments, bytes of them in live tensors), from PyTorch's own
        snapshot of the pool."""
        with self.lock:
            charged = sum(self.segments.values())
            mempool = self.mempool
        if mempool is None:  # retired: PyTorch frees a segment only once no tensor is in it
            return charged, charged
        in_use = sum(int(segment.get("allocated_size", 0)) for segment in mempool.snapshot())
        return charged, in_use

    def retire(self) -> None:
        """Drop the pool (PyTorch keeps it while tensors are in it) and empty the cache."""
        with self.lock:
            mempool, self.mempool = self.mempool, None
        del mempool
        self.torch.cuda.empty_cache()
        with self.lock:
            done = not self.segments
        if done:
            _forget(self)


def _forget(pool: _Pool) -> None:
    """A retired pool with no segment left: PyTorch will not call it again."""
    with _lock:
        if pool in _kept:
            _kept.remove(pool)


class allocations(Routing[_Pool]):  # noqa: N801 - used like a function
    """Route this thread's PyTorch allocations on ``budget``'s device to ``budget`` (default:
    the current one) inside the ``with`` block; see the module docstring.

    Raises ``BudgetError`` outside any budget or for a budget in host memory, and
    ``ImportError`` naming what is missing where PyTorch lacks the API it needs.
    """

    __slots__ = ()
    framework = "torch"
    _pools: ClassVar[weakref.WeakKeyDictionary[Budget, _Pool]] = weakref.WeakKeyDictionary()
    _lock: ClassVar[threading.Lock] = _lock

    @classmethod
    def framework_module(cls) -> Any:
        return _torch()

    def new_pool(self, module: Any, budget: Budget) -> _Pool:
        pool = _Pool(module, budget)
        _kept.append(pool)  # the class lock is held
        return pool

    def route(self, module: Any, pool: _Pool) -> Any:
        return module.cuda.use_mem_pool(pool.mempool, device=pool.budget.device)

    def explain(self, exc: BaseException, pool: _Pool) -> None:
        """Add a note to PyTorch's out-of-memory error naming the budget that refused."""
        out_of_memory = getattr(pool.torch, "OutOfMemoryError", None)
        add_note = getattr(exc, "add_note", None)  # Python 3.11 and later
        if out_of_memory is None or not isinstance(exc, out_of_memory) or add_note is None:
            return
        denials = [d for report in pool.budget.report().walk() for d in report.denials]
        if denials:
            last = max(denials, key=lambda denial: denial.largest)
            add_note(f"gpubudget: budget {pool.budget.name!r} (limit {pool.budget.limit} "
                     f"bytes) refused a segment: {last.reason} of {last.refused_by!r}, "
                     f"largest refused {last.largest} bytes; see budget.report()")


def release_cached() -> None:
    """Give cached PyTorch segments back to their budgets: ``torch.cuda.empty_cache()``."""
    _torch().cuda.empty_cache()


@atexit.register
def _inert_at_exit() -> None:
    """PyTorch frees pools still alive after modules are torn down: answer, touch nothing."""
    with _lock:
        pools = list(_kept)
    for pool in pools:
        pool.closed = True
