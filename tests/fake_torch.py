"""A stand-in for PyTorch 2.11's CUDA caching allocator, as gpubudget uses it, on a machine
without CUDA: the rules PyTorch enforces by aborting the process (seen on an H200) become
loud test failures, so CPU tests catch a regression before a GPU does.

What it models:

- ``torch.cuda.MemPool(allocator)`` makes a private pool with a use count of 1;
  ``_cuda_beginAllocateCurrentThreadToPool`` adds one and routes the calling thread's
  allocations there (one thread at a time per pool; the pool begun last in a thread wins),
  ``_cuda_endAllocateToPool`` stops it, ``_cuda_releasePool`` takes one off; at 0 the pool is
  *freeable*: ``empty_cache()`` frees its unused segments through the allocator's free
  function, and forgets the pool once it has none. A live pool keeps its cache through
  ``empty_cache()``.
- A ``MemPool``'s destructor releases the pool and empties its cache, which PyTorch asserts
  no thread is routing during: destroyed while any thread routes, after its pool was
  retired (released) or forgotten, PyTorch aborts. Routing into a retired pool aborts too
  (later). Each is a *violation*: appended to ``torch.violations`` (tests fail on any), or,
  with ``abort=True`` (subprocesses), the process aborts as PyTorch's does.
- A segment is asked of the allocator with PyTorch's allocator lock held unless the setting
  ``release_lock_on_cudamalloc`` is on, and always freed with it held. Python code running
  there needs the GIL while the lock is held: a deadlock with a thread that holds the GIL and
  waits for the lock. Python found running there is a *hazard* (``torch.hazards``).
- A refused segment is ``OutOfMemoryError`` at once: while a thread routes into a pool
  PyTorch does not empty caches to ask again.
- The backward pass runs on an engine thread of its own unless multithreading is off in the
  calling thread; cuBLAS and cuBLASLt workspaces are made per thread and stream on first use,
  in whatever pool the thread routes to, and dropped by ``_cuda_clearCublasWorkspaces``.

Extra for tests: ``empty(n)`` -> a tensor-like handle (``del`` frees it into its pool's
cache); ``matmul()`` (uses cuBLAS: makes the workspace), ``backward(n)`` (``n`` bytes of
gradients where PyTorch's engine would allocate them), ``cuda.stream(s)`` (switch stream),
``pools`` (live private pools by id), ``default`` (the default pool), ``workspaces``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
SEGMENT = 2 * 2**20  # the smallest segment this fake asks for
WORKSPACE = 32 * 2**20  # a cuBLAS workspace, one per thread and stream (as on an H200)
LT_WORKSPACE = 2**20  # a cuBLASLt workspace, likewise
_RESET = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


class OutOfMemoryError(RuntimeError):
    pass


def _python_ran(function: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``function(*args)``'s result (a C function: a ``ctypes`` function pointer), and the
    name of a Python function that ran inside it (a ``ctypes`` callback), if any."""
    seen: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not seen:
            seen.append(frame.f_code.co_name)

    before = sys.getprofile()
    sys.setprofile(profile)
    try:
        result = function(*args)
    finally:
        sys.setprofile(before)
    return result, (seen[0] if seen else None)


