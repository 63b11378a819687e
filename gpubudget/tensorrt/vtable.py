"""Read the C++ side of a TensorRT Python object without ever touching memory blindly.

NVIDIA's bindings are pybind11 classes: an instance of a Python subclass of, say,
``IGpuAsyncAllocator`` holds, in the first word after its Python header, the address of a C++
"trampoline" object whose virtual methods call the Python ones. Calling those virtual methods
ourselves, as TensorRT's C++ does, is how :mod:`~gpubudget.tensorrt.order` learns in which
order a binding passes its arguments.

Calling through a wrong pointer would crash the process, and this runs inside user processes,
so every step is checked first against the process's memory map (``/proc/self/maps``), which
is read, never probed:

- every word read lies inside a readable mapping;
- the object's virtual table lies in the shared library that defines the Python base class
  (the binding's extension module), and so does every slot that may be called, in an
  executable mapping of it;
- the class's C++ name (from its RTTI) contains what the caller expects
  (``"GpuAsyncAllocator"``, ``"OutputAllocator"``);
- the class derives from ``nvinfer1::IVersionedInterface`` (its RTTI's chain of single bases),
  so that the interface's own methods start at slot 4, after ``IVersionedInterface``'s four.
  TensorRT 8's classes have no such base and another layout: there, slot 4 of an
  ``IOutputAllocator`` is its deleting destructor.

Anything unexpected (no memory map: not Linux; a pure-Python stand-in; another layout) gives a
reason instead of a :class:`VTable`, and the caller falls back to what needs no probe.

A like reading, through ``/proc/self/mem`` where it can be read (a read of unmapped memory
fails there), tells whether an object TensorRT returned is real at all (:func:`unusable`): without a CUDA driver, the lean runtime's ``Runtime(logger)`` logs "CUDA
initialization failure" and still returns a Python object whose C++ pointer is a small bogus
value (0x228); using that object, or merely destroying it, crashes the process.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib.machinery
import os
import sys
from dataclasses import dataclass
from typing import Final

__all__ = ["MAPS", "VTable", "inspect_vtable", "unusable"]

MAPS: Final = "/proc/self/maps"
_MEM: Final = "/proc/self/mem"
_WORD: Final = ctypes.sizeof(ctypes.c_void_p)
_HEAD: Final = object.__basicsize__  # PyObject_HEAD: the pybind11 value pointer follows it
_MAX_SLOTS: Final = 32
_MAX_NAME: Final = 256
_MAX_BASES: Final = 8
_VERSIONED: Final = b"IVersionedInterfaceE"  # the end of its mangled name


@dataclass(frozen=True)
class _Mapping:
    start: int
    end: int
    readable: bool
    executable: bool
    path: str


class _Map:
    """A snapshot of the process's memory mappings, sorted by address."""

    def __init__(self, text: str) -> None:
        found: list[_Mapping] = []
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 5 or "-" not in parts[0]:
                continue
            low, high = parts[0].split("-", 1)
            perms = parts[1]
            path = parts[5].strip() if len(parts) == 6 else ""
            found.append(_Mapping(int(low, 16), int(high, 16), perms[:1] == "r",
                                  perms[2:3] == "x", path))
        found.sort(key=lambda m: m.start)
        self._maps = found
        self._starts = [m.start for m in found]

    def find(self, address: int, size: int = _WORD) -> _Mapping | None:
        """The mapping holding ``[address, address + size)`` whole, if any."""
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0:
            return None
        mapping = self._maps[index]
        return mapping if address + size <= mapping.end else None

    def word(self, address: int) -> int | None:
        """The word at ``address`` if it lies in readable memory."""
        mapping = self.find(address)
        if mapping is None or not mapping.readable or address % _WORD:
            return None
        return ctypes.c_size_t.from_address(address).value

    def c_string(self, address: int) -> bytes | None:
        """The NUL-terminated string at ``address`` (at most 256 bytes), if readable."""
        mapping = self.find(address, 1)
        if mapping is None or not mapping.readable:
            return None
        raw = ctypes.string_at(address, min(_MAX_NAME, mapping.end - address))
        end = raw.find(b"\0")
        return raw[:end] if end >= 0 else None


@dataclass(frozen=True)
class VTable:
    """The C++ object behind a binding's Python object: its address, the addresses of its
    virtual methods that are code of the binding's library (slot 0 onwards), and its C++
    class name as RTTI spells it."""

    cpp: int
    slots: tuple[int, ...]
    class_name: str
    library: str


