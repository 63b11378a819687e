"""A trace writer's lines not yet written: its queue, one per writer.

Events come from the threads that allocate; the writer's thread (:mod:`.writer`) takes what
is queued, a batch at a time, and writes it. An event is queued without waiting for
anything: the queue holds at most :data:`~.format.BUFFER_BYTES` (queued and being
written), and an event that would take it over that is dropped. So is every event after it:
a trace with a hole in it would name blocks it never showed (a free of a block whose
allocation was dropped), so it stops whole, at the first event dropped. The events dropped
are counted, and the next batch taken ends with a line saying how many::

    {"ev": "lost", "t": 12.5, "events": 1234}

``t`` is when the first was dropped; a trace may end with more than one such line (a batch
taken since, with more dropped): their counts add up. A reader says the trace stops there
(:attr:`~.reader.TraceReader.cut_short`), and how many events it lacks.

:class:`Queue` is the Python one; the C core's twin, ``TraceQueue`` (``_core/trace.c``),
holds the same bytes in one buffer, and the C core's fast path encodes granted allocations
and frees into it itself, with the tree's lock held. Each line is what ``json.dumps``
writes, times rounded to the nanosecond (the C core writes the fraction's digits; the Python
one, Python's ``repr``: the same number).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Final, Protocol

from ..extensions import extension
from .format import BUFFER_BYTES, FLUSH_BYTES, MAX_FRAMES, MAX_TEXT

native: Final = extension("_core", "_native")  # the C core, or None

__all__ = ["Queue", "TraceQueue", "new_queue", "shortened", "wait"]


def shortened(text: str) -> str:
    """``text`` if it has at most :data:`MAX_TEXT` characters, else its start and ``…``.

    >>> len(shortened("x" * 5000)), shortened("x" * 5000)[-2:], shortened("tag")
    (1024, 'x…', 'tag')
    """
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


class TraceQueue(Protocol):
    """What a writer asks of its queue (:class:`Queue`, or the C core's)."""

    @property
    def pending(self) -> int: ...
    @property
    def due(self) -> bool: ...
    @property
    def stopped(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def entries(self) -> int: ...
    @property
    def lost(self) -> int: ...

    def put(self, text: str) -> bool: ...

    def alloc(self, now: float, budget: int, size: int, align: int, tag: str | None,
              ptr: int, nbytes: int, stack: tuple[str, ...] | None = None, /) -> bool: ...

    def free(self, now: float, budget: int, ptr: int, /) -> bool: ...

    def take(self, start: int, /) -> bytes | None: ...

    def inflight(self) -> tuple[int, bytes] | None: ...

    def done(self) -> None: ...

    def forget_frames(self) -> None: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


_woken: Final = threading.Event()  # the Python queues' way to wake the writer's thread


def wait(seconds: float) -> None:
    """The writer's thread: wait until a queue holds :data:`FLUSH_BYTES` or more (then it
    wakes the thread), or ``seconds`` pass."""
    if native is not None:
        native.trace_wait(seconds)
        return
    _woken.wait(seconds)
    _woken.clear()


_Held = tuple[list[bytes], int, "tuple[int, bytes] | None", int]
"""A queue's state, replaced whole: the entries queued, their bytes, what is being written
(its offset in the file and its bytes), and the events dropped already told of on a line."""


class Queue:
    """A writer's lines not yet written (see the module docstring); thread-safe."""

    __slots__ = ("_lock", "_held", "t0", "limit", "wake", "entries", "lost", "stopped",
                 "closed", "_stopped_at", "_frames", "_next_frame")

    def __init__(self, t0: float, limit: int, wake: int) -> None:
        if limit < 1 or wake < 1:
            raise ValueError("limit and wake must be positive")
        self._lock = threading.Lock()
        self._held: _Held = ([], 0, None, 0)
        self.t0 = t0  # the trace's time 0, in time.perf_counter's seconds
        self.limit = limit
        self.wake = wake
        self.entries = 0  # entries ever queued
        self.lost = 0  # events dropped
        self.stopped = False
        self.closed = False
        self._stopped_at = 0.0
        self._frames: dict[str, int] = {}  # frame text -> its id, once its line is queued
        self._next_frame = 0  # never reused, even after forget_frames

    @property
    def pending(self) -> int:
        """Bytes queued and not yet taken."""
        return self._held[1]

    @property
    def due(self) -> bool:
        """Whether enough is queued to be written now."""
        return self._held[1] >= self.wake

    def put(self, text: str) -> bool:
        """Queue one entry (one line or more); ``False`` if it was dropped (counted)."""
        data = text.encode("utf-8", "surrogatepass")
        with self._lock:
            return self._queued(data)

    def alloc(self, now: float, budget: int, size: int, align: int, tag: str | None, ptr: int,
              nbytes: int, stack: tuple[str, ...] | None = None, /) -> bool:
        """A granted allocation's line at ``now`` (``time.perf_counter``), after a ``frame``
        line for each frame of ``stack`` (its innermost :data:`MAX_FRAMES`) not queued
        before."""
        record: dict[str, Any] = {
            "ev": "alloc", "t": round(now - self.t0, 9), "b": budget, "size": size,
            "align": align, "tag": None if tag is None else shortened(tag), "ptr": ptr,
            "bytes": nbytes, "reason": None}
        with self._lock:
            if stack is not None:
                shown = stack[-MAX_FRAMES:]
                self._frame_lines(shown)
                record["stack"] = [self._frames[frame] for frame in shown]
            return self._queued((json.dumps(record) + "\n").encode())

    def free(self, now: float, budget: int, ptr: int, /) -> bool:
        """A free's line at ``now``."""
        line = json.dumps({"ev": "free", "t": round(now - self.t0, 9), "b": budget, "ptr": ptr})
        with self._lock:
            return self._queued((line + "\n").encode())

    def _frame_lines(self, stack: tuple[str, ...]) -> None:
        """Lock held: a ``frame`` line for each frame of ``stack`` not queued yet. Each id is
        taken first and noted last: an exception in between costs an id, or queues a frame
        again under another, and never names a frame whose line is not queued."""
        frames = self._frames
        for frame in stack:
            if frame in frames:
                continue
            number = self._next_frame
            self._next_frame = number + 1
            self._queued((json.dumps({"ev": "frame", "id": number, "at": shortened(frame)})
                          + "\n").encode())
            frames[frame] = number

    def _queued(self, data: bytes) -> bool:
        """Lock held: ``data`` queued as one entry, or dropped (``False``) if the queue is
        stopped or would hold more than its limit (then it stops)."""
        entries, size, inflight, noted = self._held
        held = size + (len(inflight[1]) if inflight is not None else 0)
        if self.stopped or held + len(data) > self.limit:
            if not self.stopped:
                self._stopped_at = time.perf_counter()
                self.stopped = True
            self.lost += 1
            return False
        entries.append(data)  # the list is the truth: take() joins it whole
        self._held = (entries, size + len(data), inflight, noted)
        self.entries += 1
        if size < self.wake <= size + len(data):
            _woken.set()
        return True

    def take(self, start: int, /) -> bytes | None:
        """What is queued (and a ``lost`` line if events were dropped since the last one),
        now in flight to the file's offset ``start``; ``None`` if nothing is. What was in
        flight must be :meth:`done` first."""
        with self._lock:
            entries, _, inflight, noted = self._held
            if inflight is not None:
                raise RuntimeError("take() with bytes still in flight (done() first)")
            lost = self.lost - noted
            if not entries and not lost:
                return None
            data = b"".join(entries)
            if lost:
                data += (json.dumps({"ev": "lost", "t": round(self._stopped_at - self.t0, 9),
                                     "events": lost}) + "\n").encode()
            self._held = ([], 0, (start, data), self.lost)  # one step
            return data

    def inflight(self) -> tuple[int, bytes] | None:
        """``(offset, bytes)`` taken and not yet :meth:`done`, or ``None``."""
        return self._held[2]

    def done(self) -> None:
        """What was in flight is in the file."""
        with self._lock:
            entries, size, _, noted = self._held
            self._held = (entries, size, None, noted)

    def forget_frames(self) -> None:
        """Frames are queued again, under new ids (their lines may be lost)."""
        with self._lock:
            self._frames.clear()

    def clear(self) -> None:
        """Drop what is queued and in flight (a process forked from the writing one)."""
        self._lock = threading.Lock()  # the parent's may have been held at the fork
        self._held = ([], 0, None, self.lost)

    def close(self) -> None:
        self.closed = True


def new_queue(t0: float) -> TraceQueue:
    """A writer's queue: the C core's where it runs."""
    if native is not None:
        queue: TraceQueue = native.TraceQueue(t0, BUFFER_BYTES, FLUSH_BYTES)
        return queue
    return Queue(t0, BUFFER_BYTES, FLUSH_BYTES)
