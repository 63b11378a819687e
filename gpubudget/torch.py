"""PyTorch inside budgets: ``with gpubudget.torch.allocations(budget):`` routes its memory.

>>> import torch                                               # doctest: +SKIP
>>> from gpubudget import gpu_budget, torch as gbt             # doctest: +SKIP
>>> with gpu_budget("2GiB", name="detector") as budget:        # doctest: +SKIP
...     with gbt.allocations():
...         x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
...     budget.used >= 256 * 2**20
True

Each budget gets ``torch.cuda.MemPool``\\ s whose allocator is the budget: PyTorch asks it for
segments (``torch._C._cuda_customAllocator`` takes two C functions; gpubudget's allocating
one is a ``ctypes`` callback, no compiled library needed). PyTorch caches segments: the budget
is charged for the segments, and ``report().usage`` shows how much of them live tensors hold,
how much is cached, and how much waits to come back.

What is routed. Inside :class:`allocations`, every allocation the calling thread makes on
the budget's device, on any stream, goes to the budget (PyTorch's routing of a pool to the
current thread). The backward pass, which PyTorch otherwise runs on an autograd thread of
its own per device, runs on the calling thread inside the block
(``torch.autograd.set_multithreading_enabled(False)``). Threads you start yourself are not
routed: enter :class:`allocations` in them. PyTorch lets one thread at a time route into a
pool, so each thread routing into a budget at the same time gets a ``MemPool`` of its own.

Library workspaces. cuBLAS and cuBLASLt get from PyTorch a workspace per thread and stream
that lives until the process ends. ``allocations`` makes the calling thread's workspaces for
its current stream before routing starts, in a pool of gpubudget's outside every budget; the
report shows their total (``usage[i].outside``). A stream the block switches to that has no
workspace yet gets one inside the budget: when such a budget's pools retire with segments
still held, gpubudget clears PyTorch's cuBLAS workspace cache.

Denial. When the budget refuses a segment, PyTorch raises ``torch.OutOfMemoryError`` (it does
not empty a pool's cache while a thread routes); the refusal is in the report, and the error
leaving an ``allocations`` block gets a note naming it. Nothing raises through the callbacks.

Lifetime (see ``docs/frameworks.md``). PyTorch 2.11 aborts the process when a ``MemPool`` is
destroyed while any thread routes into a pool, so gpubudget never lets one be destroyed: every
``MemPool`` it makes is kept for the rest of the process. Once the budget's scope has ended
and no block uses its pools, each is *retired*: PyTorch is told the pool is no longer used
(``torch._C._cuda_releasePool``) and ``torch.cuda.empty_cache()`` frees its cached segments;
segments under live tensors follow once the tensors are gone, at the next
:func:`release_cached`. PyTorch frees a segment with its allocator lock held, where a Python
callback would wait for the GIL (a deadlock with any thread that holds the GIL and waits for
that lock), so the function PyTorch calls to free one is a C function that does nothing;
gpubudget gives a retired pool's segment back to its budget once PyTorch's own snapshot no
longer lists it, and asks PyTorch to release the same lock while it calls the allocating
callback (``release_lock_on_cudamalloc``). Capturing a CUDA graph inside a block is not
supported.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import threading
import weakref
from typing import Any, ClassVar, Final, NamedTuple

from .adapter import callback_failed
from .budget import Budget
from .errors import AllocationDenied
from .routing import RoutedPool, Routing
from .scope import current_label
from .torchstate import (clear_workspaces, has_workspaces, inert_free_address, kept_for_ever,
                         make_workspaces, mempools_kept, release_lock_on_malloc, routed_mempool,
                         routes, workspace_bytes)

__all__ = ["allocations", "mempools_kept", "release_cached", "workspace_bytes"]

SOURCE: Final = "torch"
TESTED_WITH: Final = "2.11"
_NEEDED: Final = ("_cuda_customAllocator", "_cuda_beginAllocateCurrentThreadToPool",
                  "_cuda_endAllocateToPool", "_cuda_releasePool", "_set_multithreading_enabled",
                  "_is_multithreading_enabled", "_cuda_getCurrentBlasHandle",
                  "_cuda_clearCublasWorkspaces")
_ALLOC: Final = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_lock = threading.Lock()
_kept: set[_Pool] = set()  # pools holding segments: kept until every one is back


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


class _Segment(NamedTuple):
    charged: int  # bytes of the budget's block
    mempool: tuple[int, int] | None  # the MemPool it was asked for
    stream: int  # the stream PyTorch asked it on, which its free is ordered after


class _Pool(RoutedPool):
    """One budget's ``MemPool``\\ s and the callback that charges their segments."""

    source = SOURCE

    def __init__(self, torch: Any, budget: Budget) -> None:
        super().__init__(budget)
        assert budget.device is not None
        self.torch = torch
        self.device: Final = budget.device
        self.segments: dict[int, _Segment] = {}  # address -> what PyTorch was given there
        self.refused: dict[int, AllocationDenied] = {}  # thread -> the last denial it got
        self.closed = False  # interpreter exit: answer without touching anything
        self.idle: list[Any] = []  # MemPools no thread routes into now
        self.ids: set[tuple[int, int]] = set()  # of every MemPool made for the budget
        self.retired: set[tuple[int, int]] = set()  # retired, maybe still holding segments
        self.strange_stream = False  # a segment asked on a stream without our workspaces
        self._alloc = _ALLOC(self._allocate)
        self.allocator: Any = torch._C._cuda_customAllocator(
            ctypes.cast(self._alloc, ctypes.c_void_p).value, inert_free_address())

    def take(self) -> Any:
        """A MemPool of the budget that no thread routes into (made if none is idle)."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
        mempool = kept_for_ever(self.torch.cuda.MemPool(self.allocator))
        with self.lock:
            self.ids.add(tuple(mempool.id))
        return mempool

    def give(self, mempool: Any) -> None:
        with self.lock:
            self.idle.append(mempool)

    def _allocate(self, size: int, device: int, stream: int) -> int | None:
        if self.closed:
            return None
        address = None
        try:
            address = self.budget.allocate(size, tag=current_label() or SOURCE,
                                           stream=stream or 0, raise_on_denial=True)
            segment = _Segment(self.budget.size_of(address), routed_mempool(self),
                               stream or 0)
            with self.lock:
                self.segments[address] = segment
            if segment.mempool is None:  # it returns only when the process ends
                self.budget.record_error("torch alloc: a segment asked by a thread that "
                                         "routes into none of the budget's pools")
            with _lock:
                _kept.add(self)
            if not has_workspaces(device, stream or 0):
                self.strange_stream = True  # cuBLAS may put a workspace in the budget
        except AllocationDenied as denied:  # PyTorch raises OutOfMemoryError; say why
            self.refused[threading.get_ident()] = denied
            address = None
        except BaseException as exc:  # noqa: BLE001 - nothing may cross the C callback
            return self._failed(exc, address)
        return address

    def _failed(self, exc: BaseException, address: int | None) -> int:
        """All or nothing: PyTorch gets no pointer (a block it never got is given back);
        the null address to answer (see :func:`gpubudget.adapter.callback_failed`)."""
        try:
            if address is not None and address not in self.segments:
                self.budget.free(address)
        except BaseException as late:  # noqa: BLE001 - another signal meanwhile
            callback_failed(self.budget, "torch alloc", late)
        return callback_failed(self.budget, "torch alloc", exc)

    def usage(self) -> tuple[int, ...]:
        """(bytes charged for segments, bytes of them in live tensors, 0, bytes of library
        workspaces outside budgets on the device, bytes of retired pools under live tensors,
        bytes of retired pools that return at the next :func:`release_cached`), from
        PyTorch's own snapshot."""
        with self.lock:
            segments = dict(self.segments)
            retired = set(self.retired)
        listed = {int(entry["address"]): int(entry.get("allocated_size", 0))
                  for entry in self.torch.cuda.memory_snapshot()}
        in_use = waiting_in_use = waiting = 0
        for address, segment in segments.items():
            held = listed.get(address, 0)
            in_use += held
            if segment.mempool in retired:
                waiting += segment.charged
                waiting_in_use += held
        charged = sum(segment.charged for segment in segments.values())
        return (charged, in_use, 0, workspace_bytes(self.device), waiting_in_use,
                waiting - waiting_in_use)

    def retire_idle(self, cached: dict[tuple[int, int], int] | None = None) -> None:
        """Retire the MemPools no thread routes into (with ``cached``, PyTorch's cached
        bytes per pool, only those caching some): PyTorch is told each is done with, so
        that ``empty_cache()`` frees its segments; the objects are kept for ever."""
        with self.lock:
            chosen = [m for m in self.idle if cached is None or cached.get(tuple(m.id), 0)]
            self.idle = [m for m in self.idle if all(m is not c for c in chosen)]
        for mempool in chosen:
            self.torch._C._cuda_releasePool(self.device, mempool.id)  # its own reference
            with self.lock:
                self.retired.add(tuple(mempool.id))

    def retire(self) -> None:
        """Retire every idle MemPool and empty the cache; if segments are still held, clear
        cuBLAS's workspaces too (see the module)."""
        self.retire_idle()
        _empty_and_reconcile(self.torch, [self])
        with self.lock:
            pinned = bool(self.segments) and self.strange_stream
        if pinned:  # a workspace may be what holds them
            clear_workspaces(self.torch)
            _empty_and_reconcile(self.torch, [self])

    def retired_now(self) -> set[tuple[int, int]]:
        with self.lock:
            return set(self.retired)

    def reconcile(self, retired: set[tuple[int, int]], listed: set[int]) -> None:
        """Give back the segments of MemPools retired before PyTorch's snapshot was taken
        (``retired``) that the snapshot no longer lists (``listed``): PyTorch has freed
        them. A retired pool gets no new segment, so nothing is missed or freed twice."""
        with self.lock:
            gone = [(address, segment) for address, segment in self.segments.items()
                    if segment.mempool in retired and address not in listed]
            for address, _ in gone:
                del self.segments[address]
            left = {segment.mempool for segment in self.segments.values()}
            self.retired -= {mempool for mempool in retired if mempool not in left}
        for address, segment in gone:
            if self.budget.free(address, stream=segment.stream):
                continue
            self.torch.cuda.synchronize(self.device)  # no event on its stream: wait for all
            if not self.budget.free(address):
                self.budget.record_error(f"torch free: segment {address:#x} was not the "
                                         f"budget's")
        self.forget_if_done()

    def forget_if_done(self) -> None:
        """Once the scope has ended, no block uses the pool and no segment is left: forget
        it (its MemPools stay, retired)."""
        with self.lock:
            done = not self.segments
        if done and self.unused() and allocations.forget(self):
            with _lock:
                _kept.discard(self)


