"""Writing traces: one typed method per event, queued (:mod:`.queue`) and written by one
thread of the writers' own, often enough that a killed process loses little (see
:class:`TraceWriter`). Which writer a root budget gets, the one for its path, is
:mod:`.perpath`'s.

A writer holds its file open only while a root budget that writes to it is open (and while
it is handed out for a root about to enter): a program that gives each job its own trace
holds no descriptor for the jobs that have ended."""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Final

from ..errors import TraceError, TraceWriteError, raise_if_from_outside
from ..extensions import extension
from .files import TraceBusy, file_id, open_for_writing, reopen
from .format import FLUSH_SECONDS, FORMAT, VERSION
from .queue import TraceQueue, new_queue, shortened, wait
from ..text import printable

if TYPE_CHECKING:
    from ..door.records import DoorNumbers

__all__ = ["TraceWriter", "shortened", "writers_in_use"]

_MAX_INT: Final = (1 << 63) - 1
"""Largest integer the reader accepts: a refused request for more is written as this."""
_DOOR_LIBRARIES: Final = 64
"""Libraries a ``door`` line lists at most (the door tells 64 apart): with each name at most
:data:`~.format.MAX_TEXT` characters, the line stays below :data:`~.format.MAX_LINE_BYTES`."""


def _count(value: int) -> int:
    """A door number as the reader accepts it: within ``[0, 2**63)``."""
    return min(max(int(value), 0), _MAX_INT)


def _library_name(name: str) -> str:
    """A library's name as the reader accepts it: shortened, never blank."""
    return shortened(name) if name.strip() else "(unnamed)"


