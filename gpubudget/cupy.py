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
``allocations`` block of any budget does it for retired pools too); ``report().usage``
says what waits (``waiting_in_use``, ``waiting_cached``). A block may enter the budget again
after its scope ended: the same pool serves it and retires again when it leaves. Returning a
chunk synchronizes its device first, as ``cudaFree`` does; a pool gives back only chunks no
array uses, so pools retire while other threads route. CuPy is optional and imported on
first use.

Library memory. A cached FFT plan keeps its work area for as long as it stays in CuPy's plan
cache (one per thread and device). A plan made inside a block takes its work area from the
budget: it is charged there and shown in the report (``usage[i].library``); when the pool
retires, gpubudget drops those plans from the plan caches of the threads that routed into
it (CuPy makes them again at next use), so they never keep a budget from releasing.
cuBLAS's own workspace is not allocated through CuPy: it is outside every budget (a root's
``outside_bytes`` counts it).

:func:`empty` and :func:`array_on` put single arrays on budget blocks without a pool.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import math
import operator
import sys
import threading
import weakref
from typing import Any, ClassVar, Final

from .adapter import by_device, callback_failed, holder
from .budget import Budget
from .errors import AllocationDenied, BudgetError
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

    def __del__(self) -> int | None:  # runs inside CuPy's deallocation: never raises
        try:
            if self.pool is not None:
                self.pool.synchronize()
            if self.budget.free(self.address, stream=self.stream) and self.pool is not None:
                self.pool.forget(self.address)
        except BaseException as exc:  # noqa: BLE001
            # returned: Python drops it in C, after the finalizer's last instruction
            return callback_failed(self.budget, "cupy free", exc)
        return None


class _Pool(RoutedPool):
    """One budget's CuPy ``MemoryPool``; its allocator gives the budget's blocks.

    It also remembers the FFT plan caches of the threads that routed into it (CuPy keeps
    one per thread and device), to find the plans whose work areas are its chunks."""

    source = SOURCE

    def __init__(self, cp: Any, budget: Budget, device: int) -> None:
        super().__init__(budget)
        self.cp = cp
        self.device = device
        self.chunks: dict[int, int] = {}  # address -> charged bytes of the chunks it holds
        self.plan_caches: dict[int, Any] = {}  # id -> a thread's cupy.fft PlanCache
        self.pool: Any = cp.cuda.MemoryPool(self._chunk)

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
        with self.lock:
            self.chunks[address] = nbytes
        owner = _Block(self, self.budget, address, nbytes, None)
        memory = self.cp.cuda.UnownedMemory(address, size, owner, self.device)
        return self.cp.cuda.MemoryPointer(memory, 0)

    def forget(self, address: int) -> None:
        with self.lock:
            self.chunks.pop(address, None)

    def synchronize(self) -> None:
        self.cp.cuda.Device(self.device).synchronize()

    def in_use(self) -> int:
        with self.cp.cuda.Device(self.device):
            return int(self.pool.used_bytes())

    def usage(self) -> tuple[int, ...]:
        """(bytes charged for chunks, bytes of them under live arrays, bytes of them that
        cached FFT plans hold, 0: nothing outside the budget, and once the pool is retired
        the bytes under arrays and the bytes cached that wait to go back)."""
        with self.lock:
            charged = sum(self.chunks.values())
        in_use = self.in_use()
        library = sum(nbytes for _, _, nbytes in self.plans())
        if not self.unused():
            return charged, in_use, library, 0, 0, 0
        return charged, in_use, library, 0, in_use, max(charged - in_use, 0)

    def remember_plan_cache(self) -> None:
        """In a thread leaving a block: keep its FFT plan cache for this device (if it has
        used CuPy's FFT at all) to look into later."""
        fft_cache = sys.modules.get("cupy.fft._cache")
        if fft_cache is None:
            return
        with self.cp.cuda.Device(self.device):
            cache = fft_cache.get_plan_cache()
        with self.lock:
            self.plan_caches[id(cache)] = cache

    def plans(self) -> list[tuple[Any, Any, int]]:
        """(cache, key, bytes) of each cached FFT plan with a work area in this pool's chunks."""
        with self.lock:
            caches = list(self.plan_caches.values())
            chunks = sorted(self.chunks.items())
        found = []
        for cache in caches:
            for key, node in list(cache):
                work = getattr(node.plan, "work_area", None)  # a list for multi-GPU plans
                nbytes = 0
                areas: list[Any] = work if isinstance(work, list) else [work]
                for area in areas:
                    address = getattr(area, "ptr", None)
                    if isinstance(address, int) and _inside(address, chunks):
                        nbytes += int(area.mem.size)
                if nbytes:
                    found.append((cache, key, nbytes))
        return found

    def free_cache(self) -> None:
        with self.cp.cuda.Device(self.device):
            self.pool.free_all_blocks()

    def retire(self) -> None:
        """Drop the FFT plans whose work areas are the budget's (CuPy makes them again at
        next use), give the cache back, and keep the pool while arrays still use its chunks
        (dropping it would free them under the arrays). A plan cache is CuPy's per thread:
        a plan deleted from another thread's cache stays valid for a call that holds it."""
        for cache, key, _ in self.plans():
            with contextlib.suppress(KeyError):
                del cache[key]
        with self.lock:
            self.plan_caches.clear()
        with _lock:
            if self not in _draining:
                _draining.append(self)
        _release([self])

    def done(self) -> bool:
        """Retired with no chunk left: nothing more will come back."""
        with self.lock:
            empty = not self.chunks
        return empty and self.unused()


