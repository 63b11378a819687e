"""gpubudget.numba against the installed numba-cuda: Numba's own EMM classes, its
``set_memory_manager`` and ``NUMBA_CUDA_MEMORY_MANAGER``; below Numba, a context that names a
device (Numba's needs a driver) and budgets in host memory that say they are device 0's."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

numba_cuda = pytest.importorskip("numba.cuda")

from numba.cuda import MemoryPointer  # noqa: E402
from numba.cuda.cudadrv import driver as numba_driver  # noqa: E402

from gpubudget import AllocationDenied, gpu_budget, label  # noqa: E402
from gpubudget import numba as gbn  # noqa: E402
from gpubudget.backends import HostBackend  # noqa: E402
from gpubudget.units import KiB  # noqa: E402
from tests.fakes import DeviceHostBackend  # noqa: E402
from tests.helpers import StreamBackend, consistent, fill, holds, subprocess_env  # noqa: E402


class Device:
    def __init__(self, ordinal: int) -> None:
        self.id = ordinal


class Context:
    """What a Numba context gives its memory manager: the device (with its ordinal)."""

    def __init__(self, ordinal: int = 0) -> None:
        self.device = Device(ordinal)


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[gbn.BudgetMemoryManager]:
    # what starting the driver does first (Numba's pending frees log through it)
    monkeypatch.setattr(numba_driver, "_logger", numba_driver.make_logger(), raising=False)
    yield gbn.BudgetMemoryManager(context=Context(0))
    gc.collect()  # memory a failed test kept is finalized while the driver is "started"


@pytest.fixture
def numba_alloc(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Numba's own cuMemAlloc/cuMemFree, answered below Numba: the sizes asked are listed."""
    asked: list[int] = []

    def alloc(size: int) -> int:
        asked.append(size)
        return 0x7000_0000 + len(asked) * 0x1000

    functions = numba_driver.driver.__dict__  # the driver's functions, as it keeps them
    monkeypatch.setitem(functions, "cuMemAlloc", alloc)
    monkeypatch.setitem(functions, "cuMemFree", lambda ptr: None)
    return asked


def test_it_is_a_numba_emm_plugin_numba_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(numba_driver, "_memory_manager", None)
    numba_cuda.set_memory_manager(gbn.BudgetMemoryManager)
    assert numba_driver._memory_manager is gbn.BudgetMemoryManager
    assert issubclass(gbn.BudgetMemoryManager, numba_cuda.HostOnlyCUDAMemoryManager)
    assert issubclass(gbn.BudgetMemoryManager, numba_cuda.BaseCUDAMemoryManager)