class TraceWriter:
    """Appends events to one trace file, in the format above; thread-safe.

    Opening takes the file as :func:`~gpubudget.tracefile.files.open_for_writing` says (no
    link followed, locked against other processes, nothing overwritten but an earlier trace
    of this user's), or raises :class:`TraceError` in one line. Each method writes one event;
    names, tags and reasons longer than :data:`~.format.MAX_TEXT` characters are shortened, and a
    refused size beyond 64 bits is written as ``2**63 - 1``, so that the reader accepts every
    line. Lines are queued (:mod:`.queue`: an event never waits for the file) and handed to
    the operating system by the writers' thread, at least every :data:`FLUSH_SECONDS` and
    as soon as :data:`~.format.FLUSH_BYTES` are queued; the header at once, and the rest at
    :meth:`flush` (a root budget's exit) and at interpreter exit, by the thread that asks.
    So a process killed outright (``SIGKILL``, the OOM killer) loses the events of its last
    ``FLUSH_SECONDS`` or so; its last line may be cut short, which readers skip. A queue that
    fills (the file written slower than events come) stops the trace there, counting what it
    drops on a ``lost`` line. Errors (a full disk) propagate to the caller, or, met by the
    thread, to the next event's: budgets catch them, stop tracing that tree and say so in its
    report. In a child process made by ``fork``, the parent's writers write nothing (their
    files are the parent's).

    The file is open (and locked) while a root budget that writes to it is open, from its
    ``enter`` to its ``exit``. Without one, the file is closed (its lock released)
    and a flush (events of a root's blocks freed after its exit, or at interpreter exit)
    reopens it, appends and closes it again; :meth:`resume` checks, before a new root, that
    the file is still the one written.
    """

    __slots__ = ("path", "_lock", "_fd", "_file", "_size", "_roots", "_expected", "_closed",
                 "_queue", "_t0", "__weakref__", "_lost_written")

    def __init__(self, path: str, *, continued: bool = False) -> None:
        self.path = path
        self._lock = threading.RLock()
        fd, earlier = open_for_writing(path, continued=continued)
        self._fd: int | None = fd
        info = os.fstat(fd)
        self._file = file_id(info)
        self._size = info.st_size  # bytes written: what the file holds while it is closed
        self._lost_written = 0  # dropped events a written ``lost`` line has counted
        self._roots: set[int] = set()  # root budgets open (entered and not exited)
        self._expected = True  # handed out for a root about to enter: kept open for it
        self._closed: str | None = None  # why nothing more is written, once closed
        self._t0 = time.perf_counter()
        if earlier is not None:  # this process's trace, written on: its clock goes on
            created = datetime.datetime.fromisoformat(str(earlier["created"])).timestamp()
            self._t0 -= max(time.time() - created, 0.0)
        # the lines not yet written, and the one being written (see _flush)
        self._queue: TraceQueue = new_queue(self._t0)
        _every.add(self)  # flushed at exit, forgotten in a forked child, cached or not
        _start_thread()
        if earlier is not None:
            return
        header = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "pid": os.getpid(),
        }
        try:
            self._line(header)
            with self._lock:
                self._flush()
        except OSError as exc:
            self._fd = None
            os.close(fd)
            raise_if_from_outside(exc)
            raise TraceWriteError(f"cannot write trace file {printable(repr(path))}: "
                                  f"{printable(exc.strerror or str(exc))}") from None

    @property
    def is_open(self) -> bool:
        """Whether the writer holds its file open now."""
        return self._fd is not None

    @property
    def idle(self) -> bool:
        """Whether it holds no file open, has nothing buffered and no root open: a new
        writer for its path would do as well."""
        with self._lock:
            queue = self._queue
            return (self._fd is None and not queue.pending and queue.inflight() is None
                    and not queue.stopped and not self._roots and not self._expected)

    def resume(self) -> bool:
        """Before a root budget writes here: ``True`` if the file can be appended to (it is
        open, or still the file this writer wrote), ``False`` if it was removed or replaced
        (then this writer is done with). :class:`~gpubudget.errors.TraceWriteError` (a
        :class:`TraceBusy` if another process writes it) if it cannot be written."""
        with self._lock:
            if self._closed is not None:
                return False
            if self._fd is None:
                fd = self._reopen()
                if fd is None:
                    return False
                self._fd = fd
            self._expected = True  # left open for the root about to enter (see perpath)
            return True

    def close_if_idle(self) -> None:
        """Close the file if no root budget writes to it (it is opened again when needed),
        even if it was handed out for a root that has not entered."""
        with self._lock:
            self._expected = False
            self._close_if_idle()

    # The methods below write events while a budget operation runs. An exception raised
    # into them from outside (a signal handler's, at any instruction) must not leave an
    # event written twice or half: an event's line is queued in one step, and ``_flush``
    # has the queue note what it writes before it writes.

    @property
    def events(self) -> int:
        """Entries queued so far (a frame's line is one)."""
        return self._queue.entries

    @property
    def lost(self) -> int:
        """Events dropped since the queue filled (the trace stops at the first)."""
        return self._queue.lost

    def enter(self, budget: int, name: str, parent: int | None, limit: int, align: int,
              reserve: int, backend: str | None, base: int | None = None,
              granule: int | None = None) -> None:
        """Budget ``budget`` was entered (``parent`` ``None`` for a root); a root's line says
        where its memory starts (``base``) and, for a growable root, the ``granule`` it maps
        at a time."""
        if parent is None:
            with self._lock:
                if self._closed is None and self._fd is None:  # held while the root is open
                    self._fd = self._reopened()
                self._roots.add(budget)
                self._expected = False
        fields: dict[str, Any] = {
            "b": budget, "name": shortened(name), "parent": parent, "limit": limit,
            "align": align, "reserve": reserve,
            "backend": None if backend is None else shortened(str(backend))}
        if base is not None:
            fields["base"] = base
        if granule is not None:
            fields["granule"] = granule
        self._event("enter", fields)

    def map(self, budget: int, address: int, nbytes: int) -> None:
        """Root ``budget`` (a growable one) mapped ``nbytes`` at ``address``: whole granules."""
        self._event("map", {"b": budget, "ptr": address, "bytes": nbytes})

    def unmap(self, budget: int, address: int, nbytes: int) -> None:
        """Root ``budget`` unmapped ``nbytes`` at ``address`` (a trim, or going to sleep)."""
        self._event("unmap", {"b": budget, "ptr": address, "bytes": nbytes})

    def alloc(self, budget: int, size: int, align: int, tag: str | None, address: int,
              nbytes: int, stack: tuple[str, ...] | None = None) -> None:
        """``budget`` was granted ``nbytes`` (aligned) at ``address`` for ``size`` asked;
        ``stack``, outermost frame first, is written as frame ids (its innermost
        :data:`~.format.MAX_FRAMES` frames), each new frame on a ``frame`` line of its own first."""
        if self._closed is not None:
            raise TraceWriteError(self._closed)
        self._queue.alloc(time.perf_counter(), budget, size, align, tag, address, nbytes,
                          stack)

    def deny(self, budget: int, size: int, align: int, tag: str | None, nbytes: int,
             reason: str) -> None:
        """``budget`` refused a request of ``size`` bytes (``nbytes`` aligned) for ``reason``."""
        self._event("alloc", {"b": budget, "size": min(size, _MAX_INT), "align": align,
                              "tag": None if tag is None else shortened(tag), "ptr": None,
                              "bytes": min(nbytes, _MAX_INT), "reason": shortened(reason)})

    def free(self, budget: int, address: int) -> None:
        """The block at ``address`` of ``budget`` was freed."""
        if self._closed is not None:
            raise TraceWriteError(self._closed)
        self._queue.free(time.perf_counter(), budget, address)

    def resize(self, budget: int, address: int, size: int, align: int, nbytes: int) -> None:
        """The block at ``address`` was resized in place to ``nbytes`` (aligned)."""
        self._event("resize", {"b": budget, "ptr": address, "size": size, "align": align,
                               "bytes": nbytes})

    def door_line(self, budget: int, numbers: DoorNumbers) -> str:
        """The ``door`` line of ``budget``, for :meth:`exit` to write: what the driver door
        had charged it when its ``with`` block ended (``numbers``,
        :func:`gpubudget.door.numbers`' answer). Library names are shortened as other texts
        are (a blank one written ``(unnamed)``), and at most 64 libraries are listed (all the
        door tells apart)."""
        refused = numbers.refusals > 0  # (read apart from the last one, which may be newer)
        return json.dumps({
            "ev": "door", "t": round(time.perf_counter() - self._t0, 9),
            "b": budget, "held": _count(numbers.held), "own": _count(numbers.own),
            "allocations": _count(numbers.live), "peak": _count(numbers.peak),
            "refusals": _count(numbers.refusals),
            "last_refused": _count(numbers.last_refused) if refused else 0,
            "last_refused_by": (None if numbers.last_refused_by is None or not refused
                                else _library_name(numbers.last_refused_by)),
            "libraries": [[_library_name(lib.name), _count(lib.live_bytes),
                           _count(lib.refusals)]
                          for lib in numbers.libraries[:_DOOR_LIBRARIES]],
            "attribute_only": bool(numbers.attribute_only)}) + "\n"

    def exit(self, budget: int, door_line: str = "") -> None:
        """``budget``'s ``with`` block ended; a root's last: the file is flushed and closed.
        Under the driver door, ``door_line`` (:meth:`door_line`, made before) goes just
        before, the two queued as one text, so that an exception landing here never leaves
        one without the other. (The root is forgotten before its event is queued: written
        again after an exception, the event finds it gone, and :meth:`flush` closes the
        file.)"""
        with self._lock:
            root = budget in self._roots
            self._roots.discard(budget)
            if self._closed is not None:
                raise TraceWriteError(self._closed)
            exit_line = json.dumps({"ev": "exit", "t": round(time.perf_counter() - self._t0, 9),
                                    "b": budget})
            self._queue.put(door_line + exit_line + "\n")
            if root:
                self._flush_and_close_if_idle()

    def _flush_and_close_if_idle(self) -> None:
        """Lock held: flush, then close the file if no root writes to it, even if the flush
        failed."""
        try:
            self._flush()
        finally:
            self._close_if_idle()

    def flush(self) -> None:
        """Hand the queued lines to the operating system, in the calling thread."""
        with self._lock:
            self._flush()

    def close(self) -> None:
        """Flush, then close the file (which releases its lock); nothing more is written."""
        with self._lock:
            if self._closed is None:
                try:
                    self._flush()
                finally:
                    self._closed = f"trace file {self.path!r} is closed"
                    self._queue.close()
                    self._roots.clear()
                    self._expected = False
                    self._close_if_idle()

    def _written_by_thread(self) -> None:
        """The writers' thread: write what is queued, unless another thread is writing (it
        writes it then). A failure of the file stops the trace: the next event is refused
        with it, and the budget says why in its report."""
        if self._lock.acquire(blocking=False):
            try:
                if self._closed is None:
                    self._flush()
            except (OSError, TraceError) as exc:
                raise_if_from_outside(exc)
                self._closed = (f"trace file {self.path!r} could not be written: "
                                f"{type(exc).__name__}: {exc}")
                self._queue.close()
            finally:
                self._lock.release()

    def forget(self, why: str) -> None:
        """In a process forked from the writing one: drop the buffered lines and write
        nothing more, saying ``why`` to whoever tries."""
        self._lock = threading.RLock()  # the parent's may have been held at the fork
        self._queue.clear()
        self._queue.close()
        self._roots.clear()
        if self._closed is None:
            self._closed = why
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # this process's copy only: the parent keeps its lock
            except OSError:
                pass

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        if self._closed is not None:
            raise TraceWriteError(self._closed)
        self._line({"ev": kind, "t": round(time.perf_counter() - self._t0, 9), **fields})

    def _line(self, record: dict[str, Any]) -> None:
        self._queue.put(json.dumps(record) + "\n")

    def _flush(self) -> None:
        """Lock held: write out the queued lines (all of them, or an ``OSError`` or a
        :class:`~gpubudget.errors.TraceWriteError`), reopening the file if it is closed.

        The queue notes what is being written, and where in the file, before it is written
        (``take``), and forgets it once written (``done``): a flush cut short anywhere (an
        exception raised into it from outside, even between a write and ``done``) is
        finished by the next one, which finds in the file's size how much was written. No
        line is lost, none is written twice."""
        queue = self._queue
        if self._closed is not None or (not queue.pending and queue.inflight() is None
                                        and queue.lost <= self._lost_written):
            return
        fd = self._fd
        if fd is None:
            fd = self._fd = self._reopened()
        try:
            self._settle(fd)
            lost = queue.lost  # take() counts these at least, in a lost line
            data = queue.take(self._size)
            if data is not None:
                _write_all(fd, data)
                self._size += len(data)
                queue.done()
            self._lost_written = lost
        except OSError as exc:
            if exc.errno is not None:  # the file's failure (not a signal handler's)
                queue.done()  # the trace stops: nothing left to finish
                queue.forget_frames()  # their lines may be lost: written again, new ids
            raise
        finally:
            self._close_if_idle()

    def _settle(self, fd: int) -> None:
        """Lock held, ``fd`` the file: finish the flush under way, if any, from what the file
        holds (no other process writes it: it is locked)."""
        inflight = self._queue.inflight()
        if inflight is None:
            return
        start, data = inflight
        done = os.fstat(fd).st_size - start
        if not 0 <= done <= len(data):
            raise TraceWriteError(f"trace file {self.path!r} changed while this process "
                                  f"wrote it ({done} of {len(data)} bytes): not "
                                  f"appended to")
        if done < len(data):
            _write_all(fd, data[done:])
        self._size = start + len(data)
        self._queue.done()

    def _reopened(self) -> int:
        """Lock held, the file closed: a descriptor to append to it again, or an error."""
        fd = self._reopen()
        if fd is None:
            self._closed = (f"trace file {self.path!r} was removed or replaced since this "
                            f"process wrote it")
            raise TraceWriteError(self._closed)
        return fd

    def _reopen(self) -> int | None:
        """Lock held, the file closed: :func:`~gpubudget.tracefile.files.reopen`. Where it
        is locked and this process holds a descriptor of it that no writer holds, that one
        was opened and lost (an exception raised into the writer, or into ``reopen``,
        between the open and its use) and holds the lock: it is closed, and the file opened
        again."""
        try:
            return reopen(self.path, self._file, self._size)
        except TraceBusy:
            if not _close_lost(self._file):
                raise
        return reopen(self.path, self._file, self._size)

    def _close_if_idle(self) -> None:
        """Lock held: close the file if no root budget writes to it (or is about to), and no
        flush cut short waits to be finished (see ``_flush``)."""
        if (not self._roots and not self._expected and self._fd is not None
                and self._queue.inflight() is None):
            fd, self._fd = self._fd, None
            os.close(fd)