def _inside(address: int, chunks: list[tuple[int, int]]) -> bool:
    """Whether ``address`` lies in one of ``chunks`` ((start, bytes), sorted by start)."""
    index = bisect.bisect_right(chunks, (address, math.inf)) - 1
    return index >= 0 and address < chunks[index][0] + chunks[index][1]


class _Route:
    """CuPy's ``using_allocator`` with the budget's router; on the way out, the thread's
    FFT plan cache is remembered by the pool."""

    __slots__ = ("pool", "using")

    def __init__(self, cp: Any, pool: _Pool) -> None:
        self.pool = pool
        # CuPy calls this for every array the thread makes: the device checked and the
        # budget's pool called in C where the C core runs
        self.using = cp.cuda.using_allocator(by_device(
            cp.cuda.runtime.getDevice, pool.device, pool.pool.malloc, cp.cuda.get_allocator()))

    def __enter__(self) -> None:
        self.using.__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            self.using.__exit__(*exc)
        finally:
            self.pool.remember_plan_cache()


def _current_device() -> int:
    device: int = _cupy().cuda.runtime.getDevice()
    return device


def release_cached() -> None:
    """Give the chunks that budgets' CuPy pools cache back to the budgets, and let go of the
    retired pools whose arrays are all gone. Safe while other threads route: a pool frees
    only the chunks no array uses."""
    pools = allocations.pools()
    with _lock:
        pools += [pool for pool in _draining if pool not in pools]
    _release(pools)


def _release(pools: list[_Pool]) -> None:
    """Free the caches of ``pools``; forget those retired with nothing left."""
    for pool in pools:
        pool.free_cache()
    for pool in pools:
        if pool.done() and allocations.forget(pool):
            with _lock:
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

    def prepare(self, module: Any) -> None:
        if _draining:  # retired pools whose arrays may be gone by now (busy ones untouched)
            with _lock:
                draining = list(_draining)
            _release(draining)

    def new_pool(self, module: Any, budget: Budget) -> _Pool:
        assert budget.device is not None
        return _Pool(module, budget, budget.device)

    def route(self, module: Any, pool: _Pool) -> Any:
        return _Route(module, pool)


def array_on(address: int, shape: int | tuple[int, ...], dtype: Any = "float32", *,
             owner: object = None) -> Any:
    """A CuPy array viewing device memory at ``address`` (for example a budget block).

    The caller keeps the block alive for as long as the array is used; ``owner`` is kept
    referenced by the array's memory object, so an object that frees the block when it dies
    can be passed here. A block of a budget in host memory is a ``BudgetError`` (CuPy views
    device memory only), as is an array larger than the block; an address CUDA does not know
    as device memory is a ``ValueError``; each names the address.
    """
    cp = _cupy()
    where = operator.index(address)  # TypeError for anything but an integer
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape_t) * cp.dtype(dtype).itemsize
    _check_viewable(cp, where, nbytes)
    memory = cp.cuda.UnownedMemory(address, nbytes, owner, cp.cuda.runtime.getDevice())
    return cp.ndarray(shape_t, dtype, cp.cuda.MemoryPointer(memory, 0))


def _check_viewable(cp: Any, address: int, nbytes: int) -> None:
    """Raise a clear error when ``nbytes`` at ``address`` are not device memory CuPy can
    view: a block of a budget in host memory, or larger than its block, or an address CUDA
    says is not device memory."""
    what = f"gpubudget.cupy.array_on(): address {address:#x}"
    budget = holder(address)
    if budget is not None:
        if budget.device is None:
            raise BudgetError(f"{what} is a block of budget {budget.name!r}, which is in host "
                              f"memory: CuPy views CUDA device memory only; enter the budget "
                              f"on a CUDA device (backend='pycuda')")
        size = budget.size_of(address)
        if nbytes > size:
            raise BudgetError(f"{what}: the array needs {nbytes} bytes, its block of budget "
                              f"{budget.name!r} has {size}")
        return
    attributes = getattr(cp.cuda.runtime, "pointerGetAttributes", None)
    if attributes is None:
        return
    try:
        kind = attributes(address).type
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: CUDA does not know it
        raise ValueError(f"{what} is not memory CUDA knows ({exc})") from None
    if kind not in (_CUDA_DEVICE, _CUDA_MANAGED):
        raise ValueError(f"{what} is not CUDA device memory (host memory: CuPy views device "
                         f"memory only)")


_CUDA_DEVICE: Final = 2
_CUDA_MANAGED: Final = 3
"""``cudaMemoryType`` values of device and managed memory (``cudaPointerAttributes.type``)."""


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
