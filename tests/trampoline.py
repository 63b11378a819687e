"""Drive an allocator through TensorRT's own C++ -> Python trampoline, as TensorRT does.

A pybind11 instance holds its C++ object's address in the first word after ``PyObject_HEAD``;
that object's vtable slots 4-8 are ``allocate``, ``reallocate``, ``deallocate``,
``allocateAsync`` and ``deallocateAsync`` (seen with TensorRT-RTX 1.7.1 and the lean runtimes
10.16 and 11.4). The methods here take the C++ order, ``allocateAsync(size, alignment, flags,
stream)``, whatever order the binding then passes to Python. :func:`verify_slots` proves the mapping
with a recording probe before any test relies on it. :class:`OutputTrampoline` does the same
for an ``IOutputAllocator``, whose slots differ between bindings (:func:`output_slots` finds
them).
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


def verify_slots(trt: Any, base_name: str = "IGpuAsyncAllocator", stream_index: int = 3) -> None:
    """Check with a recording probe that slots 4-8 reach the Python methods expected;
    ``stream_index``: where the binding puts ``allocate_async``'s stream (2: TensorRT 10,
    ``(size, alignment, stream, flags)``; 3: from TensorRT 11.2 and TensorRT-RTX)."""
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

        def allocate_async(self, size: int, alignment: int, third: int, fourth: int) -> int:
            flags, stream = (fourth, third) if stream_index == 2 else (third, fourth)
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


class _Dims(ctypes.Structure):
    _fields_ = [("nbDims", ctypes.c_int32), ("d", ctypes.c_int64 * 8)]


REALLOCATE_OUTPUT = ctypes.CFUNCTYPE(_ptr, _ptr, ctypes.c_char_p, _ptr, _u64, _u64)
REALLOCATE_OUTPUT_ASYNC = ctypes.CFUNCTYPE(_ptr, _ptr, ctypes.c_char_p, _ptr, _u64, _u64, _ptr)
NOTIFY_SHAPE = ctypes.CFUNCTYPE(None, _ptr, ctypes.c_char_p, ctypes.POINTER(_Dims))
_output_layouts: dict[type, dict[str, int]] = {}


def output_slots(base: Any) -> dict[str, int]:
    """Which vtable slot of ``base`` (an ``IOutputAllocator``) reaches which Python method,
    found with a recording probe: TensorRT-RTX 1.7 has ``reallocate_output_async`` at 4 and
    ``notify_shape`` at 5; TensorRT 10 has ``reallocate_output`` first (4, 5, 6)."""
    if base in _output_layouts:
        return _output_layouts[base]
    calls: list[str] = []

    class Probe(base):  # type: ignore[misc]
        def __init__(self) -> None:
            base.__init__(self)

        def reallocate_output(self, *args: Any) -> int:
            calls.append("reallocate_output")
            return 0

        def reallocate_output_async(self, *args: Any) -> int:
            calls.append("reallocate_output_async")
            return 0

        def notify_shape(self, *args: Any) -> None:
            calls.append("notify_shape")

    probe = Probe()
    cpp = ctypes.c_void_p.from_address(id(probe) + _PYOBJECT_HEAD).value
    assert cpp, "no C++ object behind the probe"
    vtable = ctypes.cast(cpp, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
    dims = _Dims(1, (ctypes.c_int64 * 8)(3))
    universal = ctypes.CFUNCTYPE(_ptr, _ptr, ctypes.c_char_p, _ptr, _u64, _u64, _ptr)
    layout: dict[str, int] = {}
    for index in range(4, 7):
        if not vtable[index]:
            break
        universal(vtable[index])(cpp, b"probe", ctypes.addressof(dims), 1, 256, 0)
        assert len(calls) == 1, calls
        layout[calls.pop()] = index
    assert {"reallocate_output_async", "notify_shape"} <= set(layout), layout
    _output_layouts[base] = layout
    return layout


class OutputTrampoline:
    """The C++ side of an ``IOutputAllocator``: call it as ``execute_async_v3`` does."""

    def __init__(self, allocator: Any, base: Any) -> None:
        self.owner = allocator
        cpp = ctypes.c_void_p.from_address(id(allocator) + _PYOBJECT_HEAD).value
        assert cpp, "no C++ object behind this output allocator"
        self.cpp: int = cpp
        vtable = ctypes.cast(cpp, ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)))[0]
        layout = output_slots(base)
        self._async = REALLOCATE_OUTPUT_ASYNC(vtable[layout["reallocate_output_async"]])
        self._shape = NOTIFY_SHAPE(vtable[layout["notify_shape"]])
        sync = layout.get("reallocate_output")
        self._sync = REALLOCATE_OUTPUT(vtable[sync]) if sync is not None else None

    def reallocate_output_async(self, name: str, memory: int, size: int, alignment: int,
                                stream: int) -> int | None:
        result: int | None = self._async(self.cpp, name.encode(), memory, size, alignment, stream)
        return result

    def reallocate_output(self, name: str, memory: int, size: int, alignment: int) -> int | None:
        assert self._sync is not None, "this binding has no reallocateOutput"
        result: int | None = self._sync(self.cpp, name.encode(), memory, size, alignment)
        return result

    def notify_shape(self, name: str, shape: tuple[int, ...]) -> None:
        dims = _Dims(len(shape), (ctypes.c_int64 * 8)(*shape))
        self._shape(self.cpp, name.encode(), ctypes.byref(dims))
