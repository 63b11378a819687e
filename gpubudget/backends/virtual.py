"""Address ranges that are backed by physical memory granule by granule.

A growable root budget (``gpu_budget(limit, initial=...)``) reserves addresses for its whole
limit at entry and maps physical memory into them only as blocks need it. A backend that can
do that has ``reserve_virtual(nbytes, granule)``, which returns a :class:`VirtualRange`:

- on CUDA (:class:`CudaVirtualRange`), CUDA's virtual memory management: the addresses come
  from ``cuMemAddressReserve`` (no memory), each granule is one ``cuMemCreate`` handle mapped
  with ``cuMemMap`` and made readable and writable by the device with ``cuMemSetAccess``, and
  ``cuMemUnmap`` + ``cuMemRelease`` give it back without moving anything else;
- in host memory (:class:`HostVirtualRange`), the same with ``mmap``: the range is mapped
  without access (``PROT_NONE``), a granule is mapped by ``mprotect`` to read and write, and
  unmapped by ``madvise(MADV_DONTNEED)`` (its pages are dropped) and ``PROT_NONE`` again, so
  that a block touching an unmapped granule faults, as it would on a device.

Both copy between the range and host memory (page-locked, or plain), for a budget put to
sleep (``offload``) and woken (``restore``). Every map either completes or raises ``MemoryError``
having changed nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from typing import TYPE_CHECKING, Final, Protocol

from ..errors import raise_if_from_outside

if TYPE_CHECKING:
    from .pycuda import PyCudaBackend

__all__ = ["CudaVirtualRange", "HostStaging", "HostVirtualRange", "Staging", "VirtualRange"]


class Staging(Protocol):
    """Host memory a sleeping budget's blocks are copied to."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def release(self) -> None: ...


class VirtualRange(Protocol):
    """``nbytes`` of addresses from ``address``, in granules of ``granule`` bytes."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def granule(self) -> int: ...

    def map(self, index: int) -> None:
        """Back granule ``index`` with memory; ``MemoryError`` if there is none to be had
        (nothing changed), ``IndexError`` for an index outside the range."""
        ...

    def unmap(self, index: int) -> None:
        """Give granule ``index``'s memory back; its contents are lost. ``MemoryError`` if
        the device refuses: the granule is then still mapped, its contents kept, and the
        range's to unmap again or release; ``IndexError`` for an index outside the range."""
        ...

    def release(self) -> None:
        """Unmap every granule and give the addresses back; a second call does nothing."""
        ...

    def stage(self, nbytes: int, pinned: bool) -> Staging:
        """Host memory of ``nbytes`` bytes, page-locked if ``pinned`` (faster copies, slower
        to get and give back); ``MemoryError`` if there is none."""
        ...

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        """Copy ``nbytes`` from the range to host memory, complete on return."""
        ...

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        """Copy ``nbytes`` from host memory into the range, complete on return."""
        ...


# -- host memory -----------------------------------------------------------------------------

_PROT_NONE: Final = 0
_PROT_READ_WRITE: Final = 3
_MAP_PRIVATE_ANONYMOUS: Final = 0x02 | 0x20
_MAP_NORESERVE: Final = 0x4000
_MADV_DONTNEED: Final = 4
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
_libc: list[ctypes.CDLL] = []


def _c() -> ctypes.CDLL:
    """The C library, with the signatures of the calls used here (Linux)."""
    if not _libc:
        import ctypes.util  # here: it imports subprocess, shutil and tempfile

        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.append(libc)
    return _libc[0]


def _failed(what: str) -> MemoryError:
    return MemoryError(f"{what} failed: {os.strerror(ctypes.get_errno())}")


def _inside(index: int, nbytes: int, granule: int) -> None:
    """Refuse a granule index outside a range of ``nbytes`` in granules of ``granule``."""
    count = nbytes // granule
    if not 0 <= index < count:
        raise IndexError(f"granule {index} is outside the range (granules 0 to {count - 1})")


