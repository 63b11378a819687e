"""Numba inside budgets: an External Memory Management plugin whose device memory comes from
the calling thread's innermost budget.

>>> from numba import cuda                                      # doctest: +SKIP
>>> import gpubudget.numba
>>> cuda.set_memory_manager(gpubudget.numba.BudgetMemoryManager)  # doctest: +SKIP
>>> from gpubudget import gpu_budget                            # doctest: +SKIP
>>> with gpu_budget("1GiB", name="stencil") as budget:          # doctest: +SKIP
...     x = cuda.device_array(1024, dtype="float32")            # a block of the budget
...     budget.used
4096

Installing. Numba takes one memory manager per program, before its first CUDA context is
made: ``NUMBA_CUDA_MEMORY_MANAGER=gpubudget.numba`` in the environment, or
``numba.cuda.set_memory_manager(gpubudget.numba.BudgetMemoryManager)`` at the start.

Routing. Each ``memalloc`` (``cuda.device_array``, ``cuda.to_device``, a kernel's
temporaries) goes to the budget current in the calling thread (:func:`gpubudget.
current_budget`) when that budget's memory is on the device of Numba's context; outside
every budget, or under a budget of another device or in host memory, the allocation is
Numba's own (``cuMemAlloc``, freed as Numba frees). The block is tagged with the current
:func:`gpubudget.label` or ``"numba"``.

Denial. When the budget refuses, the frees Numba holds back (its pending deallocations) are
done and the request is asked once more; then Numba's out-of-memory error is raised: a
``CudaAPIError`` with code ``CUDA_ERROR_OUT_OF_MEMORY`` that is also an
:class:`~gpubudget.errors.AllocationDenied`, naming the budget, its limit and why.

Frees. A block goes back to its budget when Numba drops the memory, through Numba's own
queue of pending deallocations (so ``defer_cleanup()`` holds budget frees too), ordered
after the work queued on the legacy default stream before the free, which waits for every
blocking stream: no other work gets the block while a kernel may still use it.

``get_memory_info()`` answers the budget: ``free`` is what one allocation could still be
charged (:attr:`~gpubudget.Budget.available`), ``total`` its limit; outside every budget,
the device's. IPC handles of budget blocks are refused with a ``NotImplementedError`` naming
the budget (a handle would open the whole root's memory in the other process, whose use the
budget cannot see); memory allocated outside budgets exports as Numba's does.
"""

from __future__ import annotations

from typing import Final

from .adapter import holder
from .budget import Budget
from .errors import AllocationDenied
from .scope import current_budget, current_label

try:
    from cuda.bindings import driver as _driver
    from numba.cuda import MemoryInfo, MemoryPointer
    from numba.cuda.cudadrv.driver import CudaAPIError, NumbaCUDAMemoryManager
except ImportError as exc:  # pragma: no cover - exercised where numba-cuda is missing
    raise ImportError("gpubudget.numba needs numba-cuda (pip install 'gpubudget[numba]')"
                      ) from exc

__all__ = ["BudgetMemoryManager", "BudgetOutOfMemoryError"]

SOURCE: Final = "numba"
OUT_OF_MEMORY: Final = _driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class BudgetOutOfMemoryError(CudaAPIError, AllocationDenied):
    """Numba's out-of-memory error (``CudaAPIError``, code ``CUDA_ERROR_OUT_OF_MEMORY``) for
    a budget's denial; also an :class:`~gpubudget.errors.AllocationDenied` with its fields."""

    def __init__(self, denied: AllocationDenied) -> None:
        message = str(denied)
        Exception.__init__(self, OUT_OF_MEMORY, message)
        self.code = OUT_OF_MEMORY
        self.msg = message
        self.budget, self.refused_by = denied.budget, denied.refused_by
        self.reason, self.size, self.charged = denied.reason, denied.size, denied.charged


class _GiveBack:
    """Returns one block to its budget; queued in Numba's pending deallocations."""

    __slots__ = ("budget", "address")
    __name__ = "gpubudget_free"  # Numba's log line names the destructor

    def __init__(self, budget: Budget, address: int) -> None:
        self.budget = budget
        self.address = address

    def __call__(self, handle: object) -> None:
        # the legacy default stream (0): others get the block after the work queued before
        self.budget.free(self.address, stream=0)


class BudgetMemoryManager(NumbaCUDAMemoryManager):
    """Numba's EMM plugin over budgets; see the module docstring.

    It is Numba's own manager (``NumbaCUDAMemoryManager``) for memory outside budgets and
    for pinned, mapped and managed host memory; only device allocations under a budget of
    the context's device go to the budget.
    """

    def memalloc(self, size: int) -> MemoryPointer:
        budget = self.budget_here()
        if budget is None:
            return super().memalloc(size)
        if size == 0:  # what Numba asks for an empty array: no block, nothing to free
            return MemoryPointer(self.context, _driver.CUdeviceptr(0), 0)
        address = self._allocate(budget, size)
        give_back = _GiveBack(budget, address)
        queue = self.deallocations
        charged = budget.size_of(address)
        try:
            pointer = MemoryPointer(self.context, _driver.CUdeviceptr(address), size,
                                    finalizer=lambda: queue.add_item(give_back, address,
                                                                     charged))
        except BaseException:
            budget.free(address)
            raise
        return pointer

    def budget_here(self) -> Budget | None:
        """The calling thread's innermost budget if its memory is on this context's device,
        else ``None`` (Numba's own allocation)."""
        budget = current_budget()
        if budget is None or budget.device is None:
            return None
        device = getattr(getattr(self.context, "device", None), "id", None)
        return budget if budget.device == device else None

    def _allocate(self, budget: Budget, size: int) -> int:
        tag = current_label() or SOURCE
        try:
            return budget.allocate(size, tag=tag, raise_on_denial=True)
        except AllocationDenied:
            self.deallocations.clear()  # Numba's held-back frees, then once more
            try:
                return budget.allocate(size, tag=tag, raise_on_denial=True)
            except AllocationDenied as denied:
                raise BudgetOutOfMemoryError(denied) from None

    def get_memory_info(self) -> MemoryInfo:
        budget = self.budget_here()
        if budget is None:
            return super().get_memory_info()
        return MemoryInfo(free=budget.available, total=budget.limit)

    def get_ipc_handle(self, memory: MemoryPointer) -> object:
        address = int(memory.device_pointer_value or 0)
        budget = holder(address)
        if budget is not None:
            raise NotImplementedError(
                f"gpubudget.numba: memory at {address:#x} is a block of budget "
                f"{budget.name!r}; IPC handles of budget blocks are not supported (the other "
                f"process would map the whole root's memory, which the budget cannot see it "
                f"use): allocate memory to share outside every budget")
        return super().get_ipc_handle(memory)


_numba_memory_manager: Final = BudgetMemoryManager
"""What ``NUMBA_CUDA_MEMORY_MANAGER=gpubudget.numba`` makes Numba use."""