def _empty_and_reconcile(torch: Any, pools: list[_Pool], empty: bool = True) -> None:
    """``torch.cuda.empty_cache()`` (unless not ``empty``), then give back what PyTorch freed
    of ``pools``."""
    retired = {pool: pool.retired_now() for pool in pools}  # before the snapshot
    if empty:
        torch.cuda.empty_cache()
    if not any(retired.values()):
        for pool in pools:
            pool.forget_if_done()
        return
    listed = {int(entry["address"]) for entry in torch.cuda.memory_snapshot()}
    for pool in pools:
        pool.reconcile(retired[pool], listed)


_freed_seen: dict[int, int] = {}  # device -> PyTorch's count of segments freed, last seen


def _give_back_freed(torch: Any) -> None:
    """Before a block routes: if a retired pool still holds segments and PyTorch has freed
    segments since the last look (``torch.cuda.empty_cache()`` called by anyone), give back
    those it freed. One ``memory_stats`` per device while pools drain; nothing otherwise."""
    with _lock:
        draining = [pool for pool in _kept if pool.retired]
    if not draining:
        return
    changed = False
    for device in {pool.device for pool in draining}:
        freed = torch.cuda.memory_stats(device).get("num_device_free")
        with _lock:
            if freed is not None and _freed_seen.get(device) != freed:
                _freed_seen[device] = freed
                changed = True
    if changed:
        _empty_and_reconcile(torch, draining, empty=False)


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
        make_workspaces(torch, pool.device)
        mempool = pool.take()
        self.threaded = bool(torch._C._is_multithreading_enabled())
        torch._C._set_multithreading_enabled(False)  # backward on this thread, routed
        entry = (pool, tuple(mempool.id))
        routes().append(entry)
        try:
            torch._C._cuda_beginAllocateCurrentThreadToPool(pool.device, mempool.id)
        except BaseException:
            routes().remove(entry)
            torch._C._set_multithreading_enabled(self.threaded)
            pool.give(mempool)
            raise
        self.mempool = mempool

    def __exit__(self, *exc: object) -> None:
        pool = self.pool
        torch = pool.torch
        try:
            torch._C._cuda_endAllocateToPool(pool.device, self.mempool.id)
            torch._C._cuda_releasePool(pool.device, self.mempool.id)  # the route's reference
        finally:
            stack = routes()
            for index in range(len(stack) - 1, -1, -1):
                if stack[index][0] is pool and stack[index][1] == tuple(self.mempool.id):
                    del stack[index]
                    break
            torch._C._set_multithreading_enabled(self.threaded)
            pool.give(self.mempool)


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

    def prepare(self, module: Any) -> None:
        release_lock_on_malloc(module)
        _give_back_freed(module)

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
    """Give cached PyTorch segments back to their budgets: the MemPools no thread routes into
    that cache something are retired (new ones are made when needed), then
    ``torch.cuda.empty_cache()``; segments that PyTorch freed since their pool retired (their
    tensors are gone) go back too. Safe while other threads route."""
    torch = _torch()
    with _lock:
        pools = set(_kept)
    pools.update(allocations.pools())
    cached: dict[tuple[int, int], int] = {}
    for entry in torch.cuda.memory_snapshot():
        key = tuple(entry.get("segment_pool_id", (0, 0)))
        free = int(entry.get("total_size", 0)) - int(entry.get("allocated_size", 0))
        cached[key] = cached.get(key, 0) + free
    for pool in pools:
        pool.retire_idle(cached)
    _empty_and_reconcile(torch, list(pools))


@atexit.register
def _inert_at_exit() -> None:
    """Threads still routing at exit get no segment: the callbacks touch nothing."""
    with _lock:
        pools = set(_kept)
    pools.update(allocations.pools())
    for pool in pools:
        pool.closed = True
