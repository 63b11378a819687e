"""Stream-ordered frees: blocks freed on a stream whose earlier work may still use them.

A block freed with ``free(address, stream=s)`` is reusable at once by an allocation of the
same aligned size on the same stream (work on one stream runs in order), and by anyone once
an event recorded on ``s`` at the free has completed. Until then it stays taken in the arena
and sits here. :class:`PendingFrees` keeps those blocks, oldest first, and an index by
``(stream, size)`` for same-stream reuse.

Invariant ``PENDING`` (checked by ``Budget.check()``): every pending block is taken in the
arena and absent from the live-block registry.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Final, Protocol

from ..backends import Event
from ..errors import raise_if_from_outside

__all__ = ["Pending", "PendingFrees"]


class _Freeing(Protocol):
    def free(self, address: int) -> int: ...


class Pending:
    """A block freed on ``stream``; ``event`` completes when the stream is done with it."""

    __slots__ = ("address", "nbytes", "stream", "event", "done")

    def __init__(self, address: int, nbytes: int, stream: int, event: Event) -> None:
        self.address: Final = address
        self.nbytes: Final = nbytes
        self.stream: Final = stream
        self.event: Final = event
        self.done = False  # handed out again or returned to the arena


class PendingFrees:
    """Blocks waiting for their stream; see the module docstring."""

    __slots__ = ("_fifo", "_by_key")

    def __init__(self) -> None:
        self._fifo: deque[Pending] = deque()  # oldest first; entries may be ``done``
        self._by_key: dict[tuple[int, int], list[Pending]] = {}  # (stream, nbytes) -> newest last

    def __bool__(self) -> bool:
        return bool(self._fifo)

    def __iter__(self) -> Iterator[Pending]:
        """The blocks still pending (not reused, not returned)."""
        return (pending for pending in self._fifo if not pending.done)

    def add(self, address: int, nbytes: int, stream: int, event: Event) -> None:
        pending = Pending(address, nbytes, stream, event)
        self._fifo.append(pending)
        self._by_key.setdefault((stream, nbytes), []).append(pending)

    def reuse(self, nbytes: int, alignment: int, stream: int) -> int | None:
        """A block of exactly ``nbytes`` freed on ``stream``, aligned to ``alignment``."""
        candidates = self._by_key.get((stream, nbytes))
        while candidates:
            pending = candidates.pop()
            if not pending.done and pending.address % alignment == 0:
                pending.done = True
                return pending.address
        return None

    def retire(self, arena: _Freeing, wait: bool, on_error: Callable[[str], None]) -> None:
        """Return to ``arena`` the blocks whose stream work is done, oldest first, stopping at
        the first that is not (``wait``: wait for every one). An event that fails to answer
        is reported through ``on_error`` and taken as done: a failing event means a broken
        stream or context, whose queued work will never touch the block again."""
        fifo = self._fifo
        while fifo:
            pending = fifo[0]
            if not pending.done:
                if not _finished(pending.event, wait, on_error):
                    return
                pending.done = True
                arena.free(pending.address)
            fifo.popleft()
            self._forget(pending)

    def _forget(self, pending: Pending) -> None:
        key = (pending.stream, pending.nbytes)
        same = self._by_key.get(key)
        if same is not None:
            if pending in same:
                same.remove(pending)
            if not same:
                del self._by_key[key]


def _finished(event: Event, wait: bool, on_error: Callable[[str], None]) -> bool:
    """Whether the stream is done with a pending block (``wait``: once it is). An event that
    fails (the backend's error) is reported and taken for done."""
    try:
        if wait:
            event.synchronize()
            return True
        return event.query()
    except Exception as exc:  # noqa: BLE001 - the backend's failure: reported, block not lost
        raise_if_from_outside(exc)  # still pending
        on_error(f"stream event failed, block freed: {type(exc).__name__}: {exc}")
        return True
