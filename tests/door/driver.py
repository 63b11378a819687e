"""The fake driver reached from Python the three ways a program finds the real one, for the
programs tests/test_door.py runs under ``gpubudget run`` (imported there, not by pytest)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final

P: Final = ctypes.c_uint64
SIZE: Final = ctypes.c_size_t
ALLOC: Final = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(P), SIZE)
FREE: Final = ctypes.CFUNCTYPE(ctypes.c_int, P)
INFO: Final = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(SIZE), ctypes.POINTER(SIZE))

handle: Final = ctypes.CDLL("libcuda.so.1")  # dlsym on the driver's handle
process: Final = ctypes.CDLL(None)  # what a program linked with the driver would call
fake: Final = ctypes.CDLL("libcuda.so.1")  # the fake's own test functions
fake.fake_used.restype = ctypes.c_int64


def proc(name: str, kind: type) -> Callable[..., int]:
    """``name`` through cuGetProcAddress_v2, as the CUDA runtime finds it."""
    get = handle.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                    ctypes.c_ulonglong, ctypes.c_void_p]
    found = ctypes.c_void_p()
    status = get(name.encode(), ctypes.byref(found), 12000, 0, None)
    assert status == 0 and found.value, (name, status)
    function: Callable[..., int] = kind(found.value)
    return function


def entry(way: str, name: str, kind: type) -> Callable[..., int]:
    if way == "proc":
        return proc(name.removesuffix("_v2"), kind)
    source = handle if way == "dlsym" else process
    function: Callable[..., int] = kind(ctypes.cast(getattr(source, name), ctypes.c_void_p).value)
    return function


def alloc(size: int, way: str = "dlsym") -> tuple[int, int]:
    """(status, address) of cuMemAlloc_v2 of ``size`` bytes found ``way``."""
    pointer = P()
    status = entry(way, "cuMemAlloc_v2", ALLOC)(ctypes.byref(pointer), size)
    return status, pointer.value


def free(address: int, way: str = "dlsym") -> int:
    return entry(way, "cuMemFree_v2", FREE)(address)


def info(way: str = "dlsym") -> tuple[int, int]:
    free_, total = SIZE(), SIZE()
    status = entry(way, "cuMemGetInfo_v2", INFO)(ctypes.byref(free_), ctypes.byref(total))
    assert status == 0
    return free_.value, total.value


def used() -> int:
    """What the fake device holds now."""
    return int(fake.fake_used())
