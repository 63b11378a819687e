"""The ``Backend`` protocol: where budgets get device memory and how streams are ordered."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Backend", "Event", "Reservation"]


class Reservation(Protocol):
    """One contiguous allocation obtained from a backend for a root budget."""

    @property
    def address(self) -> int:
        """First address of the range."""
        ...

    @property
    def nbytes(self) -> int:
        """Size of the range in bytes."""
        ...

    def release(self) -> None:
        """Return the range to its backend; a second call does nothing."""
        ...


class Event(Protocol):
    """A marker recorded on a stream: done once the work queued before it has completed."""

    def query(self) -> bool:
        """``True`` when the work queued before the event has completed (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until :meth:`query` would answer ``True``."""
        ...


@runtime_checkable
class Backend(Protocol):
    """Gets and returns device memory for root budgets.

    A backend knows nothing about budgets or TensorRT. Streams are opaque integers (a
    ``cudaStream_t`` handle on a GPU; 0 is the default stream).

    Optional attributes: ``ordinal`` (``int``), the CUDA device a backend allocates on
    (absent for memory that is not a device's); ``synchronous`` (``True``) for a backend
    whose work is always complete, so that stream-ordered frees need no event; ``clock``, a
    function giving the time in seconds for the timeline of the budgets on it (default
    ``time.perf_counter``; a trace replay gives the recorded times).
    """

    name: str

    def reserve(self, nbytes: int) -> Reservation:
        """Obtain ``nbytes`` contiguous bytes, aligned to at least 256; raise ``MemoryError``."""
        ...

    def mem_info(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes of the memory this backend draws from, if known."""
        ...

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` (device to device), complete on return."""
        ...

    def record_event(self, stream: int) -> Event:
        """Record an event on ``stream`` after the work queued on it so far."""
        ...
