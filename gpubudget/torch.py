"""PyTorch inside budgets: ``with gpubudget.torch.allocations(budget):`` routes its memory.

>>> import torch                                               # doctest: +SKIP
>>> from gpubudget import gpu_budget, torch as gbt             # doctest: +SKIP
>>> with gpu_budget("2GiB", name="detector") as budget:        # doctest: +SKIP
...     with gbt.allocations():
...         x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
...     budget.used >= 256 * 2**20
True

Each budget gets ``torch.cuda.MemPool``\\ s whose allocator is the budget: PyTorch asks it for
segments (``torch._C._cuda_customAllocator`` takes two C callbacks; gpubudget's are
``ctypes`` functions, no compiled library needed). PyTorch caches segments: the budget is
charged for the segments, and ``report().usage`` shows how much of them live tensors hold
and how much is cached.

What is routed. Inside :class:`allocations`, every allocation the calling thread makes on
the budget's device, on any stream, goes to the budget (PyTorch's routing of a pool to the
current thread). The backward pass, which PyTorch otherwise runs on an autograd thread of
its own per device, runs on the calling thread inside the block
(``torch.autograd.set_multithreading_enabled(False)``), so gradients, optimizer state,
``GradScaler`` state, tensors made by hooks and compiled code are all charged. Threads you
start yourself (``DataParallel``'s replicas among them) are not routed: enter
:class:`allocations` in them (``gpubudget.use``/``bind`` carry the budget there). PyTorch
lets one thread at a time route into a pool, so each thread routing into a budget at the
same time gets a pool of its own (kept for reuse; all charge the budget).

Library workspaces. cuBLAS and cuBLASLt get from PyTorch a workspace per thread and stream
that lives until the process ends. ``allocations`` makes the calling thread's workspaces for
its current stream before routing starts, in a pool of gpubudget's outside every budget, so a
budget is never charged for them or kept from releasing by them; the report shows their total
(``usage[i].outside``). A stream the block switches to that has no workspace yet gets one
inside the budget: when such a budget's pools retire with segments still held, gpubudget
clears PyTorch's cuBLAS workspace cache (PyTorch makes new workspaces at next use).

Denial. When the budget refuses a segment, PyTorch frees cached segments of the pool and asks
again, then raises ``torch.OutOfMemoryError``; the denial, with the budget that refused and
why, is in the report, and an ``OutOfMemoryError`` leaving an ``allocations`` block gets a
note naming the refusal that raised it. Nothing raises through the C callbacks: an internal
error is recorded and answered with a null pointer.

Lifetime. Tensors may outlive the blocks. Once the budget's scope has ended and no
``allocations`` block uses its pools any more, gpubudget drops the pools and calls
``torch.cuda.empty_cache()``: cached segments return to the budget; segments still holding
tensors return when PyTorch frees them (after the tensors are gone, at the next
``torch.cuda.empty_cache()``, which :func:`release_cached` calls). The budget releases when
the last has returned. At interpreter exit the callbacks go inert. Capturing a CUDA graph
inside a block is not supported: the graph's memory would come from the budget's pool.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import threading
import weakref
from typing import Any, ClassVar, Final

from .adapter import callback, callback_failed, pass_on_interrupt
from .budget import Budget
from .errors import AllocationDenied
from .routing import RoutedPool, Routing
from .scope import current_label

__all__ = ["allocations", "release_cached", "workspace_bytes"]

SOURCE: Final = "torch"
TESTED_WITH: Final = "2.11"
_NEEDED: Final = ("_cuda_customAllocator", "_cuda_beginAllocateCurrentThreadToPool",
                  "_cuda_endAllocateToPool", "_cuda_releasePool", "_set_multithreading_enabled",
                  "_is_multithreading_enabled", "_cuda_getCurrentBlasHandle",
                  "_cuda_clearCublasWorkspaces")
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
    missing = [f"torch.cuda.{name}" for name in ("MemPool",) if not hasattr(torch.cuda, name)]
    missing += [f"torch._C.{name}" for name in _NEEDED if not hasattr(torch._C, name)]
    if missing:
        raise ImportError(
            f"gpubudget.torch needs {', '.join(missing)}, which PyTorch {torch.__version__} "
            f"does not have (a CPU-only build, or an older release); it is tested with "
            f"PyTorch {TESTED_WITH}, built with CUDA")
    return torch


class _Pool(RoutedPool):
    """One budget's ``MemPool``\\ s and the C callbacks that charge their segments."""

    source = SOURCE

    def __init__(self, torch: Any, budget: Budget) -> None:
        super().__init__(budget)
        assert budget.device is not None
        self.torch = torch
        self.device: Final = budget.device
        self.segments: dict[int, int] = {}  # address -> charged bytes
        self.refused: dict[int, AllocationDenied] = {}  # thread -> the last denial it got
        self.closed = False  # interpreter exit: answer without touching anything
        self.idle: list[Any] = []  # MemPools no thread routes into now
        self.mempools: list[Any] = []  # the budget's MemPools alive, idle or routed into
        self.ids: set[tuple[int, int]] = set()  # of every MemPool made, dropped ones too
        self.strange_stream = False  # a segment asked on a stream without our workspaces
        self._alloc = _ALLOC(self._allocate)
        self._free = _FREE(self._release)
        self.allocator: Any = torch._C._cuda_customAllocator(
            ctypes.cast(self._alloc, ctypes.c_void_p).value,
            ctypes.cast(self._free, ctypes.c_void_p).value)

    def install(self) -> None:
        with _lock:
            _kept.append(self)
        super().install()

    def take(self) -> Any:
        """A MemPool of the budget that no thread routes into (made if none is idle)."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
        mempool = self.torch.cuda.MemPool(self.allocator)
        with self.lock:
            self.mempools.append(mempool)
            self.ids.add(tuple(mempool.id))
        return mempool

    def give(self, mempool: Any) -> None:
        with self.lock:
            if not self.retired:
                self.idle.append(mempool)

    @callback
    def _allocate(self, size: int, device: int, stream: int) -> int | None:
        if self.closed:
            return None
        address = None
        try:
            address = self.budget.allocate(size, tag=current_label() or SOURCE,
                                           raise_on_denial=True)
            charged = self.budget.size_of(address)
            with self.lock:
                self.segments[address] = charged
            if not _has_workspaces(device, stream or 0):
                self.strange_stream = True  # cuBLAS may put a workspace in the budget
        except AllocationDenied as denied:  # PyTorch raises OutOfMemoryError; say why
            self.refused[threading.get_ident()] = denied
            address = None
        except BaseException as exc:  # noqa: BLE001 - nothing may cross the C callback
            self._failed("alloc", exc)
            if address is not None and address not in self.segments:
                self.budget.free(address)  # all or nothing: PyTorch gets no pointer
            address = None
        pass_on_interrupt()
        return address

    @callback
    def _release(self, address: int, size: int, device: int, stream: int) -> None:
        if self.closed:
            return
        try:
            with self.lock:
                self.segments.pop(address, None)
                done = self.retired and not self.segments
            self.budget.free(address)  # PyTorch synchronizes before it releases a segment
            if done:
                _forget(self)
        except BaseException as exc:  # noqa: BLE001
            self._failed("free", exc)
        pass_on_interrupt()

    def _failed(self, where: str, exc: BaseException) -> None:
        callback_failed(self.budget, f"torch {where}", exc)

    def usage(self) -> tuple[int, int, int, int]:
        """(bytes charged for segments, bytes of them in live tensors, 0, bytes of library
        workspaces outside budgets on the device), from PyTorch's own snapshot."""
        with self.lock:
            charged = sum(self.segments.values())
            ids = set(self.ids)
        in_use = sum(int(segment.get("allocated_size", 0))
                     for segment in self.torch.cuda.memory_snapshot()
                     if tuple(segment.get("segment_pool_id", ())) in ids)
        return charged, in_use, 0, workspace_bytes(self.device)

    def retire(self) -> None:
        """Drop the pools (PyTorch keeps each while tensors are in it) and empty the cache;
        if segments are still held, clear cuBLAS's workspaces too (see the module)."""
        with self.lock:
            mempools, self.mempools, self.idle = self.mempools, [], []
        del mempools
        cuda = self.torch.cuda
        cuda.empty_cache()
        with self.lock:
            pinned = bool(self.segments) and self.strange_stream
        if pinned:  # a workspace may be what holds them
            _clear_workspaces(self.torch)
            cuda.empty_cache()
        with self.lock:
            done = not self.segments
        if done:
            _forget(self)


