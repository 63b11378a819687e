"""Drive an allocator through TensorRT's own C++ -> Python trampoline, as TensorRT does.

A pybind11 instance holds its C++ object's address in the first word after ``PyObject_HEAD``;
that object's vtable slots 4-8 are ``allocate``, ``reallocate``, ``deallocate``,
``allocateAsync`` and ``deallocateAsync`` (seen with TensorRT-RTX 1.7.1). :func:`verify_slots` proves the mapping
with a recording probe before any test relies on it.
"""

from __future__ import annotations

import ctypes
from typing import Any

_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p
ALLOCATE = ctypes.CFUNCTYPE(_ptr, _ptr, _u64, _u64, ctypes.c_uint32)
REALLOCATE = ctypes.CFUNCTYPE(_ptr, _ptr, _ptr, _u64, _u64)
DEALLOCATE = ctypes.CFUNCTYPE(ctypes.c_bool, _ptr, _ptr)
ALLOCATE_ASYNC = ctypes.CFUNCTYPE(_ptr, _ptr, _u64, _u64, ctypes.c_uint32, _ptr)
DEALLOCATE_ASYNC = ctypes.CFUNCTYPE(ctypes.c_bool, _ptr, _ptr, _ptr)
_PYOBJECT_HEAD = ctypes.sizeof(ctypes.c_ssize_t) + ctypes.sizeof(ctypes.c_void_p)


class Trampoline:
    """The C++ side of one allocator object: call its virtual methods like TensorRT does."""

    def __init__(self, allocator: Any) -> None:
        self.owner = allocator  # keeps the Python object, hence the C++ one, alive
        cpp = ctypes.c_void_p.from_address(id(allocator) + _PYOBJECT_HEAD).value
        assert cpp, "no C++ object behind this allocator"
        self.cpp: int = cpp
        vtable = ctypes.cast(cpp, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
        self._allocate = ALLOCATE(vtable[4])
        self._reallocate = REALLOCATE(vtable[5])
        self._deallocate = DEALLOCATE(vtable[6])
        self._allocate_async = ALLOCATE_ASYNC(vtable[7])
        self._deallocate_async = DEALLOCATE_ASYNC(vtable[8])

    def allocate(self, size: int, alignment: int = 0, flags: int = 0) -> int | None:
        result: int | None = self._allocate(self.cpp, size, alignment, flags)
        return result

    def reallocate(self, address: int, alignment: int, new_size: int) -> int | None:
        result: int | None = self._reallocate(self.cpp, address, alignment, new_size)
        return result

    def deallocate(self, address: int) -> bool:
        return bool(self._deallocate(self.cpp, address))

    def allocate_async(self, size: int, alignment: int, flags: int, stream: int) -> int | None:
        result: int | None = self._allocate_async(self.cpp, size, alignment, flags, stream)
        return result

    def deallocate_async(self, address: int, stream: int) -> bool:
        return bool(self._deallocate_async(self.cpp, address, stream))


def verify_slots(trt: Any, base_name: str = "IGpuAsyncAllocator") -> None:
    """Check with a recording probe that slots 4-8 reach the Python methods expected."""
    base = getattr(trt, base_name)
    calls: list[tuple[Any, ...]] = []

    class Probe(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)

        def allocate(self, size: int, alignment: int, flags: int) -> int:
            calls.append(("allocate", size, alignment, flags))
            return 0x1000

        def reallocate(self, address: int, alignment: int, new_size: int) -> int:
            calls.append(("reallocate", address, alignment, new_size))
            return 0x2000

        def deallocate(self, memory: int) -> bool:
            calls.append(("deallocate", memory))
            return True

        def allocate_async(self, size: int, alignment: int, flags: int, stream: int) -> int:
            calls.append(("allocate_async", size, alignment, flags, stream))
            return 0x3000

        def deallocate_async(self, memory: int, stream: int) -> bool:
            calls.append(("deallocate_async", memory, stream))
            return True

    side = Trampoline(Probe())
    results = [
        side.allocate(100, 256, 1),
        side.reallocate(0x1000, 256, 200),
        side.deallocate(0x1000),
        side.allocate_async(300, 512, 0, 7),
        side.deallocate_async(0x3000, 7),
    ]
    if base_name == "IGpuAsyncAllocator":  # the synchronous slots arrive with stream 0
        expected = [
            ("allocate_async", 100, 256, 1, 0),
            ("reallocate", 0x1000, 256, 200),
            ("deallocate_async", 0x1000, 0),
            ("allocate_async", 300, 512, 0, 7),
            ("deallocate_async", 0x3000, 7),
        ]
        answers = [0x3000, 0x2000, True, 0x3000, True]
    else:  # IGpuAllocator: the stream-ordered slots end in the synchronous methods
        expected = [
            ("allocate", 100, 256, 1),
            ("reallocate", 0x1000, 256, 200),
            ("deallocate", 0x1000),
            ("allocate", 300, 512, 0),
            ("deallocate", 0x3000),
        ]
        answers = [0x1000, 0x2000, True, 0x1000, True]
    assert calls == expected, f"vtable slots do not map as expected: {calls}"
    assert results == answers, results
