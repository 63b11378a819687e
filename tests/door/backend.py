"""A device backend over the fake driver, for the door's root tests: its reservations are
cuMemAlloc_v2 calls and its growable ranges gpubudget's own CudaVirtualRange (cuMemCreate,
cuMemMap, ...), all reaching the driver through the door like PyCUDA's would."""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Final

from gpubudget.backends.virtual import CudaVirtualRange


class _Done:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Reservation:
    def __init__(self, driver: ctypes.CDLL, address: int, nbytes: int) -> None:
        self._driver = driver
        self.address: Final = address
        self.nbytes: Final = nbytes
        self._live = True

    def release(self) -> None:
        if self._live:
            self._live = False
            assert self._driver.cuMemFree_v2(ctypes.c_uint64(self.address)) == 0


class FakeCudaBackend:
    name = "fakecuda"
    ordinal = 0
    synchronous = True
    closed = False

    def __init__(self) -> None:
        self.driver = ctypes.CDLL("libcuda.so.1")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        yield

    def reserve(self, nbytes: int) -> Reservation:
        pointer = ctypes.c_uint64()
        status = self.driver.cuMemAlloc_v2(ctypes.byref(pointer), ctypes.c_size_t(nbytes))
        if status != 0:
            raise MemoryError(f"cuMemAlloc_v2 of {nbytes} bytes: CUDA error {status}")
        return Reservation(self.driver, pointer.value, nbytes)

    def allocation_granularity(self) -> int:
        return 2 << 20

    def reserve_virtual(self, nbytes: int, granule: int) -> CudaVirtualRange:
        return CudaVirtualRange(self, nbytes, granule)  # type: ignore[arg-type]

    def mem_info(self) -> tuple[int, int] | None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def record_event(self, stream: int) -> _Done:
        return _Done()
