"""The fake PyTorch of tests/fake_torch.py enforces what PyTorch 2.11 enforces by aborting
(seen on an H200, pure PyTorch): each rule shown failing, so that the adapter's tests that
pass against the fake mean something."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest

from tests.fake_torch import SEGMENT, fake_torch

MiB = 2**20
_ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class HostAllocator:
    """A custom allocator of Python callbacks over host buffers, as a user might write."""

    def __init__(self, torch: Any) -> None:
        self.buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self.alloc = _ALLOC(self._alloc)
        self.free = _FREE(self._free)
        self.allocator = torch._C._cuda_customAllocator(
            ctypes.cast(self.alloc, ctypes.c_void_p).value,
            ctypes.cast(self.free, ctypes.c_void_p).value)

    def _alloc(self, size: int, device: int, stream: int) -> int:
        buffer = ctypes.create_string_buffer(size)
        self.buffers[ctypes.addressof(buffer)] = buffer
        return ctypes.addressof(buffer)

    def _free(self, address: int, size: int, device: int, stream: int) -> None:
        del self.buffers[address]


def routed(torch: Any, mempool: Any, nbytes: int) -> Any:
    torch._C._cuda_beginAllocateCurrentThreadToPool(0, mempool.id)
    try:
        return torch.empty(nbytes)
    finally:
        torch._C._cuda_endAllocateToPool(0, mempool.id)
        torch._C._cuda_releasePool(0, mempool.id)


def test_a_mempool_destroyed_while_another_thread_routes_aborts() -> None:
    torch = fake_torch()
    inside, leave = threading.Event(), threading.Event()
    keep: list[Any] = []

    def router() -> None:
        mempool = torch.cuda.MemPool()
        keep.append(mempool)
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, mempool.id)
        inside.set()
        assert leave.wait(120)
        torch._C._cuda_endAllocateToPool(0, mempool.id)
        torch._C._cuda_releasePool(0, mempool.id)

    thread = threading.Thread(target=router)
    thread.start()
    assert inside.wait(120)
    unused = torch.cuda.MemPool()
    del unused  # never routed into: an abort all the same, since another thread routes
    leave.set()
    thread.join(120)
    assert not thread.is_alive()
    assert len(torch.violations) == 1
    assert torch.violations[0].startswith("captures_underway.empty()")
    dropped = torch.cuda.MemPool()
    del dropped  # nobody routes now: allowed
    assert len(torch.violations) == 1


def test_a_retired_mempool_must_never_be_destroyed_or_routed_into_again() -> None:
    torch = fake_torch()
    host = HostAllocator(torch)
    mempool = torch.cuda.MemPool(host.allocator)
    tensor = routed(torch, mempool, MiB)
    torch._C._cuda_releasePool(0, mempool.id)  # retired: its use count down to 0
    torch.cuda.empty_cache()
    assert len(host.buffers) == 1  # under a live tensor
    del tensor
    torch.cuda.empty_cache()  # now freed through the pool's allocator
    assert host.buffers == {} and mempool.id not in torch.pools
    with pytest.raises(RuntimeError):
        mempool.use_count()
    del mempool  # its destructor after retirement: an abort
    assert len(torch.violations) == 1 and torch.violations[0].startswith("it != graph_pools")

    again = torch.cuda.MemPool(host.allocator)
    kept = routed(torch, again, MiB)
    torch._C._cuda_releasePool(0, again.id)
    with pytest.raises(RuntimeError):
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, again.id)  # routing into it again
    assert "routing into a retired MemPool" in torch.violations[-1]
    del kept


def test_empty_cache_frees_only_released_pools_and_python_under_the_lock_is_seen() -> None:
    torch = fake_torch()
    host = HostAllocator(torch)
    live = torch.cuda.MemPool(host.allocator)
    scratch = routed(torch, live, MiB)
    del scratch
    torch.cuda.empty_cache()
    assert len(host.buffers) == 1  # a live pool keeps its cache
    assert [h for h in torch.hazards if "allocate callback" in h]  # Python, lock held
    torch.cuda.memory._set_allocator_settings("release_lock_on_cudamalloc:True")
    torch.hazards.clear()
    torch._C._cuda_releasePool(0, live.id)
    torch.cuda.empty_cache()
    assert host.buffers == {}
    assert [h for h in torch.hazards if "free callback" in h]  # a Python free, lock held
    assert torch.counts["num_device_free"] == 1 and SEGMENT == 2 * MiB