def _forget(pool: _Pool) -> None:
    """A retired pool with no segment left: PyTorch will not call it again."""
    with _lock:
        if pool in _kept:
            _kept.remove(pool)


class _Route:
    """The calling thread's allocations on the device go to one MemPool of the budget, and
    its backward passes run on it; undone in reverse on the way out."""

    __slots__ = ("pool", "mempool", "threaded")

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.mempool: Any = None
        self.threaded = True

    def __enter__(self) -> None:
        pool = self.pool
        torch = pool.torch
        pool.refused.pop(threading.get_ident(), None)
        _make_workspaces(torch, pool.device)
        mempool = pool.take()
        self.threaded = bool(torch._C._is_multithreading_enabled())
        torch._C._set_multithreading_enabled(False)  # backward on this thread, routed
        try:
            torch._C._cuda_beginAllocateCurrentThreadToPool(pool.device, mempool.id)
        except BaseException:
            torch._C._set_multithreading_enabled(self.threaded)
            pool.give(mempool)
            raise
        self.mempool = mempool

    def __exit__(self, *exc: object) -> None:
        pool = self.pool
        torch = pool.torch
        try:
            torch._C._cuda_endAllocateToPool(pool.device, self.mempool.id)
            torch._C._cuda_releasePool(pool.device, self.mempool.id)
        finally:
            torch._C._set_multithreading_enabled(self.threaded)
            pool.give(self.mempool)


