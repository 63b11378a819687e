"""Stand-ins for CuPy and PyTorch on a machine without CUDA, faithful to what gpubudget relies
on: CuPy calls a per-thread allocator function and keeps an owner object alive as long as
the memory; PyTorch calls two C function pointers for segments, caches them, retries once
after emptying its cache and then raises ``OutOfMemoryError``. The real libraries are
exercised by ``tests/gpu/``."""

from __future__ import annotations

import ctypes
import itertools
import threading
import types
from typing import Any

from gpubudget.backends.host import HostBackend


class DeviceHostBackend(HostBackend):
    """Host memory that says it is device ``ordinal``'s, so adapters route to it."""

    def __init__(self, ordinal: int = 0) -> None:
        super().__init__()
        self.ordinal = ordinal


# -- CuPy ---------------------------------------------------------------------------------------


class _CupyOutOfMemoryError(MemoryError):
    def __init__(self, size: int, total: int, limit: int = 0) -> None:
        super().__init__(f"Out of memory allocating {size:,} bytes")


def fake_cupy() -> Any:
    """A module with the names gpubudget.cupy uses, plus ``allocate(n)``, which does what
    creating an array does: ask the thread's allocator for memory and hold on to it."""
    cp: Any = types.ModuleType("cupy")
    local = threading.local()
    state: dict[str, Any] = {"device": 0, "stream": 0}

    def default_allocator(size: int) -> Any:
        return ("default", size)

    def get_allocator() -> Any:
        return getattr(local, "allocator", None) or default_allocator

    class UsingAllocator:
        def __init__(self, allocator: Any) -> None:
            self.allocator, self.saved = allocator, None

        def __enter__(self) -> None:
            self.saved = getattr(local, "allocator", None)
            local.allocator = self.allocator

        def __exit__(self, *exc: object) -> None:
            local.allocator = self.saved

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: object, device_id: int) -> None:
            self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem, self.ptr = mem, mem.ptr + offset

    class MemoryPool:
        """Caches whole chunks: a freed array's chunk is reused by a request that fits."""

        def __init__(self, allocator: Any) -> None:
            self.allocator = allocator
            self.cached: list[MemoryPointer] = []
            self.in_use: dict[int, MemoryPointer] = {}

        def malloc(self, size: int) -> Any:
            index = next((i for i, c in enumerate(self.cached) if c.mem.size >= size), None)
            chunk = self.cached.pop(index) if index is not None else self.allocator(size)
            self.in_use[id(chunk)] = chunk
            return Pooled(self, chunk)

        def release(self, chunk: MemoryPointer) -> None:
            del self.in_use[id(chunk)]
            self.cached.append(chunk)

        def free_all_blocks(self) -> None:
            self.cached.clear()  # dropping a chunk drops its owner

        def used_bytes(self) -> int:
            return sum(chunk.mem.size for chunk in self.in_use.values())

    class Pooled:
        def __init__(self, pool: MemoryPool, chunk: MemoryPointer) -> None:
            self.pool, self.chunk, self.ptr, self.mem = pool, chunk, chunk.ptr, chunk.mem

        def __del__(self) -> None:
            self.pool.release(self.chunk)

    class Device:
        def __init__(self, device: int | None = None) -> None:
            self.id = state["device"] if device is None else device
            self.saved: list[int] = []

        def __enter__(self) -> Device:
            self.saved.append(state["device"])
            state["device"] = self.id
            return self

        def __exit__(self, *exc: object) -> None:
            state["device"] = self.saved.pop()

        def synchronize(self) -> None:
            state["synchronized"] = state.get("synchronized", 0) + 1

    cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: state["device"]),
        get_current_stream=lambda: types.SimpleNamespace(ptr=state["stream"]),
        get_allocator=get_allocator,
        using_allocator=UsingAllocator,
        UnownedMemory=UnownedMemory,
        MemoryPointer=MemoryPointer,
        MemoryPool=MemoryPool,
        Device=Device,
        memory=types.SimpleNamespace(OutOfMemoryError=_CupyOutOfMemoryError),
    )
    cp.cuda = cuda
    cp.state = state
    cp.allocate = lambda size: get_allocator()(size)

    # cupy.fft._cache: a plan cache per thread (and device), plans holding a work area
    plan_local = threading.local()

    class PlanCache:
        def __init__(self) -> None:
            self.plans: dict[tuple[Any, ...], Any] = {}

        def __iter__(self) -> Any:
            return iter([(key, types.SimpleNamespace(key=key, plan=plan))
                         for key, plan in self.plans.items()])

        def __delitem__(self, key: tuple[Any, ...]) -> None:
            del self.plans[key]

    def get_plan_cache() -> PlanCache:
        cache: PlanCache | None = getattr(plan_local, "cache", None)
        if cache is None:
            cache = plan_local.cache = PlanCache()
        return cache

    def fft(work_size: int) -> None:
        """What cupy.fft.fft does for a new shape: a plan with a work area, cached."""
        cache = get_plan_cache()
        key = ("Plan1d", work_size)
        if key not in cache.plans:
            cache.plans[key] = types.SimpleNamespace(work_area=cp.allocate(work_size))

    cp.fft_cache = types.ModuleType("cupy.fft._cache")
    cp.fft_cache.get_plan_cache = get_plan_cache
    cp.fft = fft
    return cp


# -- PyTorch ------------------------------------------------------------------------------------

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
SEGMENT = 2 * 2**20  # the smallest segment this fake asks for
WORKSPACE = 32 * 2**20  # a cuBLAS workspace, one per thread and stream (as on an H200)
LT_WORKSPACE = 2**20  # a cuBLASLt workspace, likewise