def fake_torch(version: str = "2.11.0", *, abort: bool = False) -> Any:
    """A module with the names gpubudget.torch uses; see the module docstring."""
    torch: Any = types.ModuleType("torch")
    local = threading.local()  # .routes: [pool id], .streams: [stream], .threaded
    lock = threading.RLock()  # PyTorch's allocator lock
    pools: dict[tuple[int, int], Pool] = {}  # graph_pools: private pools PyTorch knows
    released: set[tuple[int, int]] = set()  # pools whose use count reached 0 once
    captures: list[tuple[tuple[int, int], int]] = []  # (pool id, thread) routing now
    workspaces: dict[tuple[int, int, str], Tensor] = {}  # (thread, stream, kind) -> workspace
    violations: list[str] = []
    hazards: list[str] = []
    settings: dict[str, Any] = {"last": "", "release_lock_on_cudamalloc": False}
    counts = {"made": 0, "destroyed": 0, "num_device_free": 0}
    ids = itertools.count(1)

    def violate(message: str) -> None:
        if abort:
            os.write(2, f"terminate called: c10::Error: {message}\n".encode())
            os.abort()
        violations.append(message)

    class Allocator:
        def __init__(self, alloc: int, free: int) -> None:
            self.alloc, self.free = _ALLOC(alloc), _FREE(free)

    class Segment:
        def __init__(self, address: int, size: int, stream: int) -> None:
            self.address, self.size, self.stream, self.used = address, size, stream, 0

    class Pool:
        """A pool of PyTorch's: private (with its use count) or the default one."""

        def __init__(self, allocator: Allocator | None, pool_id: tuple[int, int]) -> None:
            self.allocator, self.id, self.use_count = allocator, pool_id, 1
            self.segments: dict[int, Segment] = {}
            self.kept: list[ctypes.Array[ctypes.c_char]] = []

        def grow(self, nbytes: int, stream: int) -> Segment:
            size = max(nbytes, SEGMENT)
            if self.allocator is None:  # cudaMalloc
                buffer = ctypes.create_string_buffer(size)
                self.kept.append(buffer)
                address = ctypes.addressof(buffer)
            elif settings["release_lock_on_cudamalloc"]:
                count = _release_all(lock)
                try:
                    address = self.allocator.alloc(size, 0, stream or None)
                finally:
                    _acquire_again(lock, count)
            else:
                address, ran = _python_ran(self.allocator.alloc, size, 0, stream or None)
                if ran is not None:
                    hazards.append(f"Python ({ran}) ran in the allocate callback with the "
                                   f"allocator lock held")
            if not address:
                raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes}")
            segment = self.segments[int(address)] = Segment(int(address), size, stream)
            return segment

        def release(self) -> None:
            """Free the unused segments (the allocator lock held)."""
            for address, segment in list(self.segments.items()):
                if segment.used == 0:
                    del self.segments[address]
                    counts["num_device_free"] += 1
                    if self.allocator is not None:
                        _, ran = _python_ran(self.allocator.free, address, segment.size, 0,
                                             segment.stream or None)
                        if ran is not None:
                            hazards.append(f"Python ({ran}) ran in the free callback with "
                                           f"the allocator lock held")

        def snapshot(self) -> list[dict[str, Any]]:
            return [{"address": seg.address, "total_size": seg.size, "allocated_size": seg.used,
                     "segment_pool_id": self.id, "stream": seg.stream}
                    for seg in self.segments.values()]

    default = Pool(None, (0, 0))

    def private(pool_id: tuple[int, int], what: str, fatal: bool = False) -> Pool:
        """A failed assertion: a RuntimeError from Python, an abort from a destructor."""
        pool = pools.get(pool_id)
        if pool is None:
            if fatal:
                violate(f"it != graph_pools.end() INTERNAL ASSERT FAILED: {what} of a pool "
                        f"PyTorch has already freed")
            raise RuntimeError(f"{what}: no pool {pool_id}")
        return pool

    def release_pool(pool_id: tuple[int, int], what: str, fatal: bool = False) -> Pool:
        pool = private(pool_id, what, fatal)
        pool.use_count -= 1
        if pool.use_count < 0:
            if fatal:
                violate(f"uc >= 0 INTERNAL ASSERT FAILED: {what} of a retired pool")
            raise RuntimeError(f"{what}: pool {pool_id} released twice")
        if pool.use_count == 0:
            released.add(pool_id)
        return pool

    def free_freeable(only: tuple[int, int] | None) -> None:
        for pool_id, pool in list(pools.items()):
            if pool.use_count == 0 and only in (None, pool_id):
                pool.release()
                if not pool.segments:
                    del pools[pool_id]

    class MemPool:
        def __init__(self, allocator: Allocator | None = None, use_on_oom: bool = False) -> None:
            self.id = (0, next(ids))
            with lock:
                pools[self.id] = Pool(allocator, self.id)
                counts["made"] += 1

        def use_count(self) -> int:
            with lock:
                return private(self.id, "use_count").use_count

        def snapshot(self) -> list[dict[str, Any]]:
            with lock:
                pool = pools.get(self.id)
                return pool.snapshot() if pool is not None else []

        def __del__(self) -> None:  # ~MemPool: releasePool, then emptyCache(id)
            with lock:
                counts["destroyed"] += 1
                try:
                    pool = release_pool(self.id, "~MemPool", fatal=True)
                except RuntimeError:
                    return
                if pool.use_count == 0 and captures:
                    violate(f"captures_underway.empty() INTERNAL ASSERT FAILED: a MemPool "
                            f"destroyed while {len(captures)} thread(s) route into a pool")
                    return
                free_freeable(self.id)

    class Tensor:
        def __init__(self, pool: Pool, segment: Segment, nbytes: int) -> None:
            self.pool, self.segment, self.nbytes = pool, segment, nbytes

        def __del__(self) -> None:
            with lock:
                self.segment.used -= self.nbytes

    def _routes() -> list[tuple[int, int]]:
        routes: list[tuple[int, int]] | None = getattr(local, "routes", None)
        if routes is None:
            routes = local.routes = []
        return routes

    def current_stream(device: int | None = None) -> Any:
        streams = getattr(local, "streams", None) or [0]
        return types.SimpleNamespace(cuda_stream=streams[-1])

    def empty(nbytes: int, device: Any = None, dtype: Any = None) -> Tensor:
        stream = current_stream().cuda_stream
        with lock:
            routes = _routes()
            pool = pools[routes[-1]] if routes else default
            for segment in pool.segments.values():  # one tensor per free segment, same stream
                if segment.used == 0 and segment.size >= nbytes and segment.stream == stream:
                    break
            else:
                segment = pool.grow(nbytes, stream)
            segment.used += nbytes
            return Tensor(pool, segment, nbytes)

    def _workspace(kind: str, nbytes: int) -> None:
        key = (threading.get_ident(), current_stream().cuda_stream, kind)
        with lock:
            if key not in workspaces:
                workspaces[key] = empty(nbytes)

    def matmul() -> Tensor:
        _workspace("cublas", WORKSPACE)
        return empty(4096)

    def addmm(bias: Any, a: Any, b: Any) -> Tensor:
        _workspace("cublaslt", LT_WORKSPACE)
        return empty(512)

    def backward(nbytes: int) -> list[Tensor]:
        """Gradients, allocated where PyTorch's engine runs a CUDA backward."""
        grads: list[Tensor] = []
        if getattr(local, "threaded", True):
            worker = threading.Thread(target=lambda: grads.append(empty(nbytes)))
            worker.start()
            worker.join()
        else:
            grads.append(empty(nbytes))
        return grads

    def begin(device: int, pool_id: tuple[int, int]) -> None:
        with lock:
            pool = pools.get(pool_id)
            if pool is None:
                if pool_id in released:
                    violate("routing into a MemPool that was retired (PyTorch makes a new "
                            "pool without its allocator, and aborts when it is dropped)")
                pools[pool_id] = Pool(None, pool_id)
            elif pool.use_count <= 0:
                violate("it->second->use_count > 0 INTERNAL ASSERT FAILED: routing into a "
                        "retired MemPool")
                raise RuntimeError("beginAllocateToPool: pool retired")
            else:
                pool.use_count += 1
            if any(entry[0] == pool_id for entry in captures):
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            captures.append((pool_id, threading.get_ident()))
            _routes().append(pool_id)

    def end(device: int, pool_id: tuple[int, int]) -> None:
        with lock:
            found = [entry for entry in captures if entry[0] == pool_id]
            if not found:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            if found[0][1] != threading.get_ident():
                violate("a thread ended another thread's routing")
            captures.remove(found[0])
            _routes().remove(pool_id)

    def release(device: int, pool_id: tuple[int, int]) -> None:
        with lock:
            release_pool(pool_id, "releasePool")

    def empty_cache() -> None:
        with lock:
            if not captures:  # PyTorch frees its default pool's cache only then
                default.release()
            free_freeable(None)

    def clear_workspaces() -> None:
        with lock:
            workspaces.clear()

    def memory_snapshot() -> list[dict[str, Any]]:
        with lock:
            return default.snapshot() + [entry for pool in pools.values()
                                         for entry in pool.snapshot()]

    def memory_stats(device: int | None = None) -> dict[str, int]:
        with lock:
            return {"num_device_free": counts["num_device_free"]}

    def set_allocator_settings(text: str) -> None:
        parsed = dict(item.split(":", 1) for item in text.split(",") if item)
        with lock:
            for key in _RESET:
                settings.pop(key, None)
            for key, value in parsed.items():
                settings[key] = value == "True" if value in ("True", "False") else value
            settings["last"] = text

    def snapshot_all() -> dict[str, Any]:
        with lock:
            conf = {"PYTORCH_CUDA_ALLOC_CONF": settings["last"],
                    "release_lock_on_cudamalloc": settings["release_lock_on_cudamalloc"]}
        return {"segments": memory_snapshot(), "allocator_settings": conf}

    class StreamContext:
        def __init__(self, stream: int) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            streams = getattr(local, "streams", None)
            if streams is None:
                streams = local.streams = [0]
            streams.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            local.streams.pop()

    class DeviceContext:
        def __init__(self, device: int) -> None:
            pass

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            pass

    def set_threaded(mode: bool) -> None:
        local.threaded = bool(mode)

    torch.__version__ = version
    torch.bfloat16 = "bfloat16"
    memory = types.SimpleNamespace(_set_allocator_settings=set_allocator_settings,
                                   _snapshot=snapshot_all)
    torch.cuda = types.SimpleNamespace(
        MemPool=MemPool, empty_cache=empty_cache, memory_snapshot=memory_snapshot,
        memory_stats=memory_stats, synchronize=lambda device=None: None,
        current_stream=current_stream, stream=StreamContext, device=DeviceContext,
        memory=memory)
    torch._C = types.SimpleNamespace(
        _cuda_customAllocator=Allocator,
        _cuda_beginAllocateCurrentThreadToPool=begin,
        _cuda_endAllocateToPool=end,
        _cuda_releasePool=release,
        _is_multithreading_enabled=lambda: getattr(local, "threaded", True),
        _set_multithreading_enabled=set_threaded,
        _cuda_getCurrentBlasHandle=lambda: _workspace("cublas", WORKSPACE),
        _cuda_clearCublasWorkspaces=clear_workspaces,
    )
    torch.empty = empty
    torch.ones = lambda shape, device=None, dtype=None: _Ones(empty(512))
    torch.addmm = addmm
    torch.matmul = matmul
    torch.backward = backward
    torch.pools = pools
    torch.default = default
    torch.workspaces = workspaces
    torch.violations = violations
    torch.hazards = hazards
    torch.settings = settings
    torch.counts = counts
    torch.captures = captures
    torch.OutOfMemoryError = OutOfMemoryError
    return torch