# -- library workspaces, outside budgets -------------------------------------------------------

_workspace_lock = threading.Lock()
_workspace_pools: dict[int, Any] = {}  # device -> the MemPool holding workspaces made here
_made = threading.local()  # .streams: {(device, stream)} whose workspaces this thread made
_generation = [0]  # bumped when cuBLAS's workspaces are cleared: all must be made again


def _streams_made() -> set[tuple[int, int]]:
    """(device, stream) pairs whose workspaces this thread has made (and still has)."""
    made: set[tuple[int, int]] | None = getattr(_made, "streams", None)
    if made is None or getattr(_made, "generation", -1) != _generation[0]:
        made = _made.streams = set()
        _made.generation = _generation[0]
    return made


def _has_workspaces(device: int, stream: int) -> bool:
    return (device, stream) in _streams_made()


def _make_workspaces(torch: Any, device: int) -> None:
    """Make this thread's cuBLAS and cuBLASLt workspaces for its current stream on
    ``device``, in gpubudget's workspace pool, unless made already."""
    stream = int(torch.cuda.current_stream(device).cuda_stream)
    made = _streams_made()
    if (device, stream) in made:
        return
    with _workspace_lock:  # one thread at a time routes into the workspace pool
        mempool = _workspace_pools.get(device)
        if mempool is None:
            mempool = _workspace_pools[device] = torch.cuda.MemPool()
        with torch.cuda.device(device):
            torch._C._cuda_beginAllocateCurrentThreadToPool(device, mempool.id)
            try:
                a = torch.ones((16, 16), device=device, dtype=torch.bfloat16)
                torch.addmm(a[0], a, a)  # an addmm with a bias: cuBLASLt's workspace
                torch._C._cuda_getCurrentBlasHandle()  # cuBLAS's workspace
                del a
            finally:
                torch._C._cuda_endAllocateToPool(device, mempool.id)
                torch._C._cuda_releasePool(device, mempool.id)
    made.add((device, stream))


def _clear_workspaces(torch: Any) -> None:
    with _workspace_lock:
        torch._C._cuda_clearCublasWorkspaces()
        _generation[0] += 1


def workspace_bytes(device: int) -> int:
    """Bytes of cuBLAS/cuBLASLt workspaces that :class:`allocations` made outside budgets on
    ``device`` (PyTorch keeps one per thread and stream)."""
    mempool = _workspace_pools.get(device)
    if mempool is None:
        return 0
    return sum(int(segment.get("allocated_size", 0)) for segment in mempool.snapshot())


class allocations(Routing[_Pool]):  # noqa: N801 - used like a function
    """Route this thread's PyTorch allocations on ``budget``'s device to ``budget`` (default:
    the current one) inside the ``with`` block, backward passes included; see the module
    docstring.

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
        return _Pool(module, budget)

    def route(self, module: Any, pool: _Pool) -> Any:
        return _Route(pool)

    def explain(self, exc: BaseException, pool: _Pool) -> None:
        """Add a note to PyTorch's out-of-memory error naming the refusal behind it."""
        denied = pool.refused.pop(threading.get_ident(), None)
        out_of_memory = getattr(pool.torch, "OutOfMemoryError", None)
        add_note = getattr(exc, "add_note", None)  # Python 3.11 and later
        if denied is None or out_of_memory is None or not isinstance(exc, out_of_memory):
            return
        if add_note is not None:
            add_note(f"gpubudget: {denied} ({denied.reason}); see budget.report()")


def release_cached() -> None:
    """Give cached PyTorch segments back to their budgets: the pools no thread routes into
    are dropped (new ones are made when needed), then ``torch.cuda.empty_cache()``."""
    torch = _torch()
    with _lock:
        pools = list(allocations._pools.values())
    for pool in pools:
        with pool.lock:
            dropped = {id(mempool) for mempool in pool.idle}
            pool.idle = []
            pool.mempools = [m for m in pool.mempools if id(m) not in dropped]
    torch.cuda.empty_cache()


@atexit.register
def _inert_at_exit() -> None:
    """PyTorch frees pools still alive after modules are torn down: answer, touch nothing."""
    with _lock:
        pools = list(_kept)
    for pool in pools:
        pool.closed = True