def _close_lost(file: tuple[int, int]) -> bool:
    """Close this process's descriptors of ``file`` that no writer holds (lost: see
    ``_reopen``); whether there were any. Where ``/proc/self/fd`` cannot say, none."""
    held = {each._fd for each in list(_every)}
    closed = False
    try:
        descriptors = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError as exc:
        raise_if_from_outside(exc)
        return False
    for fd in descriptors:
        try:
            if fd not in held and file_id(os.fstat(fd)) == file:
                os.close(fd)
                closed = True
        except OSError as exc:  # closed meanwhile (the listing's own descriptor)
            raise_if_from_outside(exc)
            continue
    return closed


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` (an ``OSError`` if it cannot)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


_every: Final[weakref.WeakSet[TraceWriter]] = weakref.WeakSet()  # every writer still used
_thread: threading.Thread | None = None  # the writers' thread, once started in this process


def _start_thread() -> None:
    """Start the writers' thread if this process has none yet (a daemon: at interpreter
    exit :mod:`.perpath` closes every writer, which writes what is left)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_write_queued, name="gpubudget-trace-writer",
                                   daemon=True)
        _thread.start()


def _write_queued() -> None:
    """The writers' thread: every writer's queue written at least every
    :data:`FLUSH_SECONDS`, and as soon as one holds :data:`~.format.FLUSH_BYTES`."""
    while True:
        wait(FLUSH_SECONDS)
        for writer in list(_every):
            writer._written_by_thread()


def _forget_thread() -> None:
    global _thread
    _thread = None  # a forked child has no thread: the next writer starts one


os.register_at_fork(after_in_child=_forget_thread)
native: Final = extension("_core", "_native")
if native is not None:
    native.trace_writer(TraceWriter)  # the fast path queues a traced tree's events itself


def writers_in_use() -> list[TraceWriter]:
    """Every writer of this process not yet collected: a path's writer, or one dropped from
    :mod:`.perpath`'s table that may still have lines to write (that module closes them all
    at interpreter exit and forgets them in a child made by ``fork``)."""
    return list(_every)
