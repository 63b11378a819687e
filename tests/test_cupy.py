"""gpubudget.cupy's routing, against a stand-in for CuPy (tests/gpu/ runs the real one)."""

from __future__ import annotations

import gc
import sys
import threading
import types
from typing import Any

import pytest

from gpubudget import AllocationDenied, BudgetError, gpu_budget, label
from gpubudget import cupy as gbc
from gpubudget.units import KiB
from tests.fakes import DeviceHostBackend, fake_cupy
from tests.helpers import consistent, finishes


@pytest.fixture
def cp(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def test_allocations_come_from_a_pool_of_budget_blocks(cp: Any) -> None:
    with gpu_budget("1MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("256KiB", name="pre") as pre:
            with gbc.allocations() as routed:
                assert routed is pre
                with label("pre/input"):
                    x = cp.allocate(10_000)
                y = cp.allocate(20_000)
                del y  # back into the pool's cache, still charged
                z = cp.allocate(15_000)  # reuses the cached chunk: no new block
            outside = cp.allocate(30_000)  # CuPy's own allocator again
            assert outside == ("default", 30_000)
            assert pre.used == 10_240 + 20_224
            tags = sorted(block.tag or "" for block in pre.report().live_blocks)
            assert tags == ["cupy", "pre/input"]
            (usage,) = pre.report().usage
            assert (usage.source, usage.charged, usage.in_use, usage.cached) == (
                "cupy", 10_240 + 20_224, 10_000 + 20_000, 224 + 240)
        assert pre.state == "exited"  # arrays hold its chunks
        del x, z
        gc.collect()
        gbc.release_cached()
        assert pre.report().state == "released" and pool.used == 0
        assert cp.state["synchronized"] >= 2  # each chunk returned after a device sync
        consistent(pool)


def test_a_denial_gives_the_cache_back_first_then_is_cupys_out_of_memory(cp: Any) -> None:
    with gpu_budget("64KiB", name="tiny", backend=DeviceHostBackend(0)) as tiny:
        with gbc.allocations():
            a = cp.allocate(40 * KiB)
            del a  # cached by the pool: 40 KiB still charged
            b = cp.allocate(60 * KiB)  # denied, the cache goes back, asked again: granted
            assert tiny.used == 60 * KiB
            with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
                cp.allocate(100 * KiB)
            del b
    error = info.value
    assert isinstance(error, AllocationDenied) and isinstance(error, MemoryError)
    assert "'tiny'" in str(error) and "64.00 KiB" in str(error) and "over its own limit" in str(error)
    assert error.reason == "over_limit"
    gbc.release_cached()


def test_other_devices_and_other_threads_keep_cupys_allocator(cp: Any) -> None:
    seen: list[Any] = []
    with gpu_budget("1MiB", name="gpu1", backend=DeviceHostBackend(1)) as budget:
        cp.state["device"] = 1
        with gbc.allocations():
            cp.state["device"] = 0  # the thread switched to device 0
            assert cp.allocate(4096) == ("default", 4096)
            cp.state["device"] = 1
            thread = threading.Thread(target=lambda: seen.append(cp.allocate(4096)))
            thread.start()
            thread.join()  # CuPy's allocator is per thread
            kept = cp.allocate(4096)
        assert seen == [("default", 4096)] and budget.used == 4096
        del kept
    cp.state["device"] = 0
    gbc.release_cached()


def test_empty_puts_one_array_on_a_block_freed_stream_ordered(cp: Any) -> None:
    from tests.helpers import StreamBackend

    class DeviceStreams(StreamBackend):
        ordinal = 0

    cp.dtype = lambda dtype: types.SimpleNamespace(itemsize=4)
    cp.ndarray = lambda shape, dtype, memptr: types.SimpleNamespace(data=memptr, shape=shape)
    backend = DeviceStreams()
    with gpu_budget("64KiB", name="pool", backend=backend) as pool:
        x = gbc.empty((1024,), "float32", tag="x")
        assert pool.used == 4 * KiB and pool.report().live_blocks[0].tag == "x"
        del x
        gc.collect()
        assert pool.used == 0 and pool.report().free_bytes == 60 * KiB  # pending on stream 0
        backend.finish()
        with pytest.raises(cp.cuda.memory.OutOfMemoryError, match="'pool'"):
            gbc.empty((64 * KiB,), "float32")
        consistent(pool)


def test_host_memory_and_no_budget_are_clear_errors(cp: Any) -> None:
    with pytest.raises(BudgetError, match="needs a budget"):
        with gbc.allocations():
            pass  # pragma: no cover
    with gpu_budget("1MiB", name="host", backend="host"):
        with pytest.raises(BudgetError, match="'host' is in host memory"):
            with gbc.allocations():
                pass  # pragma: no cover
    with pytest.raises(TypeError, match="budget must be"):
        gbc.allocations("pool")  # type: ignore[arg-type]


def test_without_cupy_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with gpu_budget("1MiB", backend=DeviceHostBackend(0)):
        with pytest.raises(ImportError, match="pip install cupy"):
            with gbc.allocations():
                pass  # pragma: no cover


def test_a_new_budget_routes_while_a_retired_pool_still_holds_arrays(cp: Any) -> None:
    """Entering allocations() for a new budget while an earlier budget's pool drains used to
    take the module's lock twice in one thread and hang for ever."""
    kept: list[Any] = []

    def work() -> None:
        with gpu_budget("1MiB", name="first", backend=DeviceHostBackend(0)) as first:
            with gbc.allocations():
                kept.append(cp.allocate(10_000))
        assert first.state == "exited"  # its retired pool drains: the array holds a chunk
        with gpu_budget("1MiB", name="second", backend=DeviceHostBackend(0)) as second:
            with gbc.allocations():
                kept.append(cp.allocate(20_000))
            assert second.used == 20_224
        kept.clear()
        gc.collect()
        gbc.release_cached()
        assert first.report().state == second.report().state == "released"

    finishes(work)


def test_many_threads_routing_into_different_budgets_never_hang(cp: Any) -> None:
    def one_thread(index: int) -> None:
        arrays = []
        with gpu_budget("256KiB", name=f"t{index}", backend=DeviceHostBackend(0)) as budget:
            for round_ in range(20):
                with gbc.allocations():
                    arrays.append(cp.allocate(1000 + round_ * 10))
                    if round_ % 3 == 0:
                        arrays.pop(0)
                if round_ % 5 == 0:
                    gbc.release_cached()
            consistent(budget)
        arrays.clear()  # some arrays outlived their budget's scope: pools drained meanwhile

    def work() -> None:
        threads = [threading.Thread(target=one_thread, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    finishes(work, 60.0)
    gc.collect()
    gbc.release_cached()


def test_cached_fft_plans_are_charged_shown_and_dropped_when_the_budget_ends(
        cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy.fft._cache", cp.fft_cache)
    with gpu_budget("1MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("256KiB", name="spectra") as spectra:
            with gbc.allocations():
                cp.fft(64 * KiB)  # a plan with a 64 KiB work area, cached by CuPy
                x = cp.allocate(1000)
            (usage,) = spectra.report().usage
            assert usage.library == 64 * KiB and usage.in_use == 64 * KiB + 1000
            assert "libraries keep 64.00 KiB of it across calls" in str(spectra.report())
            del x
        # the scope ended: the plan was dropped from the thread's cache, the chunk returned
        assert cp.fft_cache.get_plan_cache().plans == {}
        gc.collect()
        gbc.release_cached()
        assert spectra.report().state == "released" and pool.used == 0
        consistent(pool)


def test_array_on_a_host_block_or_past_its_block_is_a_clear_error(cp: Any) -> None:
    cp.dtype = lambda dtype: types.SimpleNamespace(itemsize=4)
    cp.ndarray = lambda shape, dtype, memptr: types.SimpleNamespace(data=memptr, shape=shape)
    with gpu_budget("1MiB", name="host-pool", backend="host") as pool:
        block = pool.allocate(4096)
        assert block is not None
        with pytest.raises(BudgetError, match=rf"address {block:#x} is a block of budget "
                                              r"'host-pool', which is in host memory"):
            gbc.array_on(block, 1024)
        pool.free(block)
    with gpu_budget("1MiB", name="gpu-pool", backend=DeviceHostBackend(0)) as pool:
        block = pool.allocate(4096)
        assert block is not None
        assert gbc.array_on(block, 1024).shape == (1024,)  # a device block: viewed
        with pytest.raises(BudgetError, match="needs 8192 bytes, its block of budget "
                                              "'gpu-pool' has 4096"):
            gbc.array_on(block, 2048)
        pool.free(block)
    with pytest.raises(TypeError):
        gbc.array_on("0x1000", 4)  # type: ignore[arg-type]


def test_array_on_an_address_cuda_says_is_host_memory_is_a_value_error(cp: Any) -> None:
    cp.dtype = lambda dtype: types.SimpleNamespace(itemsize=4)
    kinds = {0x1000: 0, 0x2000: 2}  # unregistered host memory; device memory

    def attributes(address: int) -> Any:
        if address not in kinds:
            raise RuntimeError("cudaErrorInvalidValue: invalid argument")
        return types.SimpleNamespace(type=kinds[address])

    cp.cuda.runtime.pointerGetAttributes = attributes
    cp.ndarray = lambda shape, dtype, memptr: types.SimpleNamespace(data=memptr, shape=shape)
    with pytest.raises(ValueError, match="address 0x1000 is not CUDA device memory"):
        gbc.array_on(0x1000, 4)
    with pytest.raises(ValueError, match="address 0x3000 is not memory CUDA knows"):
        gbc.array_on(0x3000, 4)
    assert gbc.array_on(0x2000, 4).shape == (4,)
