"""gpubudget.cupy's routing, against a stand-in for CuPy (tests/gpu/ runs the real one)."""

from __future__ import annotations

import gc
import sys
import threading
from typing import Any

import pytest

from gpubudget import AllocationDenied, BudgetError, gpu_budget, label
from gpubudget import cupy as gbc
from gpubudget.units import KiB
from tests.fakes import DeviceHostBackend, fake_cupy
from tests.helpers import consistent


@pytest.fixture
def cp(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def test_allocations_inside_the_block_are_blocks_of_the_budget(cp: Any) -> None:
    with gpu_budget("1MiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("256KiB", name="pre") as pre:
            with gbc.allocations() as routed:
                assert routed is pre
                with label("pre/input"):
                    x = cp.allocate(10_000)
                y = cp.allocate(20_000)
            outside = cp.allocate(30_000)  # CuPy's own allocator again
            assert outside == ("default", 30_000)
            assert pre.size_of(x.ptr) == 10_240 and pre.used == 10_240 + 20_224
            tags = {block.address: block.tag for block in pre.report().live_blocks}
            assert tags == {x.ptr: "pre/input", y.ptr: "cupy"}
            (usage,) = pre.report().usage
            assert (usage.source, usage.charged, usage.in_use, usage.cached) == (
                "cupy", pre.used, pre.used, 0)
        del x
        gc.collect()
        assert pre.used == 20_224  # arrays free their blocks when CuPy drops them
        del y
        gc.collect()
        assert pre.state == "released" and pool.used == 0
        consistent(pool)


def test_a_denial_is_cupys_out_of_memory_error_naming_the_budget(cp: Any) -> None:
    with gpu_budget("64KiB", name="tiny", backend=DeviceHostBackend(0)):
        with gbc.allocations():
            with pytest.raises(cp.cuda.memory.OutOfMemoryError) as info:
                cp.allocate(100 * KiB)
    error = info.value
    assert isinstance(error, AllocationDenied) and isinstance(error, MemoryError)
    assert "'tiny'" in str(error) and "64.00 KiB" in str(error) and "over its own limit" in str(error)
    assert error.reason == "over_limit"


def test_other_devices_and_other_threads_keep_cupys_allocator(cp: Any) -> None:
    seen: list[Any] = []
    with gpu_budget("1MiB", name="gpu1", backend=DeviceHostBackend(1)) as budget:
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


def test_frees_are_stream_ordered_on_the_allocating_stream(cp: Any) -> None:
    from tests.helpers import StreamBackend

    class DeviceStreams(StreamBackend):
        ordinal = 0

    backend = DeviceStreams()
    with gpu_budget("64KiB", name="pool", backend=backend) as pool:
        with gbc.allocations():
            cp.state["stream"] = 0x51
            x = cp.allocate(16 * KiB)
            address = x.ptr
            del x
            gc.collect()
            assert pool.used == 0 and pool.report().free_bytes == 48 * KiB  # pending on 0x51
            again = cp.allocate(16 * KiB)  # same stream, same size: reused at once
            assert again.ptr == address
            del again
            gc.collect()
        backend.finish()
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