class OutOfMemoryError(RuntimeError):
    pass


def fake_torch(version: str = "2.11.0") -> Any:
    """A module with the names gpubudget.torch uses, modelled on what PyTorch 2.11 does (seen
    on the H200): pools routed to a thread with ``_cuda_beginAllocateCurrentThreadToPool``
    (one thread at a time per pool: a second gets ``RuntimeError``; the pool begun last in a
    thread wins); segments cached per pool and stream, a live ``MemPool``'s cache kept by
    ``empty_cache``; a backward pass on an engine thread of its own unless multithreading is
    off in the calling thread; cuBLAS and cuBLASLt workspaces made per thread and stream on
    first use, in whatever pool the thread routes to, freed by ``_cuda_clearCublasWorkspaces``.

    Extra for tests: ``empty(n)`` -> a tensor-like handle (``del`` frees it into its pool's
    cache); ``matmul()`` (uses cuBLAS: makes the workspace), ``backward(n)`` (allocates ``n``
    bytes of gradients where PyTorch's engine would), ``cuda.stream(s)`` (switch stream),
    ``pools`` and ``default`` (the default pool)."""
    torch: Any = types.ModuleType("torch")
    local = threading.local()  # .routes: [pool id], .streams: [stream], .threaded
    lock = threading.RLock()
    pools: dict[tuple[int, int], Any] = {}
    recording: dict[tuple[int, int], int] = {}  # pool id -> thread routing into it
    workspaces: dict[tuple[int, int, str], Tensor] = {}  # (thread, stream, kind) -> workspace
    ids = itertools.count(1)

    class Allocator:
        def __init__(self, alloc: int, free: int) -> None:
            self.alloc, self.free = _ALLOC(alloc), _FREE(free)

    class Segment:
        def __init__(self, address: int, size: int, stream: int) -> None:
            self.address, self.size, self.stream, self.used = address, size, stream, 0

    class Pool:
        """PyTorch's private pool (or the default one, allocator None: host memory)."""

        def __init__(self, allocator: Allocator | None, pool_id: tuple[int, int]) -> None:
            self.allocator, self.id, self.alive = allocator, pool_id, True
            self.segments: dict[int, Segment] = {}
            self.kept: list[ctypes.Array[ctypes.c_char]] = []

        def grow(self, nbytes: int, stream: int) -> Segment:
            size = max(nbytes, SEGMENT)
            if self.allocator is None:
                buffer = ctypes.create_string_buffer(size)
                self.kept.append(buffer)
                address = ctypes.addressof(buffer)
            else:
                address = self.allocator.alloc(size, 0, stream or None)
                if not address:  # PyTorch frees this pool's free cached segments, asks again
                    self.release(free_only=True)
                    address = self.allocator.alloc(size, 0, stream or None)
                if not address:
                    raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes}")
            segment = self.segments[int(address)] = Segment(int(address), size, stream)
            return segment

        def release(self, free_only: bool) -> None:
            for address, segment in list(self.segments.items()):
                if segment.used == 0:
                    del self.segments[address]
                    if self.allocator is not None:
                        self.allocator.free(address, segment.size, 0, segment.stream or None)

        def snapshot(self) -> list[dict[str, Any]]:
            return [{"total_size": seg.size, "allocated_size": seg.used,
                     "segment_pool_id": self.id, "stream": seg.stream}
                    for seg in self.segments.values()]

    default = Pool(None, (0, 0))
    pools[default.id] = default

    class MemPool:
        def __init__(self, allocator: Allocator | None = None) -> None:
            self.id = (0, next(ids))
            with lock:
                pools[self.id] = self.pool = Pool(allocator, self.id)

        def snapshot(self) -> list[dict[str, Any]]:
            return self.pool.snapshot()

        def __del__(self) -> None:
            self.pool.alive = False  # its cache may go now (empty_cache)

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

    def empty(nbytes: int) -> Tensor:
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
            if pool_id in recording:
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            recording[pool_id] = threading.get_ident()
            _routes().append(pool_id)

    def end(device: int, pool_id: tuple[int, int]) -> None:
        with lock:
            thread = recording.pop(pool_id)
            assert thread == threading.get_ident(), "ended in another thread"
            _routes().remove(pool_id)

    def empty_cache() -> None:
        with lock:
            for pool in list(pools.values()):
                if not pool.alive or pool is default:
                    pool.release(free_only=True)

    def clear_workspaces() -> None:
        with lock:
            workspaces.clear()

    def memory_snapshot() -> list[dict[str, Any]]:
        with lock:
            return [entry for pool in pools.values() for entry in pool.snapshot()]

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
    torch.cuda = types.SimpleNamespace(
        MemPool=MemPool, empty_cache=empty_cache, memory_snapshot=memory_snapshot,
        current_stream=current_stream, stream=StreamContext, device=DeviceContext)
    torch._C = types.SimpleNamespace(
        _cuda_customAllocator=Allocator,
        _cuda_beginAllocateCurrentThreadToPool=begin,
        _cuda_endAllocateToPool=end,
        _cuda_releasePool=lambda device, pool_id: None,
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
    torch.OutOfMemoryError = OutOfMemoryError
    return torch


class _Ones:
    """What ``torch.ones`` gives in the fake: indexable, holding its memory."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor

    def __getitem__(self, index: int) -> _Ones:
        return self
