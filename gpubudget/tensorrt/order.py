"""In which order does this binding pass its arguments? Asked of the binding itself.

NVIDIA's Python bindings do not all agree. TensorRT-RTX 1.7 calls
``allocate_async(size, alignment, flags, stream)``; the TensorRT 10 bindings call
``allocate_async(size, alignment, stream, flags)`` although their documentation says flags
third. Read in the wrong order, a stream becomes a flag and a flag a stream, and a block freed
on one stream can be handed to another stream before the first one's work is done.

So, once per binding class, gpubudget makes a probe object of that class and calls its C++
virtual methods itself, exactly as TensorRT does, with arguments it can recognise (distinct
values, each also the address of a readable buffer so that no reading of them can fault); the
binding's own trampoline then calls the probe's Python methods, which only record what they
receive. What arrives where says the order. Before any call,
:func:`~gpubudget.tensorrt.vtable.inspect_vtable` checks the object's layout against the
process's memory map; if anything is unexpected, nothing is called.

Whenever the order cannot be established, the callbacks use a *safe reading*: the stream of an
allocation is taken as unknown (no reuse of a block freed on "the same" stream: every reuse
waits for the stream work of the free), a resize is refused (TensorRT keeps its block), and an
output buffer replaced during inference is kept until its context ends. The probe never raises.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Final

from .vtable import VTable, inspect_vtable

__all__ = ["AllocatorOrder", "OutputOrder", "allocator_order", "output_order"]

_u64 = ctypes.c_uint64
_ptr = ctypes.c_void_p
_ALLOCATE = ctypes.CFUNCTYPE(_ptr, _ptr, _u64, _u64, ctypes.c_uint32)
_REALLOCATE = ctypes.CFUNCTYPE(_ptr, _ptr, _ptr, _u64, _u64)
_DEALLOCATE = ctypes.CFUNCTYPE(ctypes.c_bool, _ptr, _ptr)
_ALLOCATE_ASYNC = ctypes.CFUNCTYPE(_ptr, _ptr, _u64, _u64, ctypes.c_uint32, _ptr)
_DEALLOCATE_ASYNC = ctypes.CFUNCTYPE(ctypes.c_bool, _ptr, _ptr, _ptr)
# One signature that every IOutputAllocator slot tolerates: (name, memory, size, alignment,
# stream) for the reallocations; notifyShape reads (name, Dims const&) and ignores the rest.
_OUTPUT_SLOT = ctypes.CFUNCTYPE(_ptr, _ptr, ctypes.c_char_p, _ptr, _u64, _u64, _ptr)
# IGpuAllocator's virtual methods after IVersionedInterface's four (TensorRT 10 and later)
_ALLOCATE_SLOT, _REALLOCATE_SLOT, _DEALLOCATE_SLOT = 4, 5, 6
_ALLOCATE_ASYNC_SLOT, _DEALLOCATE_ASYNC_SLOT = 7, 8
_FIRST_OUTPUT_SLOT: Final = 4
_FLAGS: Final = 1  # AllocatorFlag.RESIZABLE as the C++ side passes it
_NAME: Final = "gpubudget-probe"
_SHAPE: Final = (7, 9)


class _Dims(ctypes.Structure):
    """TensorRT's ``Dims`` (``Dims64``): a rank and eight extents."""

    _fields_ = [("nbDims", ctypes.c_int32), ("d", ctypes.c_int64 * 8)]


@dataclass(frozen=True)
class AllocatorOrder:
    """What a binding's ``IGpuAsyncAllocator`` (or ``IGpuAllocator``) passes, and where.

    ``stream_index``: the position of the stream among ``allocate_async``'s arguments,
    counted from 0: 3 when flags come third and the stream fourth (TensorRT-RTX 1.7), 2 when
    the stream comes third (TensorRT 10), ``None`` when no stream can be trusted. ``frees``:
    ``deallocate_async(memory, stream)`` confirmed (if not, the allocator frees each block on
    the stream it was allocated for). ``resize``: ``reallocate(address, alignment, new_size)`` confirmed.
    ``found``: one sentence, how it was established or why it was not.
    """

    stream_index: int | None
    frees: bool
    resize: bool
    found: str

    @property
    def known(self) -> bool:
        """Whether allocations carry their stream (the order was established)."""
        return self.stream_index is not None

    @property
    def remember(self) -> bool:
        """Whether the allocator must free each block on the stream it was allocated for:
        allocations carry their stream, frees were not seen to carry theirs."""
        return self.stream_index is not None and not self.frees


