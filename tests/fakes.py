"""Stand-ins for CuPy and PyTorch on a machine without CUDA, faithful to what gpubudget relies
on: CuPy calls a per-thread allocator function and keeps an owner object alive as long as
the memory; PyTorch calls two C function pointers for segments, caches them, retries once
after emptying its cache and then raises ``OutOfMemoryError``. The real libraries are
exercised by ``tests/gpu/``."""

from __future__ import annotations

import ctypes
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
            self.pool, self.chunk, self.ptr = pool, chunk, chunk.ptr

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
    return cp


# -- PyTorch ------------------------------------------------------------------------------------

_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
SEGMENT = 2 * 2**20  # the smallest segment this fake asks for


class OutOfMemoryError(RuntimeError):
    pass


def fake_torch(version: str = "2.11.0") -> Any:
    """A module with the names gpubudget.torch uses, plus ``empty(n)`` -> a tensor-like
    handle (``del`` frees it into its pool's cache) that allocates in the current pool."""
    torch: Any = types.ModuleType("torch")
    local = threading.local()
    pools: list[Any] = []
    torch.calls = []  # (kind, address or size) seen through the C function pointers

    class Allocator:
        def __init__(self, alloc: int, free: int) -> None:
            self.alloc, self.free = _ALLOC(alloc), _FREE(free)

    class MemPool:
        def __init__(self, allocator: Allocator) -> None:
            self.allocator = allocator
            self.segments: dict[int, list[int]] = {}  # address -> [size, bytes in tensors]
            pools.append(self)

        def snapshot(self) -> list[dict[str, int]]:
            return [{"total_size": size, "allocated_size": used}
                    for size, used in self.segments.values()]

        def grow(self, nbytes: int) -> int:
            size = max(nbytes, SEGMENT)
            torch.calls.append(("alloc", size))
            address = self.allocator.alloc(size, 0, None)
            if not address:  # PyTorch frees its cache and asks once more
                empty_cache()
                address = self.allocator.alloc(size, 0, None)
            if not address:
                raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes}")
            self.segments[address] = [size, 0]
            return int(address)

    class Tensor:
        def __init__(self, pool: MemPool, address: int, nbytes: int) -> None:
            self.pool, self.address, self.nbytes = pool, address, nbytes

        def __del__(self) -> None:
            self.pool.segments[self.address][1] -= self.nbytes

    def empty(nbytes: int) -> Tensor:
        pool = getattr(local, "pool", None)
        assert pool is not None, "this fake allocates only inside use_mem_pool"
        for address, entry in pool.segments.items():  # one tensor per free segment
            if entry[1] == 0 and entry[0] >= nbytes:
                break
        else:
            address = pool.grow(nbytes)
        pool.segments[address][1] += nbytes
        return Tensor(pool, address, nbytes)

    def empty_cache() -> None:
        for pool in pools:
            for address, (size, used) in list(pool.segments.items()):
                if used == 0:
                    del pool.segments[address]
                    torch.calls.append(("free", address))
                    pool.allocator.free(address, size, 0, None)

    class UseMemPool:
        def __init__(self, pool: MemPool, device: int | None = None) -> None:
            self.pool, self.saved = pool, None

        def __enter__(self) -> None:
            self.saved = getattr(local, "pool", None)
            local.pool = self.pool

        def __exit__(self, *exc: object) -> None:
            local.pool = self.saved

    torch.__version__ = version
    torch.cuda = types.SimpleNamespace(MemPool=MemPool, use_mem_pool=UseMemPool,
                                       empty_cache=empty_cache)
    torch._C = types.SimpleNamespace(_cuda_customAllocator=Allocator)
    torch.empty = empty
    torch.OutOfMemoryError = OutOfMemoryError
    return torch
