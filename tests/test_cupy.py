"""gpubudget.cupy's routing, against a stand-in for CuPy (tests/gpu/ runs the real one)."""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref
from typing import Any

import pytest

import gpubudget
from gpubudget import AllocationDenied, BudgetError, gpu_budget, label
from gpubudget import cupy as gbc
from gpubudget.budget import THREAD_ROOT
from gpubudget.units import KiB
from tests.fakes import DeviceHostBackend, fake_cupy
from tests.helpers import consistent, fill, finishes, holds


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


# separate roots in threads are what this test means (the mark's fields are split at ':')
@pytest.mark.filterwarnings(f"ignore:.*{THREAD_ROOT.split(': ')[-1]}:RuntimeWarning")
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


def test_pools_retire_while_other_threads_route_arrays(
        cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread keeps an array (its bytes written) and routes more, FFT plans included, while
    the main thread's budgets end, their pools retire and ``release_cached()`` frees every
    pool's cache: the thread's memory is untouched and everything comes back."""
    monkeypatch.setitem(sys.modules, "cupy.fft._cache", cp.fft_cache)
    ready, stop = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    outliving: list[Any] = []
    with gpu_budget("8MiB", name="root", backend=DeviceHostBackend(0)) as root:
        def serve() -> None:
            try:
                with gpubudget.use(root), gpu_budget("1MiB", name="serving"):
                    with gbc.allocations():
                        kept = cp.allocate(100_000)
                        fill(kept.ptr, 100_000, 0x5A)
                        ready.set()
                        rounds = 0
                        while not stop.is_set() or rounds < 20:
                            scratch = cp.allocate(10_000 + rounds % 7 * 1000)
                            del scratch
                            if rounds % 5 == 0:
                                cp.fft(4 * KiB + rounds % 3 * KiB)  # a plan cached per thread
                            rounds += 1
                        assert holds(kept.ptr, 100_000, 0x5A)
            except BaseException as exc:  # noqa: BLE001 - raised in the test's thread
                errors.append(exc)
                ready.set()

        thread = threading.Thread(target=serve)
        thread.start()
        assert ready.wait(120)
        for index in range(30):
            with gpu_budget("512KiB", name=f"model{index}"):
                with gbc.allocations():
                    arrays = [cp.allocate(20_000), cp.allocate(30_000)]
                if index % 4 == 0:
                    outliving.append(arrays)
            del arrays
            if index % 5 == 0:
                gbc.release_cached()  # every pool's cache, the serving thread's too
        stop.set()
        thread.join(120)
        assert not thread.is_alive() and errors == []
        outliving.clear()
        gc.collect()
        gbc.release_cached()
        assert all(child.state == "released" for child in root.report().children)
        assert root.used == 0
        consistent(root)


def test_a_block_entering_while_a_pool_drains_leaves_busy_pools_alone(cp: Any) -> None:
    """Before, a block entered while any retired pool drained gave back the cache of every
    pool, busy ones too (each returned chunk costing a device synchronization)."""
    with gpu_budget("1MiB", name="root", backend=DeviceHostBackend(0)):
        with gpu_budget("256KiB", name="ended"):
            with gbc.allocations():
                kept = cp.allocate(10_000)  # its pool drains once the budget ends
        with gpu_budget("256KiB", name="busy") as busy:
            with gbc.allocations():
                scratch = cp.allocate(50_000)
                del scratch
                assert busy.used == 50_176  # cached by the busy pool
                with gpu_budget("64KiB", name="late"), gbc.allocations():
                    pass
                assert busy.used == 50_176
        del kept
        gc.collect()
        gbc.release_cached()


def test_an_exited_budget_entered_again_keeps_one_pool(cp: Any) -> None:
    """Before, the retired pool refused the late block and a new pool replaced it in the
    report, which then showed less than the budget was charged."""
    with gpu_budget("1MiB", name="root", backend=DeviceHostBackend(0)) as root:
        with gpu_budget("256KiB", name="model") as model:
            with gbc.allocations():
                first = cp.allocate(10_000)
        with gbc.allocations(model):  # a late block in the exited budget
            second = cp.allocate(20_000)
        (usage,) = model.report().usage
        assert usage.charged == model.used == 10_240 + 20_224
        assert (usage.waiting_in_use, usage.waiting_cached) == (30_000, 240 + 224)
        assert "waiting to return: 29.30 KiB under live objects" in str(model.report())
        del first, second
        gc.collect()
        gbc.release_cached()
        assert model.report().state == "released" and root.used == 0


def test_released_budgets_are_not_kept_alive_by_their_pools(cp: Any) -> None:
    """Before, the map of pools kept every budget that ever routed (its pool held it), long
    after its parent stopped listing it (a parent lists the last 32 released children)."""
    gone = []
    with gpu_budget("1MiB", name="root", backend=DeviceHostBackend(0)):
        for index in range(40):
            with gpu_budget("64KiB", name=f"model{index}") as model:
                with gbc.allocations():
                    cp.allocate(1000)
            assert model.report().state == "released"
            gone.append(weakref.ref(model))
        del model
        gc.collect()
        assert [ref() is None for ref in gone[:8]] == [True] * 8
        assert gbc.allocations.pools() == []