def _release_all(lock: Any) -> int:
    """Release a re-entrant lock held by this thread, however deep; how deep it was."""
    count = 0
    while lock._is_owned():
        lock.release()
        count += 1
    return count


def _acquire_again(lock: Any, count: int) -> None:
    for _ in range(count):
        lock.acquire()


class _Ones:
    """What ``torch.ones`` gives in the fake: indexable, holding its memory."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __getitem__(self, index: int) -> _Ones:
        return self


def install(monkeypatch: Any, **options: Any) -> Any:
    """A new fake PyTorch as ``torch`` for one test, with gpubudget.torch's process-wide state
    as a new process would have it (no workspace made, no setting applied)."""
    from gpubudget import torch as gbt
    from gpubudget import torchstate

    module = fake_torch(**options)
    monkeypatch.setattr(gbt, "_freed_seen", {})
    monkeypatch.setitem(sys.modules, "torch", module)
    monkeypatch.setattr(torchstate, "_workspace_pools", {})
    monkeypatch.setattr(torchstate, "_made", threading.local())
    monkeypatch.setattr(torchstate, "_settings_done", [False])
    return module


def assert_nothing_would_have_aborted(module: Any) -> None:
    """What would have aborted PyTorch, or could deadlock it, fails the test."""
    assert module.violations == [], module.violations
    assert module.hazards == [], module.hazards