def test_the_environment_variable_installs_it() -> None:
    code = ("from numba.cuda.cudadrv import driver\n"
            "driver._ensure_memory_manager()\n"
            "import gpubudget.numba\n"
            "print(driver._memory_manager is gpubudget.numba.BudgetMemoryManager)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=subprocess_env(NUMBA_CUDA_MEMORY_MANAGER="gpubudget.numba"),
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_memalloc_draws_from_the_innermost_budget_and_frees_back(
        manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("64KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("16KiB", name="stencil") as stencil:
            with label("stencil/grid"):
                memory = manager.memalloc(3000)
            assert isinstance(memory, MemoryPointer)
            address = memory.device_pointer_value
            assert address is not None and stencil.owner_of(address) is stencil
            assert memory.size == 3000
            fill(address, 3000, 0x5A)
            assert holds(address, 3000, 0x5A)
            assert stencil.used == stencil.size_of(address) >= 3000
            assert pool.used == stencil.used
            assert [block.tag for block in stencil.report().live_blocks] == ["stencil/grid"]
            del memory
            gc.collect()
            assert stencil.used == 0 and pool.used == 0
            consistent(pool)


def test_untagged_blocks_say_numba(manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("16KiB", backend=DeviceHostBackend(0)) as pool:
        memory = manager.memalloc(100)
        assert [block.tag for block in pool.report().live_blocks] == ["numba"]
        del memory


def test_a_denial_is_numbas_out_of_memory_error_naming_the_budget(
        manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("8KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("4KiB", name="small") as small:
            kept = manager.memalloc(3 * KiB)
            with pytest.raises(numba_driver.CudaAPIError) as caught:
                manager.memalloc(2 * KiB)
            error = caught.value
            assert error.code == numba_driver.binding.CUresult.CUDA_ERROR_OUT_OF_MEMORY
            assert isinstance(error, AllocationDenied) and isinstance(error, MemoryError)
            assert error.budget == "small" and error.refused_by == "small"
            assert error.reason == "over_limit" and error.size == 2 * KiB
            assert "'small'" in str(error) and "CUDA_ERROR_OUT_OF_MEMORY" in str(error)
            assert small.used == small.size_of(kept.device_pointer_value or 0)
            assert small.report().denied == 2  # asked, Numba's held frees done, asked again
            consistent(pool)
            del kept


def test_a_denial_first_does_the_frees_numba_holds_back(
        manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("4KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        first = manager.memalloc(3 * KiB)
        with manager.defer_cleanup():  # Numba holds frees back meanwhile
            del first
            gc.collect()
            assert pool.used == 3 * KiB and len(manager.deallocations) == 1
            with pytest.raises(gbn.BudgetOutOfMemoryError):
                manager.memalloc(3 * KiB)  # the held free cannot be done yet
        assert pool.used == 3 * KiB
        second = manager.memalloc(3 * KiB)  # now it is, and the request is met
        assert pool.used == 3 * KiB and len(manager.deallocations) == 0
        assert pool.report().denied == 3  # asked twice the first time, once the second
        consistent(pool)
        del second


def test_frees_are_ordered_on_the_legacy_default_stream(
        manager: gbn.BudgetMemoryManager) -> None:
    backend = StreamBackend()
    backend.ordinal = 0  # type: ignore[attr-defined]  # device 0's, as DeviceHostBackend
    with gpu_budget("16KiB", backend=backend) as pool:
        memory = manager.memalloc(1000)
        address = memory.device_pointer_value
        del memory
        gc.collect()
        assert [event.stream for event in backend.events] == [0]  # recorded on stream 0
        assert pool.owner_of(address or 0) is None and pool.used == 0
        backend.finish()
        consistent(pool)


def test_outside_every_budget_numba_allocates_as_it_does(
        manager: gbn.BudgetMemoryManager, numba_alloc: list[int]) -> None:
    memory = manager.memalloc(5000)
    assert numba_alloc == [5000]
    assert memory.device_pointer_value == 0x7000_1000
    with gpu_budget("16KiB", name="host", backend=HostBackend()) as host:  # host memory
        manager.memalloc(100)
        assert host.used == 0
    with gpu_budget("16KiB", name="gpu1", backend=DeviceHostBackend(1)) as other:
        manager.memalloc(200)  # a budget of another device: Numba's own
        assert other.used == 0
    assert numba_alloc == [5000, 100, 200]


def test_another_thread_is_outside_the_budget(manager: gbn.BudgetMemoryManager,
                                              numba_alloc: list[int]) -> None:
    with gpu_budget("16KiB", backend=DeviceHostBackend(0)) as pool:
        done: list[Any] = []
        thread = threading.Thread(target=lambda: done.append(manager.memalloc(300)))
        thread.start()
        thread.join(60)
        assert done and numba_alloc == [300] and pool.used == 0


def test_memory_info_answers_the_budget(manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("64KiB", backend=DeviceHostBackend(0)):
        with gpu_budget("16KiB") as child:
            memory = manager.memalloc(4 * KiB)
            info = manager.get_memory_info()
            assert info.total == 16 * KiB and info.free == 12 * KiB
            assert (info.free, info.total) == (child.available, child.limit)
            del memory


def test_empty_memory_takes_no_block(manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("16KiB", backend=DeviceHostBackend(0)) as pool:
        memory = manager.memalloc(0)
        assert memory.size == 0 and memory.device_pointer_value is None
        assert pool.used == 0 and pool.report().denied == 0


def test_ipc_handles_of_budget_blocks_are_refused_naming_the_budget(
        manager: gbn.BudgetMemoryManager) -> None:
    with gpu_budget("16KiB", name="shared", backend=DeviceHostBackend(0)) as pool:
        memory = manager.memalloc(1000)
        with pytest.raises(NotImplementedError, match="budget 'shared'"):
            manager.get_ipc_handle(memory)
        assert pool.used == pool.size_of(memory.device_pointer_value or 0)
        consistent(pool)
        del memory


def test_through_numbas_own_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """Numba's ``Context`` (made here over a device stand-in: there is no driver to make
    one) takes the installed plugin and asks it for everything."""
    monkeypatch.setattr(numba_driver, "_logger", numba_driver.make_logger(), raising=False)
    monkeypatch.setattr(numba_driver, "_memory_manager", None)
    numba_cuda.set_memory_manager(gbn.BudgetMemoryManager)
    context = numba_driver.Context(Device(0), None)
    assert isinstance(context.memory_manager, gbn.BudgetMemoryManager)
    with gpu_budget("64KiB", name="numba", backend=DeviceHostBackend(0)) as pool:
        context.prepare_for_use()  # Numba sizes its queue of frees from get_memory_info()
        memory = context.memalloc(5000)
        assert pool.owner_of(memory.device_pointer_value or 0) is pool
        assert context.get_memory_info() == (pool.available, 64 * KiB)
        with pytest.raises(NotImplementedError, match="budget 'numba'"):
            context.get_ipc_handle(memory)
        with context.defer_cleanup():
            del memory
            gc.collect()
            assert pool.used > 0
        context.reset()  # Numba's reset does the frees it held back
        assert pool.used == 0
        consistent(pool)
    gc.collect()