def _library_of(base: type) -> str | None:
    """The file of the extension module that defines ``base`` (resolved), if any."""
    module = sys.modules.get(getattr(base, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(
            tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        return None
    return os.path.realpath(path)


def inspect_vtable(obj: object, base: type, expect: str) -> VTable | str:
    """The :class:`VTable` of ``obj``, an instance of a Python subclass of the binding class
    ``base``, or a sentence saying why it cannot be trusted. Never raises, never reads
    memory that the memory map does not show readable."""
    try:
        return _inspect(obj, base, expect)
    except Exception as exc:  # noqa: BLE001 - anything unexpected means "do not trust it"
        return f"inspecting the C++ object failed: {type(exc).__name__}: {exc}"


def _inspect(obj: object, base: type, expect: str) -> VTable | str:
    if not isinstance(obj, base):
        return f"{obj!r} is not an instance of {base!r}"
    library = _library_of(base)
    if library is None:
        return f"{base.__qualname__} is not defined by an extension module"
    if base.__basicsize__ < _HEAD + _WORD:
        return f"{base.__qualname__} keeps no pointer after its Python header"
    try:
        with open(MAPS, encoding="utf-8", errors="replace") as file:
            memory = _Map(file.read())
    except OSError as exc:
        return f"the process's memory map cannot be read here ({MAPS}: {exc.strerror or exc})"
    cpp = memory.word(id(obj) + _HEAD)
    if not cpp:
        return "no C++ object after the Python header"
    vptr = memory.word(cpp)
    home = memory.find(vptr) if vptr else None
    if vptr is None or home is None or os.path.realpath(home.path or "?") != library:
        return f"the object's virtual table is not in {os.path.basename(library)}"
    rtti = memory.word(vptr - _WORD)
    name_at = memory.word(rtti + _WORD) if rtti else None
    name = memory.c_string(name_at) if name_at else None
    if name is None or expect.encode() not in name:
        return f"the C++ class is not a {expect} trampoline (RTTI name {name!r})"
    if rtti is None or not _versioned(memory, rtti):
        return (f"the C++ class {name.decode('ascii', 'replace')} does not derive from "
                f"IVersionedInterface (an older TensorRT's layout): nothing is called")
    slots: list[int] = []
    while len(slots) < _MAX_SLOTS:
        address = memory.word(vptr + len(slots) * _WORD)
        code = memory.find(address, 1) if address else None
        if address is None or code is None or not code.executable or (
                os.path.realpath(code.path or "?") != library):
            break
        slots.append(address)
    return VTable(cpp, tuple(slots), name.decode("ascii", "replace"), library)


def _versioned(memory: _Map, rtti: int) -> bool:
    """Whether the class of the RTTI at ``rtti`` has ``IVersionedInterface`` among its bases,
    following Itanium's single-inheritance type info (``{vtable, name, base}``). A class
    without a base, or with several, ends the walk: not established."""
    for _ in range(_MAX_BASES):
        base = memory.word(rtti + 2 * _WORD)
        name_at = memory.word(base + _WORD) if base else None
        name = memory.c_string(name_at) if name_at else None
        if name is None:
            return False
        if name.endswith(_VERSIONED):
            return True
        assert base is not None  # a name was read through it
        rtti = base
    return False


def unusable(obj: object) -> str | None:
    """Why the C++ object behind the pybind11 object ``obj`` cannot be real, or ``None`` when
    it looks like one: its pointer, the virtual table it points to and that table's first
    slot are all readable memory. The words are read through ``/proc/self/mem`` (a read of
    unmapped memory fails there instead of faulting; a few microseconds), else checked
    against the memory map first (where the virtual table must also lie in a mapped file,
    its first slot in code of that file). Never raises; ``None`` too where nothing can be
    said: neither file can be read, or ``obj`` is not an instance of a class an extension
    module defines (a Python stand-in)."""
    if not any(_from_extension(cls) for cls in type(obj).__mro__):
        return None
    try:
        if type(obj).__basicsize__ < _HEAD + _WORD:
            return f"{type(obj).__qualname__} keeps no pointer after its Python header"
        cpp = ctypes.c_size_t.from_address(id(obj) + _HEAD).value  # inside obj itself
        if not cpp:
            return "no C++ object after the Python header"
        try:
            fd = os.open(_MEM, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return _unusable_by_map(cpp)
        try:
            vptr = _read(fd, cpp)
            if vptr is None:
                return f"its C++ pointer {cpp:#x} is not in readable memory"
            if not vptr or _read(fd, vptr) is None:
                return f"the C++ object at {cpp:#x} has no readable virtual table"
            return None
        finally:
            os.close(fd)
    except Exception as exc:  # noqa: BLE001 - a reading that failed says nothing
        return f"its C++ object could not be read ({type(exc).__name__}: {exc})"


def _from_extension(cls: type) -> bool:
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def _read(fd: int, address: int) -> int | None:
    """The word at ``address`` read through ``/proc/self/mem``, ``None`` if unreadable."""
    try:
        data = os.pread(fd, _WORD, address)
    except (OSError, OverflowError):
        return None
    return int.from_bytes(data, sys.byteorder) if len(data) == _WORD else None


def _unusable_by_map(cpp: int) -> str | None:
    try:
        with open(MAPS, encoding="utf-8", errors="replace") as file:
            memory = _Map(file.read())
    except OSError:
        return None
    vptr = memory.word(cpp)
    if vptr is None:
        return f"its C++ pointer {cpp:#x} is not in readable memory"
    home = memory.find(vptr)
    slot = memory.word(vptr) if home is not None else None
    code = memory.find(slot, 1) if slot else None
    if home is None or not home.path.startswith("/") or code is None or (
            not code.executable or code.path != home.path):
        return f"the C++ object at {cpp:#x} has no virtual table of a loaded library"
    return None
