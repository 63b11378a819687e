"""Budgets on the device the user picked (two-GPU tests skip, with the reason, on one GPU)."""

from __future__ import annotations

import contextvars
import ctypes
import types
from typing import Any

import pytest

from gpubudget import gpu_budget
from gpubudget.backends import current_device, get_backend
from tests.gpu.conftest import two_devices

MiB = 2**20
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


def device_of_pointer(address: int) -> int:
    driver: Any = get_backend("pycuda", device=0)
    ordinal = ctypes.c_int(-1)
    status = driver.driver.cuPointerGetAttribute(
        ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, address)
    assert status == 0, status
    return ordinal.value


def test_a_root_reserves_on_the_current_device_by_default() -> None:
    assert current_device() == 0
    with gpu_budget("64MiB", name="here") as budget:
        block = budget.allocate(MiB)
        assert budget.device == 0 and block is not None and device_of_pointer(block) == 0
        assert budget.report().device == 0 and "cuda:0" in str(budget.report())
        assert budget.free(block)


@two_devices
def test_budgets_on_two_devices_side_by_side_in_one_thread() -> None:
    cp = pytest.importorskip("cupy")
    zero = gpu_budget("256MiB", name="zero", device=0)
    one = gpu_budget("256MiB", name="one", device=1)
    blocks = []
    with cp.cuda.Device(0):  # device 0 current in this thread throughout
        with zero:
            with pytest.raises(ValueError, match="device=1.*'zero'.*device 0"):
                gpu_budget("1MiB", name="child", device=1).__enter__()  # a child cannot
            blocks.append((zero, zero.allocate(8 * MiB)))
        with one:  # a root of its own, while 'zero' still serves the blocks it gave out
            for budget in (one, zero, one):
                blocks.append((budget, budget.allocate(8 * MiB)))
            assert current_device() == 0  # the caller's context was restored every time
    assert [budget.device for budget, _ in blocks] == [0, 1, 0, 1]
    assert [device_of_pointer(block) for _, block in blocks] == [0, 1, 0, 1]  # type: ignore[arg-type]
    data = cp.arange(1024, dtype=cp.uint8)
    with cp.cuda.Device(1):  # the device-1 block really is device 1's memory
        view = cp.ndarray((1024,), cp.uint8, cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(blocks[1][1], 1024, None, 1), 0))
        view.set(data.get())
        assert int(view.sum()) == int(data.sum())
    for budget, block in blocks:
        assert block is not None and budget.free(block)
    assert zero.report().state == "released" and one.report().state == "released"


@two_devices
def test_the_default_device_follows_the_thread_each_time() -> None:
    cp = pytest.importorskip("cupy")
    devices = []
    for ordinal in (1, 0, 1):  # the first version got device-0 memory the second time
        with cp.cuda.Device(ordinal):
            with gpu_budget("64MiB", name=f"on-{ordinal}") as budget:
                block = budget.allocate(MiB)
                assert block is not None
                devices.append((budget.device, device_of_pointer(block)))
                budget.free(block)
    assert devices == [(1, 1), (0, 0), (1, 1)]


@two_devices
def test_memory_taken_outside_is_counted_per_device() -> None:
    cp = pytest.importorskip("cupy")
    with cp.cuda.Device(0), gpu_budget("64MiB", name="zero", device=0) as zero:
        one = gpu_budget("64MiB", name="one", device=1)
        elsewhere = contextvars.Context()  # a context where 'zero' is not active: a root
        with cp.cuda.Device(1):
            elsewhere.run(one.__enter__)
            taken = cp.cuda.runtime.malloc(512 * MiB)  # someone else's memory on device 1
            outside_one = one.report().outside_bytes
            cp.cuda.runtime.free(taken)
            elsewhere.run(one.__exit__, None, None, None)
        outside_zero = zero.report().outside_bytes
    assert one.device == 1 and zero.device == 0
    assert outside_one is not None and 512 * MiB <= outside_one < 600 * MiB
    assert outside_zero is not None and outside_zero < 64 * MiB


@two_devices
def test_a_tensorrt_call_on_another_device_is_denied_never_served() -> None:
    cp = pytest.importorskip("cupy")
    from gpubudget import tensorrt as gbt

    class IGpuAllocator:  # TensorRT's base class, as far as the allocator uses it
        def __init__(self) -> None:
            pass

    trt = types.ModuleType("fake_trt_for_devices")
    trt.IGpuAllocator = IGpuAllocator  # type: ignore[attr-defined]
    with cp.cuda.Device(1):
        budget = gpu_budget("64MiB", name="engine-on-1", device=1).__enter__()
        allocator = gbt.allocator(budget, trt_module=trt)
        granted = allocator.allocate(MiB, 0, 0)
    with cp.cuda.Device(0):  # an engine of device 0 calling the device-1 budget
        refused = allocator.allocate(MiB, 0, 0)
    assert granted is not None and device_of_pointer(granted) == 1
    assert refused is None
    (denial,) = budget.report().denials
    assert (denial.reason, denial.count) == ("wrong_device", 1)
    assert allocator.deallocate(granted)
    with cp.cuda.Device(1):
        budget.__exit__(None, None, None)
