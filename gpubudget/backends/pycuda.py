"""PyCUDA backend: one ``cuMemAlloc`` per root budget, in a device's primary context.

One backend instance per device. PyCUDA initializes the driver and names the device; the
driver calls themselves go through ``ctypes`` on the same ``libcuda``, because PyCUDA's own
context stack re-activates *its* top context when it pops, which would undo a device the
caller chose through CuPy, PyTorch or ``cudaSetDevice``. The primary context is the one the
CUDA runtime, TensorRT, CuPy and PyTorch use (a context made with ``make_context()`` would be
a different one, and its pointers would belong to it). Every call that needs a current
context (allocating, freeing, copying, asking for free memory, creating events) pushes this
device's primary context and pops it after, so the caller's current context is exactly what
it was; when it already is this one, nothing is pushed.

Events on raw stream handles (TensorRT, CuPy and PyTorch pass ``cudaStream_t`` values as
integers) are created once and reused, and skipped when the stream has no work left. At
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

from .virtual import CudaVirtualRange, cuda_granularity

__all__ = ["PyCudaBackend", "PyCudaEvent", "PyCudaReservation", "current_device"]

_CUDA_SUCCESS: Final = 0
_CUDA_ERROR_OUT_OF_MEMORY: Final = 2
_CUDA_ERROR_NOT_READY: Final = 600
_CU_EVENT_DISABLE_TIMING: Final = 2
_p = ctypes.c_void_p
_SIGNATURES: Final = {
    "cuEventCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    "cuEventRecord": [_p, _p],
    "cuEventQuery": [_p],
    "cuEventSynchronize": [_p],
    "cuEventDestroy_v2": [_p],
    "cuStreamQuery": [_p],
    "cuStreamSynchronize": [_p],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cuCtxGetCurrent": [ctypes.POINTER(_p)],
    "cuCtxPushCurrent_v2": [_p],
    "cuCtxPopCurrent_v2": [ctypes.POINTER(_p)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_p), ctypes.c_int],
    "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemFree_v2": [ctypes.c_uint64],
    "cuMemGetInfo_v2": [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)],
    "cuMemcpyDtoD_v2": [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t],
    "cuPointerGetAttribute": [_p, ctypes.c_int, ctypes.c_uint64],
}


def _load_driver() -> ctypes.CDLL:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    lib = ctypes.CDLL(name)
    for function, argtypes in _SIGNATURES.items():
        getattr(lib, function).argtypes = argtypes
    return lib


_loaded: list[ctypes.CDLL] = []


def _driver() -> ctypes.CDLL:
    if not _loaded:
        cuda.init()
        _loaded.append(_load_driver())
    return _loaded[0]


def _check(status: int, what: str) -> None:
    if status != _CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call {what} failed with error {status}")


def current_device() -> int:
    """The device of the CUDA context current in the calling thread (the one CuPy's
    ``Device(n).use()``, ``torch.cuda.set_device(n)`` and ``cudaSetDevice`` make current),
    else 0."""
    device = ctypes.c_int(0)
    if _driver().cuCtxGetDevice(ctypes.byref(device)) != _CUDA_SUCCESS:
        return 0  # no context current in this thread
    return device.value


class PyCudaReservation:
    """A device allocation owned by a root budget."""

    __slots__ = ("_backend", "address", "nbytes", "_live", "__weakref__")

    def __init__(self, backend: PyCudaBackend, address: int, nbytes: int) -> None:
        self._backend = backend
        self.address: Final = address
        self.nbytes: Final = nbytes
        self._live = True

    def release(self) -> None:
        live, self._live = self._live, False
        if live and not self._backend.closed:
            with self._backend.active():
                _check(self._backend.driver.cuMemFree_v2(self.address), "cuMemFree")


class PyCudaEvent:
    """A CUDA event recorded on a raw stream handle; its handle goes back to the backend's
    free list when the event is dropped."""

    __slots__ = ("_backend", "_handle")

    def __init__(self, backend: PyCudaBackend, handle: int, stream: int) -> None:
        self._backend = backend
        self._handle: int | None = None  # owned only once recorded: a failed record leaves
        with backend.active():            # the handle to the caller, recycled once
            _check(backend.driver.cuEventRecord(handle, stream or None), "cuEventRecord")
        self._handle = handle

    def query(self) -> bool:
        if self._handle is None or self._backend.closed:
            return True
        status = int(self._backend.driver.cuEventQuery(self._handle))
        if status == _CUDA_ERROR_NOT_READY:
            return False
        _check(status, "cuEventQuery")
        return True

    def synchronize(self) -> None:
        if self._handle is not None and not self._backend.closed:
            _check(self._backend.driver.cuEventSynchronize(self._handle), "cuEventSynchronize")

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
    """Device memory in the primary context of CUDA device ``device``."""

    name = "pycuda"

    def __init__(self, device: int = 0) -> None:
        driver = _driver()
        if not 0 <= device < cuda.Device.count():
            raise ValueError(f"no CUDA device {device}: this machine has {cuda.Device.count()}")
        handle = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
        context = _p()
        _check(driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle.value),
               "cuDevicePrimaryCtxRetain")
        self.ordinal: Final = device
        self.device: Final = cuda.Device(device)
        self.driver: Final = driver
        self._context: Final = context.value
        self.closed = False
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[PyCudaReservation | CudaVirtualRange] = weakref.WeakSet()
        self._events: list[int] = []  # recorded events dropped, ready to be recorded again
        atexit.register(self._close)

    def __repr__(self) -> str:
        return f"<PyCudaBackend cuda:{self.ordinal} {self.device.name()}>"

    def device_uuid(self) -> str:
        """The device's UUID as NVML and ``nvidia-smi -L`` write it (``GPU-8f3c…``): the
        same in every process, whatever ``CUDA_VISIBLE_DEVICES`` makes its ordinal."""
        handle, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        _check(self.driver.cuDeviceGet(ctypes.byref(handle), self.ordinal), "cuDeviceGet")
        get_uuid = getattr(self.driver, "cuDeviceGetUuid_v2", None) or self.driver.cuDeviceGetUuid
        _check(get_uuid(ctypes.byref(raw), handle), "cuDeviceGetUuid")
        text = bytes(raw).hex()
        return f"GPU-{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"

    @contextmanager
    def active(self) -> Iterator[None]:
        """This device's primary context current for the calls inside, the caller's after."""
        current = _p()
        self.driver.cuCtxGetCurrent(ctypes.byref(current))
        if current.value == self._context:
            yield
            return
        _check(self.driver.cuCtxPushCurrent_v2(self._context), "cuCtxPushCurrent")
        try:
            yield
        finally:
            popped = _p()
            self.driver.cuCtxPopCurrent_v2(ctypes.byref(popped))

    def reserve(self, nbytes: int) -> PyCudaReservation:
        address = ctypes.c_uint64()
        with self.active():
            status = self.driver.cuMemAlloc_v2(ctypes.byref(address), nbytes)
        if status != _CUDA_SUCCESS:
            raise MemoryError(f"cuMemAlloc of {nbytes} bytes on device {self.ordinal} failed "
                              f"with error {status}"
                              + (" (out of memory)" if status == _CUDA_ERROR_OUT_OF_MEMORY
                                 else ""))
        reservation = PyCudaReservation(self, address.value, nbytes)
        with self._lock:
            self._live.add(reservation)
        return reservation

    def allocation_granularity(self) -> int:
        """The smallest physical allocation CUDA's virtual memory management makes here."""
        return cuda_granularity(self)

    def reserve_virtual(self, nbytes: int, granule: int) -> CudaVirtualRange:
        """Addresses for ``nbytes`` on this device (no memory), mapped granule by granule
        (see :mod:`gpubudget.backends.virtual`); freed with the rest at exit."""
        memory = CudaVirtualRange(self, nbytes, granule)
        with self._lock:
            self._live.add(memory)
        return memory

    def mem_info(self) -> tuple[int, int] | None:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self.active():
            status = self.driver.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return (free.value, total.value) if status == _CUDA_SUCCESS else None

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Device to device, complete on return (the legacy default stream is waited for)."""
        with self.active():
            _check(self.driver.cuMemcpyDtoD_v2(dst, src, nbytes), "cuMemcpyDtoD")
            _check(self.driver.cuStreamSynchronize(None), "cuStreamSynchronize")

    def record_event(self, stream: int) -> PyCudaEvent | _Finished:
        """An event after the work queued on ``stream`` so far; when the stream has none
        left (one driver call says so), no event is needed."""
        with self.active():  # the legacy stream (0) means the current context's
            idle = self.driver.cuStreamQuery(stream or None) == _CUDA_SUCCESS
        if idle:
            return _FINISHED
        with self._lock:
            handle = self._events.pop() if self._events else None
        if handle is None:
            created = _p()
            with self.active():
                _check(self.driver.cuEventCreate(ctypes.byref(created), _CU_EVENT_DISABLE_TIMING),
                       "cuEventCreate")
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
            events, self._events = set(self._events), []
        for reservation in live:
            try:
                reservation.release()
            except Exception:  # noqa: BLE001 - exit must be silent
                pass
        for handle in events:
            self.driver.cuEventDestroy_v2(handle)
        self.closed = True
