"""Host backend: budgets backed by real host memory, for machines without a GPU.

Each reservation is an anonymous private ``mmap`` (page-aligned, committed lazily by the
kernel), so blocks can be written and read with ``ctypes``. Streams are plain integers and
all work is complete at once.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Final

from ..errors import raise_if_from_outside
from .base import Event

if TYPE_CHECKING:  # ctypes, mmap and the virtual range load with the first reservation
    import mmap

    from .virtual import HostVirtualRange

__all__ = ["HostBackend", "HostReservation"]

_MAP_NORESERVE: Final = 0x4000 if sys.platform.startswith("linux") else 0  # not in every mmap


class HostReservation:
    """An anonymous mapping of ``nbytes`` bytes at ``address``."""

    __slots__ = ("_map", "address", "nbytes")

    def __init__(self, nbytes: int, noreserve: bool = False) -> None:
        import ctypes
        import mmap

        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if noreserve:
            flags |= getattr(mmap, "MAP_NORESERVE", _MAP_NORESERVE)
        self._map: mmap.mmap | None = mmap.mmap(-1, nbytes, flags=flags)
        anchor = ctypes.c_char.from_buffer(self._map)
        self.address: Final = ctypes.addressof(anchor)
        del anchor  # drop the buffer export so that the map can be closed
        self.nbytes: Final = nbytes

    def release(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    @property
    def released(self) -> bool:
        return self._map is None


class _DoneEvent:
    """Host work is synchronous: every event is already complete."""

    __slots__ = ()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE: Final = _DoneEvent()


class HostBackend:
    """Budgets simulated in host memory (see the module docstring).

    ``noreserve=True`` maps without reserving swap (``MAP_NORESERVE``), so that a trace
    recorded on a large GPU replays on a small machine: replay never touches the blocks.
    """

    name = "host"
    synchronous = True  # no streams: every free completes at once

    def __init__(self, noreserve: bool = False, device_capacity: int | None = None) -> None:
        self.noreserve = noreserve
        self.device_capacity = device_capacity

    def reserve(self, nbytes: int) -> HostReservation:
        try:
            return HostReservation(nbytes, self.noreserve)
        except (OSError, OverflowError, ValueError) as exc:
            raise_if_from_outside(exc)
            raise MemoryError(str(exc)) from exc

    def mem_info(self) -> tuple[int, int] | None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
        except (OSError, ValueError) as exc:  # pragma: no cover - platforms without sysconf names
            raise_if_from_outside(exc)
            return None

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        import ctypes

        ctypes.memmove(dst, src, nbytes)

    def record_event(self, stream: int) -> Event:
        return _DONE

    def allocation_granularity(self) -> int:
        """The smallest granule a growable root maps at a time: 64 KiB (a page multiple)."""
        return 64 * 1024

    def reserve_virtual(self, nbytes: int, granule: int) -> HostVirtualRange:
        """Addresses for ``nbytes`` (no memory), mapped granule by granule: see
        :mod:`gpubudget.backends.virtual`. ``device_capacity`` (``None``: the machine's)
        bounds the bytes mapped at once, as a device's memory would."""
        from .virtual import HostVirtualRange

        return HostVirtualRange(nbytes, granule, self.device_capacity)