@dataclass(frozen=True)
class OutputOrder:
    """What a binding's ``IOutputAllocator`` passes: ``reallocate_output_async(name, memory,
    size, alignment, stream)`` confirmed (``stream``), ``notify_shape(name, shape)`` confirmed
    (``shape``); ``found`` as in :class:`AllocatorOrder`."""

    stream: bool
    shape: bool
    found: str


def _unknown(why: str) -> AllocatorOrder:
    return AllocatorOrder(None, False, False, f"order not established ({why}): safe reading")


class _Values:
    """Recognisable arguments: distinct, and each the address of a live buffer."""

    def __init__(self) -> None:
        self._buffers = [ctypes.create_string_buffer(64) for _ in range(4)]
        self.size, self.alignment, self.stream, self.memory = (
            ctypes.addressof(b) for b in self._buffers)
        self.dims = _Dims(len(_SHAPE), (ctypes.c_int64 * 8)(*_SHAPE))
        self.dims_at = ctypes.addressof(self.dims)


def allocator_order(base: type) -> AllocatorOrder:
    """Ask the binding class ``base`` (``IGpuAsyncAllocator`` or ``IGpuAllocator``) in which
    order it passes allocation arguments; never raises (a failure is the safe reading)."""
    try:
        return _allocator_order(base)
    except Exception as exc:  # noqa: BLE001 - any surprise means "not established"
        return _unknown(f"{type(exc).__name__}: {exc}")


def _recorder(base: Any, names: tuple[str, ...], answers: dict[str, Any]) -> Any:
    """A subclass of ``base`` whose methods ``names`` record their arguments."""
    calls: list[tuple[str, tuple[Any, ...]]] = []

    def method(name: str) -> Any:
        def record(self: Any, *args: Any) -> Any:
            calls.append((name, args))
            return answers[name]
        return record

    def __init__(self: Any) -> None:
        base.__init__(self)

    namespace: dict[str, Any] = {name: method(name) for name in names}
    namespace["__init__"] = __init__
    probe = type("OrderProbe", (base,), namespace)()
    return probe, calls


def _allocator_order(base: type) -> AllocatorOrder:
    names = ("allocate", "reallocate", "deallocate", "allocate_async", "deallocate_async")
    answers = {"allocate": 0, "reallocate": 0, "deallocate": False, "allocate_async": 0,
               "deallocate_async": False}
    probe, calls = _recorder(base, names, answers)
    table = inspect_vtable(probe, base, base.__name__.lstrip("I"))
    if isinstance(table, str):
        return _unknown(table)
    if len(table.slots) <= _DEALLOCATE_ASYNC_SLOT:
        return _unknown(f"{table.class_name} has {len(table.slots)} virtual methods, not 9")
    v = _Values()
    slot = table.slots
    _ALLOCATE_ASYNC(slot[_ALLOCATE_ASYNC_SLOT])(table.cpp, v.size, v.alignment, _FLAGS, v.stream)
    first = _one(calls)
    if first == ("allocate", (v.size, v.alignment, _FLAGS)):
        return AllocatorOrder(None, False, False, f"{_who(table)}: allocations arrive without "
                              "their stream (an IGpuAllocator): safe reading")
    if first == ("allocate_async", (v.size, v.alignment, _FLAGS, v.stream)):
        index, order = 3, "flags, stream"
    elif first == ("allocate_async", (v.size, v.alignment, v.stream, _FLAGS)):
        index, order = 2, "stream, flags"
    else:
        return _unknown(f"{_who(table)} passed {first!r} for allocateAsync")
    _ALLOCATE(slot[_ALLOCATE_SLOT])(table.cpp, v.size, v.alignment, _FLAGS)
    synchronous = _one(calls)
    default = [v.size, v.alignment, _FLAGS, _FLAGS]
    default[index] = 0  # the synchronous allocate reaches allocate_async on stream 0
    if synchronous not in (("allocate", (v.size, v.alignment, _FLAGS)),
                           ("allocate_async", tuple(default))):
        return _unknown(f"{_who(table)}: allocate and allocateAsync disagree ({synchronous!r})")
    _DEALLOCATE_ASYNC(slot[_DEALLOCATE_ASYNC_SLOT])(table.cpp, v.memory, v.stream)
    frees = _one(calls) == ("deallocate_async", (v.memory, v.stream))
    _REALLOCATE(slot[_REALLOCATE_SLOT])(table.cpp, v.memory, v.alignment, v.size)
    resize = _one(calls) == ("reallocate", (v.memory, v.alignment, v.size))
    if not frees:  # the callbacks free each block on the stream it was allocated for
        return AllocatorOrder(index, False, resize, f"{_who(table)}: allocate_async(size, "
                              f"alignment, {order}), found by calling its C++ allocateAsync "
                              "once; deallocate_async does not pass (memory, stream): each "
                              "block is freed on its allocation's stream")
    return AllocatorOrder(index, frees, resize, f"{_who(table)}: allocate_async(size, "
                          f"alignment, {order}), found by calling its C++ allocateAsync once")


