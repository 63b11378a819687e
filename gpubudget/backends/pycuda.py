"""PyCUDA backend: one ``cuMemAlloc`` per root budget, in a device's primary context.

One backend instance per device. The primary context is the one the CUDA runtime, TensorRT,
CuPy and PyTorch use; a context made with ``make_context()`` would be a different one, and
its pointers would belong to it. Every driver call that needs a current context (allocating,
freeing, copying, asking for free memory, creating events) runs with this device's primary
context pushed on PyCUDA's stack and popped after, so the caller's current context (another
device's, say) is what it was. Events on raw stream handles (TensorRT, CuPy and PyTorch pass
``cudaStream_t`` values as integers) go through the driver API with ``ctypes``, since
PyCUDA's ``Event.record`` wants a PyCUDA ``Stream``; they are created once and reused, and
skipped when the stream has no work left. At
interpreter exit, reservations still held are freed while the context is alive, and later
releases become no-ops, so exit with live blocks is silent.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import pycuda.driver as cuda

__all__ = ["PyCudaBackend", "PyCudaEvent", "PyCudaReservation", "current_device"]

_CUDA_SUCCESS: Final = 0
_CUDA_ERROR_NOT_READY: Final = 600
_CU_EVENT_DISABLE_TIMING: Final = 2


def _load_driver() -> ctypes.CDLL:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    lib = ctypes.CDLL(name)
    lib.cuEventCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
    lib.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuEventQuery.argtypes = [ctypes.c_void_p]
    lib.cuEventSynchronize.argtypes = [ctypes.c_void_p]
    lib.cuEventDestroy_v2.argtypes = [ctypes.c_void_p]
    lib.cuCtxGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.cuStreamQuery.argtypes = [ctypes.c_void_p]
    return lib


_loaded: list[ctypes.CDLL] = []


def _driver() -> ctypes.CDLL:
    if not _loaded:
        _loaded.append(_load_driver())
    return _loaded[0]


def current_device() -> int:
    """The device of the CUDA context current in the calling thread (the one CuPy's
    ``Device(n).use()``, ``torch.cuda.set_device(n)`` and ``cudaSetDevice`` make current),
    else 0."""
    cuda.init()
    device = ctypes.c_int(0)
    if _driver().cuCtxGetDevice(ctypes.byref(device)) != _CUDA_SUCCESS:
        return 0  # no context current in this thread
    return device.value


class PyCudaReservation:
    """A device allocation owned by a root budget."""

    __slots__ = ("_allocation", "_backend", "address", "nbytes", "__weakref__")

    def __init__(self, backend: PyCudaBackend, allocation: cuda.DeviceAllocation, nbytes: int):
        self._backend = backend
        self._allocation: cuda.DeviceAllocation | None = allocation
        self.address: Final = int(allocation)
        self.nbytes: Final = nbytes

    def release(self) -> None:
        allocation, self._allocation = self._allocation, None
        if allocation is not None and not self._backend.closed:
            with self._backend.active():
                allocation.free()


class PyCudaEvent:
    """A CUDA event recorded on a raw stream handle; its handle goes back to the backend's
    free list when the event is dropped."""

    __slots__ = ("_backend", "_handle")

    def __init__(self, backend: PyCudaBackend, handle: int, stream: int) -> None:
        self._backend = backend
        self._handle: int | None = handle
        backend.check(backend.driver.cuEventRecord(handle, stream or None))

    def query(self) -> bool:
        if self._handle is None or self._backend.closed:
            return True
        status = int(self._backend.driver.cuEventQuery(self._handle))
        if status == _CUDA_ERROR_NOT_READY:
            return False
        self._backend.check(status)
        return True

    def synchronize(self) -> None:
        if self._handle is not None and not self._backend.closed:
            self._backend.check(self._backend.driver.cuEventSynchronize(self._handle))

    def __del__(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._backend.recycle_event(handle)


class _Finished:
    """The event of a stream that had no work left when it was asked: done already."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_FINISHED: Final = _Finished()


class PyCudaBackend:
    """Device memory through PyCUDA, in the primary context of device ``device``."""

    name = "pycuda"

    def __init__(self, device: int = 0) -> None:
        cuda.init()
        if not 0 <= device < cuda.Device.count():
            raise ValueError(f"no CUDA device {device}: this machine has {cuda.Device.count()}")
        self.ordinal: Final = device
        self.device: Final = cuda.Device(device)
        self._context = self.device.retain_primary_context()
        self.driver: Final = _driver()
        self.closed = False
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[PyCudaReservation] = weakref.WeakSet()
        self._events: list[int] = []  # recorded events dropped, ready to be recorded again
        atexit.register(self._close)

    def __repr__(self) -> str:
        return f"<PyCudaBackend cuda:{self.ordinal} {self.device.name()}>"

    @contextmanager
    def active(self) -> Iterator[None]:
        """This device's primary context current for the calls inside, the caller's after."""
        self._context.push()
        try:
            yield
        finally:
            cuda.Context.pop()

    def check(self, status: int) -> None:
        if status != _CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed with error {status}")

    def reserve(self, nbytes: int) -> PyCudaReservation:
        try:
            with self.active():
                allocation = cuda.mem_alloc(nbytes)
        except cuda.Error as exc:
            raise MemoryError(str(exc)) from exc
        reservation = PyCudaReservation(self, allocation, nbytes)
        with self._lock:
            self._live.add(reservation)
        return reservation

    def mem_info(self) -> tuple[int, int] | None:
        try:
            with self.active():
                free, total = cuda.mem_get_info()
        except cuda.Error:
            return None
        return int(free), int(total)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        with self.active():
            cuda.memcpy_dtod(dst, src, nbytes)

    def record_event(self, stream: int) -> PyCudaEvent | _Finished:
        """An event after the work queued on ``stream`` so far; when the stream has none
        left (one driver call says so), no event is needed."""
        if self.driver.cuStreamQuery(stream or None) == _CUDA_SUCCESS:
            return _FINISHED
        with self._lock:
            handle = self._events.pop() if self._events else None
        if handle is None:
            created = ctypes.c_void_p()
            with self.active():
                self.check(self.driver.cuEventCreate(ctypes.byref(created),
                                                     _CU_EVENT_DISABLE_TIMING))
            assert created.value is not None
            handle = created.value
        try:
            return PyCudaEvent(self, handle, stream)
        except Exception:
            self.recycle_event(handle)
            raise

    def recycle_event(self, handle: int) -> None:
        if not self.closed:
            with self._lock:
                self._events.append(handle)

    def _close(self) -> None:
        """At exit: free what is still reserved while the context lives, then go quiet."""
        with self._lock:
            live = list(self._live)
            events, self._events = self._events, []
        for reservation in live:
            try:
                reservation.release()
            except Exception:  # noqa: BLE001 - exit must be silent
                pass
        for handle in events:
            self.driver.cuEventDestroy_v2(handle)
        self.closed = True