class HostStaging:
    """Pageable host memory (an anonymous mapping: no page is committed until copied to)."""

    __slots__ = ("_map", "address", "nbytes")

    def __init__(self, nbytes: int) -> None:
        try:
            self._map: mmap.mmap | None = mmap.mmap(-1, max(nbytes, 1))
        except (OSError, OverflowError, ValueError) as exc:
            raise_if_from_outside(exc)
            raise MemoryError(f"no host memory for {nbytes} bytes of staging: {exc}") from exc
        anchor = ctypes.c_char.from_buffer(self._map)
        self.address: Final = ctypes.addressof(anchor)
        del anchor  # no export left, so that the map can be closed
        self.nbytes: Final = nbytes

    def release(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


class HostVirtualRange:
    """A range of host addresses mapped granule by granule (see the module docstring).

    ``capacity`` limits the bytes mapped at once, like a device's memory, so that a growth
    can be refused for want of memory; ``None`` means no limit but the machine's.
    """

    __slots__ = ("address", "nbytes", "granule", "capacity", "mapped", "_live")

    def __init__(self, nbytes: int, granule: int, capacity: int | None = None) -> None:
        if not sys.platform.startswith("linux"):
            raise MemoryError("host virtual memory is implemented for Linux only")
        page = mmap.PAGESIZE
        if granule <= 0 or granule % page:
            raise ValueError(f"granule must be a positive multiple of the page size {page}, "
                             f"got {granule}")
        size = -(-nbytes // granule) * granule
        address = _c().mmap(None, size, _PROT_NONE, _MAP_PRIVATE_ANONYMOUS | _MAP_NORESERVE,
                            -1, 0)
        if address is None or address == _MAP_FAILED:
            raise _failed(f"reserving {size} bytes of addresses")
        self.address: Final[int] = address
        self.nbytes: Final = size
        self.granule: Final = granule
        self.capacity = capacity
        self.mapped = 0  # bytes mapped now
        self._live = True

    def map(self, index: int) -> None:
        _inside(index, self.nbytes, self.granule)
        if self.capacity is not None and self.mapped + self.granule > self.capacity:
            raise MemoryError(f"out of memory: {self.mapped} of {self.capacity} bytes mapped")
        start = self.address + index * self.granule
        if _c().mprotect(start, self.granule, _PROT_READ_WRITE) != 0:
            raise _failed(f"mapping granule {index}")
        self.mapped += self.granule

    def unmap(self, index: int) -> None:
        _inside(index, self.nbytes, self.granule)
        start = self.address + index * self.granule
        libc = _c()
        if libc.mprotect(start, self.granule, _PROT_NONE) != 0:  # still mapped, bytes kept
            raise _failed(f"unmapping granule {index}")
        if libc.madvise(start, self.granule, _MADV_DONTNEED) != 0:  # pages kept: map it back
            error = _failed(f"dropping the pages of granule {index}")
            libc.mprotect(start, self.granule, _PROT_READ_WRITE)
            raise error
        self.mapped -= self.granule  # its pages were dropped: zeroes when mapped again

    def release(self) -> None:
        if self._live:
            self._live = False
            _c().munmap(self.address, self.nbytes)
            self.mapped = 0

    def stage(self, nbytes: int, pinned: bool = False) -> HostStaging:
        return HostStaging(nbytes)  # host memory is host memory: nothing to pin

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        ctypes.memmove(host, device, nbytes)

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        ctypes.memmove(device, host, nbytes)


# -- CUDA ---------------------------------------------------------------------------------------

_OUT_OF_MEMORY: Final = 2
_u64 = ctypes.c_uint64
_size = ctypes.c_size_t


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_SIGNATURES: Final = {
    "cuMemGetAllocationGranularity": [ctypes.POINTER(_size), ctypes.POINTER(_AllocationProp),
                                      ctypes.c_int],
    "cuMemAddressReserve": [ctypes.POINTER(_u64), _size, _size, _u64, ctypes.c_ulonglong],
    "cuMemAddressFree": [_u64, _size],
    "cuMemCreate": [ctypes.POINTER(ctypes.c_ulonglong), _size, ctypes.POINTER(_AllocationProp),
                    ctypes.c_ulonglong],
    "cuMemRelease": [ctypes.c_ulonglong],
    "cuMemMap": [_u64, _size, _size, ctypes.c_ulonglong, ctypes.c_ulonglong],
    "cuMemUnmap": [_u64, _size],
    "cuMemSetAccess": [_u64, _size, ctypes.POINTER(_AccessDesc), _size],
    "cuMemHostAlloc": [ctypes.POINTER(ctypes.c_void_p), _size, ctypes.c_uint],
    "cuMemFreeHost": [ctypes.c_void_p],
    "cuMemcpyDtoH_v2": [ctypes.c_void_p, _u64, _size],
    "cuMemcpyHtoD_v2": [_u64, ctypes.c_void_p, _size],
}
_typed: set[int] = set()


def _driver_of(backend: PyCudaBackend) -> ctypes.CDLL:
    driver = backend.driver
    if id(driver) not in _typed:
        for function, argtypes in _SIGNATURES.items():
            getattr(driver, function).argtypes = argtypes
        _typed.add(id(driver))
    return driver


def _status(status: int, what: str) -> None:
    if status == _OUT_OF_MEMORY:
        raise MemoryError(f"{what}: out of device memory")
    if status != 0:
        raise MemoryError(f"{what} failed with CUDA error {status}")


def _prop(ordinal: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED: device memory, not migratable
    prop.requestedHandleTypes = 0  # CU_MEM_HANDLE_TYPE_NONE
    prop.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    return prop


def cuda_granularity(backend: PyCudaBackend) -> int:
    """The smallest size a physical allocation may have on ``backend``'s device."""
    driver = _driver_of(backend)
    granularity = _size()
    prop = _prop(backend.ordinal)
    with backend.active():
        _status(driver.cuMemGetAllocationGranularity(ctypes.byref(granularity),
                                                     ctypes.byref(prop), 0),
                "cuMemGetAllocationGranularity")
    return granularity.value


class CudaStaging:
    """Pinned host memory (``cuMemHostAlloc``) for a sleeping budget's blocks."""

    __slots__ = ("_backend", "address", "nbytes", "_live")

    def __init__(self, backend: PyCudaBackend, nbytes: int) -> None:
        pointer = ctypes.c_void_p()
        with backend.active():
            _status(_driver_of(backend).cuMemHostAlloc(ctypes.byref(pointer), max(nbytes, 1), 0),
                    f"cuMemHostAlloc of {nbytes} bytes")
        assert pointer.value is not None
        self._backend = backend
        self.address: Final = pointer.value
        self.nbytes: Final = nbytes
        self._live = True

    def release(self) -> None:
        if self._live and not self._backend.closed:
            self._live = False
            with self._backend.active():
                _driver_of(self._backend).cuMemFreeHost(self.address)


class CudaVirtualRange:
    """A range of device addresses on ``backend``'s device, mapped granule by granule with
    CUDA's virtual memory management (see the module docstring)."""

    __slots__ = ("_backend", "_driver", "address", "nbytes", "granule", "_handles",
                 "_unreleased", "_prop", "_access", "_live", "__weakref__")

    def __init__(self, backend: PyCudaBackend, nbytes: int, granule: int) -> None:
        minimum = cuda_granularity(backend)
        if granule <= 0 or granule % minimum:
            raise ValueError(f"granule must be a positive multiple of the device's allocation "
                             f"granularity {minimum}, got {granule}")
        size = -(-nbytes // granule) * granule
        self._backend = backend
        self._driver = _driver_of(backend)
        address = _u64()
        with backend.active():
            _status(self._driver.cuMemAddressReserve(ctypes.byref(address), size, granule, 0, 0),
                    f"cuMemAddressReserve of {size} bytes")
        self.address: Final = address.value
        self.nbytes: Final = size
        self.granule: Final = granule
        self._handles: dict[int, int] = {}  # granule index -> its physical allocation
        self._unreleased: list[int] = []  # unmapped allocations the driver would not release
        self._prop = _prop(backend.ordinal)
        self._access = _AccessDesc()
        self._access.location.type = 1
        self._access.location.id = backend.ordinal
        self._access.flags = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._live = True

    def map(self, index: int) -> None:
        _inside(index, self.nbytes, self.granule)
        driver, granule = self._driver, self.granule
        start = self.address + index * granule
        handle = ctypes.c_ulonglong()
        with self._backend.active():
            _status(driver.cuMemCreate(ctypes.byref(handle), granule, ctypes.byref(self._prop),
                                       0), f"cuMemCreate of {granule} bytes")
            try:
                _status(driver.cuMemMap(start, granule, 0, handle.value, 0), "cuMemMap")
                try:
                    _status(driver.cuMemSetAccess(start, granule, ctypes.byref(self._access), 1),
                            "cuMemSetAccess")
                except MemoryError:
                    driver.cuMemUnmap(start, granule)
                    raise
            except MemoryError:
                driver.cuMemRelease(handle.value)
                raise
        self._handles[index] = handle.value

    def unmap(self, index: int) -> None:
        _inside(index, self.nbytes, self.granule)
        handle = self._handles.get(index)
        if handle is None:
            return  # not mapped
        if self._backend.closed:  # the context is gone, and its memory with it
            del self._handles[index]
            return
        start = self.address + index * self.granule
        with self._backend.active():
            _status(self._driver.cuMemUnmap(start, self.granule), "cuMemUnmap")  # or still ours
            del self._handles[index]
            if self._driver.cuMemRelease(handle) != 0:  # unmapped, its memory still held:
                self._unreleased.append(handle)  # tried again at release()

    def release(self) -> None:
        if not self._live:
            return
        self._live = False
        for index in list(self._handles):
            try:
                self.unmap(index)
            except MemoryError:  # a broken driver: free the rest of what can be freed
                pass
        if not self._backend.closed:
            with self._backend.active():
                for handle in self._unreleased:
                    self._driver.cuMemRelease(handle)
                self._unreleased.clear()
                self._driver.cuMemAddressFree(self.address, self.nbytes)

    def stage(self, nbytes: int, pinned: bool = True) -> CudaStaging | HostStaging:
        return CudaStaging(self._backend, nbytes) if pinned else HostStaging(nbytes)

    def to_host(self, host: int, device: int, nbytes: int) -> None:
        with self._backend.active():
            _status(self._driver.cuMemcpyDtoH_v2(host, device, nbytes), "cuMemcpyDtoH")

    def to_device(self, device: int, host: int, nbytes: int) -> None:
        with self._backend.active():
            _status(self._driver.cuMemcpyHtoD_v2(device, host, nbytes), "cuMemcpyHtoD")