def output_order(base: type) -> OutputOrder:
    """Ask the binding class ``base`` (``IOutputAllocator``) in which order it passes
    ``reallocate_output_async`` and ``notify_shape``; never raises."""
    try:
        return _output_order(base)
    except Exception as exc:  # noqa: BLE001
        return OutputOrder(False, False, f"order not established ({type(exc).__name__}: "
                           f"{exc}): safe reading")


def _output_order(base: type) -> OutputOrder:
    names = ("reallocate_output", "reallocate_output_async", "notify_shape")
    probe, calls = _recorder(base, names, {"reallocate_output": 0,
                                           "reallocate_output_async": 0, "notify_shape": None})
    table = inspect_vtable(probe, base, base.__name__.lstrip("I"))
    if isinstance(table, str):
        return OutputOrder(False, False, f"order not established ({table}): safe reading")
    v = _Values()
    seen: dict[str, tuple[Any, ...] | None] = {}
    for index in range(_FIRST_OUTPUT_SLOT, min(len(table.slots), _FIRST_OUTPUT_SLOT + 4)):
        _OUTPUT_SLOT(table.slots[index])(table.cpp, _NAME.encode(), v.dims_at, v.size,
                                         v.alignment, v.stream)
        call = _one(calls)
        if call is not None and call[0] not in seen:
            seen[call[0]] = _plain(call[1])
        elif call is not None:
            seen[call[0]] = None  # two slots reached one method: trust neither
    stream = seen.get("reallocate_output_async") == (_NAME, v.dims_at, v.size, v.alignment,
                                                     v.stream)
    shape = seen.get("notify_shape") == (_NAME, _SHAPE)
    found = ", ".join(f"{name} {'confirmed' if ok else 'not established'}" for name, ok in
                      (("reallocate_output_async(name, memory, size, alignment, stream)",
                        stream), ("notify_shape(name, shape)", shape)))
    return OutputOrder(stream, shape, f"{_who(table)}: {found}")


def _one(calls: list[tuple[str, tuple[Any, ...]]]) -> tuple[str, tuple[Any, ...]] | None:
    """The single call recorded since the last one taken, else ``None``."""
    taken = calls[:]
    calls.clear()
    return taken[0] if len(taken) == 1 else None


def _plain(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Arguments as plain values (a ``Dims`` as a tuple of ints)."""
    out: list[Any] = []
    for arg in args:
        if isinstance(arg, (int, str)):
            out.append(arg)
        else:
            try:
                out.append(tuple(int(d) for d in arg))
            except (TypeError, ValueError):
                out.append(repr(arg))
    return tuple(out)


def _who(table: VTable) -> str:
    return f"{table.class_name} of {table.library.rsplit('/', 1)[-1]}"
