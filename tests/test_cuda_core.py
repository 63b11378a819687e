"""gpubudget.cuda_core against the installed cuda-core: a real ``MemoryResource`` subclass, its
errors cuda.core's ``CUDAError``. Without a CUDA driver cuda.core makes no ``Stream`` and no
device ``Buffer``: below it, a stream is what the CUDA stream protocol gives
(``__cuda_stream__``), and budgets are host memory that says it is device 0's; making a
buffer fails here for want of the driver, which tests the all-or-nothing path."""

from __future__ import annotations

import gc
from typing import Any

import pytest

cuda_core = pytest.importorskip("cuda.core")

from cuda.core import MemoryResource  # noqa: E402
from cuda.core._utils.cuda_utils import CUDAError  # noqa: E402
from cuda.core.graph import GraphBuilder  # noqa: E402

from gpubudget import AllocationDenied, BudgetError, gpu_budget, label  # noqa: E402
from gpubudget import cuda_core as gbcc  # noqa: E402
from gpubudget.backends import HostBackend  # noqa: E402
from gpubudget.units import KiB  # noqa: E402
from tests.fakes import DeviceHostBackend  # noqa: E402
from tests.helpers import StreamBackend, consistent  # noqa: E402


class CudaStream:
    """A CUDA stream as the stream protocol shows it (version 0, the handle)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def stream_backend(ordinal: int = 0) -> StreamBackend:
    backend = StreamBackend()
    backend.ordinal = ordinal  # type: ignore[attr-defined]  # device 0's memory, as it says
    return backend


def test_it_is_a_cuda_core_memory_resource_of_the_budgets_device() -> None:
    with gpu_budget("64KiB", name="decoder", backend=DeviceHostBackend(1)) as budget:
        mr = gbcc.resource()
        assert isinstance(mr, MemoryResource)
        assert mr.budget is budget
        assert mr.device_id == 1
        assert mr.is_device_accessible and not mr.is_host_accessible
        assert "decoder" in repr(mr)
        assert gbcc.resource(budget).budget is budget


def test_a_denial_is_cuda_cores_error_naming_the_budget() -> None:
    with gpu_budget("8KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("4KiB", name="small") as small:
            mr = gbcc.resource()
            with pytest.raises(CUDAError) as caught:
                mr.allocate(6 * KiB, stream=CudaStream(0x10))  # type: ignore[arg-type]
            error = caught.value
            assert isinstance(error, AllocationDenied) and isinstance(error, MemoryError)
            assert isinstance(error, gbcc.BudgetOutOfMemoryError)
            assert str(error).startswith("CUDA_ERROR_OUT_OF_MEMORY: ")
            assert "'small'" in str(error)
            assert (error.budget, error.refused_by, error.reason) == ("small", "small",
                                                                       "over_limit")
            assert small.used == 0 and small.report().denied == 1
            consistent(pool)


def test_a_buffer_that_cannot_be_made_gives_the_block_back() -> None:
    """cuda.core refuses to make the buffer (here: no CUDA driver; elsewhere, a bad stream):
    the error is cuda.core's, and the block taken for it is back in the budget."""
    with gpu_budget("64KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        mr = gbcc.resource()
        with label("decoder/frames"), pytest.raises(Exception) as caught:
            mr.allocate(3000, stream=CudaStream(0x10))  # type: ignore[arg-type]
        assert not isinstance(caught.value, AllocationDenied)
        report = pool.report()
        assert pool.used == 0 and report.allocations == 1 and report.frees == 1
        assert report.live_blocks == () and report.denied == 0
        consistent(pool)


def test_deallocate_frees_in_the_streams_order() -> None:
    backend = stream_backend(0)
    with gpu_budget("16KiB", name="pool", backend=backend) as pool:
        mr = gbcc.resource()
        address = pool.allocate(4 * KiB, stream=0x10)  # as allocate() takes it for a buffer
        assert address is not None
        mr.deallocate(address, 4 * KiB, stream=CudaStream(0x10))  # type: ignore[arg-type]
        assert [event.stream for event in backend.events] == [0x10]
        assert pool.used == 0 and pool.owner_of(address) is None
        # the same stream reuses the block at once; another waits for the stream's work
        assert pool.allocate(4 * KiB, stream=0x10) == address
        backend.finish()
        consistent(pool)


def test_deallocate_of_what_is_not_a_live_block_names_it() -> None:
    with gpu_budget("16KiB", name="pool", backend=DeviceHostBackend(0)) as pool:
        mr = gbcc.resource()
        address = pool.allocate(1000)
        assert address is not None
        mr.deallocate(address, 1000, stream=CudaStream(0))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"{address:#x} is not a live block of budget "
                                             f"'pool'"):
            mr.deallocate(address, 1000, stream=CudaStream(0))  # type: ignore[arg-type]
        consistent(pool)


def test_sizes_below_one_byte_take_no_block() -> None:
    with gpu_budget("16KiB", backend=DeviceHostBackend(0)) as pool:
        mr = gbcc.resource()
        with pytest.raises(ValueError, match="size is at least 0, got -1"):
            mr.allocate(-1, stream=CudaStream(0))  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            mr.allocate(1.5, stream=CudaStream(0))  # type: ignore[arg-type]
        mr.deallocate(0, 0, stream=CudaStream(0))  # type: ignore[arg-type]  # an empty one's
        assert pool.report().allocations == 0 and pool.report().denied == 0
        assert pool.report().invalid_frees == 0


def test_a_stream_must_be_a_cuda_stream() -> None:
    with gpu_budget("16KiB", backend=DeviceHostBackend(0)) as pool:
        mr = gbcc.resource()
        with pytest.raises(TypeError, match="stream must be a cuda.core Stream"):
            mr.allocate(100, stream=0x10)  # type: ignore[arg-type]
        capture = GraphBuilder.__new__(GraphBuilder)  # cuda.core's own (no driver to build)
        with pytest.raises(TypeError, match="not allocated or freed into a graph"):
            mr.allocate(100, stream=capture)
        address = pool.allocate(100)
        assert address is not None
        with pytest.raises(TypeError, match="GraphMemoryResource"):
            mr.deallocate(address, 100, stream=capture)
        assert pool.report().allocations == 1 and pool.owner_of(address) is pool
        pool.free(address)


def test_it_serves_its_budget_after_the_block_ends() -> None:
    with gpu_budget("64KiB", backend=DeviceHostBackend(0)) as pool:
        with gpu_budget("16KiB", name="late") as late:
            mr = gbcc.resource()
        address = late.allocate(100)  # the resource keeps the budget: it still allocates
        assert address is not None and late.state == "exited"
        mr.deallocate(address, 100, stream=CudaStream(0))  # type: ignore[arg-type]
        assert late.used == 0 and late.state == "exited"
        del mr
        gc.collect()
        assert late.report().state == "released"
        consistent(pool)


@pytest.mark.parametrize("budget, error, message", [
    (None, BudgetError, "needs a budget"),
    ("4GiB", TypeError, "must be a gpubudget.Budget"),
])
def test_resource_checks_its_budget(budget: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        gbcc.resource(budget)


def test_a_budget_in_host_memory_is_refused_naming_it() -> None:
    with gpu_budget("16KiB", name="cpu", backend=HostBackend()):
        with pytest.raises(BudgetError, match="budget 'cpu' is in host memory"):
            gbcc.resource()


def test_a_released_budget_is_refused() -> None:
    budget = gpu_budget("16KiB", name="gone", backend=DeviceHostBackend(0))
    with budget:
        pass
    gc.collect()
    with pytest.raises(BudgetError, match="budget 'gone' is released"):
        gbcc.resource(budget)
