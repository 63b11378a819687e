"""Stand-ins for CuPy and PyTorch on a machine without CUDA, faithful to what gpubudget relies
on: CuPy calls a per-thread allocator function and keeps an owner object alive as long as
the memory; PyTorch (``tests/fake_torch.py``) calls two C function pointers for segments,
caches them per pool, and enforces the rules under which PyTorch 2.11 aborts the process.
The real libraries are exercised by ``tests/gpu/``."""

from __future__ import annotations

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
        """Caches whole chunks: a freed array's chunk is reused by a request that fits. As
        CuPy's, safe to use from several threads at once (a lock; the allocator is called
        outside it)."""

        def __init__(self, allocator: Any) -> None:
            self.allocator = allocator
            self.lock = threading.RLock()
            self.cached: list[MemoryPointer] = []
            self.in_use: dict[int, MemoryPointer] = {}

        def malloc(self, size: int) -> Any:
            with self.lock:
                index = next((i for i, c in enumerate(self.cached) if c.mem.size >= size), None)
                chunk = self.cached.pop(index) if index is not None else None
            if chunk is None:
                chunk = self.allocator(size)
            with self.lock:
                self.in_use[id(chunk)] = chunk
            return Pooled(self, chunk)

        def release(self, chunk: MemoryPointer) -> None:
            with self.lock:
                del self.in_use[id(chunk)]
                self.cached.append(chunk)

        def free_all_blocks(self) -> None:
            with self.lock:
                dropped, self.cached = self.cached, []
            dropped.clear()  # dropping a chunk drops its owner

        def used_bytes(self) -> int:
            with self.lock:
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


# -- PyTorch: tests/fake_torch.py ---------------------------------------------------------------

from tests.fake_torch import (  # noqa: E402 - re-exported for the tests that import them here
    LT_WORKSPACE, SEGMENT, WORKSPACE, OutOfMemoryError, fake_torch)

__all__ = ["LT_WORKSPACE", "SEGMENT", "WORKSPACE", "DeviceHostBackend", "OutOfMemoryError",
           "fake_cupy", "fake_torch"]
