"""Writing traces: one typed method per event, buffered and flushed often enough that a
killed process loses little (see :class:`TraceWriter`); the process's writer for a path
(:func:`writer_for`, for ``trace=``) and for ``GPUBUDGET_TRACE`` (:func:`writer_from_env`)."""

from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import threading
import time
import warnings
from typing import Any, Final

from ..callers import user_stacklevel
from .files import TraceBusy, open_for_writing, per_process, resolve
from .format import (
    FLUSH_EVERY,
    FLUSH_SECONDS,
    FORMAT,
    MAX_FRAMES,
    MAX_TEXT,
    VERSION,
    TraceError,
    printable,
)

__all__ = ["TraceWriter", "shortened", "writer_for", "writer_from_env"]

_MAX_INT: Final = (1 << 63) - 1
"""Largest integer the reader accepts: a refused request for more is written as this."""


def shortened(text: str) -> str:
    """``text`` if it has at most :data:`MAX_TEXT` characters, else its start and ``…``.

    >>> len(shortened("x" * 5000)), shortened("x" * 5000)[-2:], shortened("tag")
    (1024, 'x…', 'tag')
    """
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"


class TraceWriter:
    """Appends events to one trace file, in the format above; thread-safe.

    Opening takes the file as :func:`~gpubudget.tracefile.files.open_for_writing` says (no
    link followed, locked against other processes, nothing overwritten but an earlier trace
    of this user's), or raises :class:`TraceError` in one line. Each method writes one event;
    names, tags and reasons longer than :data:`MAX_TEXT` characters are shortened, and a
    refused size beyond 64 bits is written as ``2**63 - 1``, so that the reader accepts every
    line. Lines are buffered and handed to the operating system every :data:`FLUSH_EVERY`
    events, at any event that comes :data:`FLUSH_SECONDS` or more after the last flush (the
    header is flushed at once), at :meth:`flush` (a root budget's exit) and at interpreter
    exit. So a process killed outright (``SIGKILL``, the OOM killer) loses at most the last
    ``FLUSH_EVERY - 1`` events, all written within ``FLUSH_SECONDS`` of the last flush; its
    last line may be cut short, which readers skip. Errors (a full disk) propagate to the
    caller: budgets catch them, stop tracing that tree and say so in its report. In a child
    process made by ``fork``, the parent's writers write nothing (their files are the
    parent's).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = open_for_writing(path)
        self._closed: str | None = None  # why nothing more is written, once closed
        self._pending: list[str] = []
        self._frames: dict[str, int] = {}  # frame text -> its id, once its line is written
        self._next_frame = 0  # ids are never reused, even after a failed flush
        self._t0 = time.perf_counter()
        self._flushed_at = -math.inf  # so that the header is flushed at once
        header = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "pid": os.getpid(),
        }
        try:
            self._line(header, self._t0)
        except OSError as exc:
            os.close(self._fd)
            raise TraceError(f"cannot write trace file {printable(repr(path))}: "
                             f"{printable(exc.strerror or str(exc))}") from None

    def enter(self, budget: int, name: str, parent: int | None, limit: int, align: int,
              reserve: int, backend: str | None) -> None:
        """Budget ``budget`` was entered (``parent`` ``None`` for a root)."""
        self._event("enter", {"b": budget, "name": shortened(name), "parent": parent,
                              "limit": limit, "align": align, "reserve": reserve,
                              "backend": None if backend is None else shortened(str(backend))})

    def alloc(self, budget: int, size: int, align: int, tag: str | None, address: int,
              nbytes: int, stack: tuple[str, ...] | None = None) -> None:
        """``budget`` was granted ``nbytes`` (aligned) at ``address`` for ``size`` asked;
        ``stack``, outermost frame first, is written as frame ids (its innermost
        :data:`MAX_FRAMES` frames), each new frame on a ``frame`` line of its own first."""
        if tag is not None and len(tag) > MAX_TEXT:
            tag = shortened(tag)
        fields: dict[str, Any] = {"b": budget, "size": size, "align": align, "tag": tag,
                                  "ptr": address, "bytes": nbytes, "reason": None}
        if stack is None:
            self._event("alloc", fields)
            return
        now = time.perf_counter()
        record: dict[str, Any] = {"ev": "alloc", "t": round(now - self._t0, 9), **fields}
        with self._lock:  # the frames' lines and the one naming them, in this order
            if self._closed is not None:
                raise ValueError(self._closed)
            frames, pending = self._frames, self._pending
            ids = []
            for frame in stack[-MAX_FRAMES:]:
                found = frames.get(frame)
                if found is None:
                    found = frames[frame] = self._next_frame
                    self._next_frame += 1
                    pending.append(json.dumps({"ev": "frame", "id": found,
                                               "at": shortened(frame)}) + "\n")
                ids.append(found)
            record["stack"] = ids
            pending.append(json.dumps(record) + "\n")
            if len(pending) >= FLUSH_EVERY or now - self._flushed_at >= FLUSH_SECONDS:
                self._flush(now)

    def deny(self, budget: int, size: int, align: int, tag: str | None, nbytes: int,
             reason: str) -> None:
        """``budget`` refused a request of ``size`` bytes (``nbytes`` aligned) for ``reason``."""
        self._event("alloc", {"b": budget, "size": min(size, _MAX_INT), "align": align,
                              "tag": None if tag is None else shortened(tag), "ptr": None,
                              "bytes": min(nbytes, _MAX_INT), "reason": shortened(reason)})

    def free(self, budget: int, address: int) -> None:
        """The block at ``address`` of ``budget`` was freed."""
        self._event("free", {"b": budget, "ptr": address})

    def resize(self, budget: int, address: int, size: int, align: int, nbytes: int) -> None:
        """The block at ``address`` was resized in place to ``nbytes`` (aligned)."""
        self._event("resize", {"b": budget, "ptr": address, "size": size, "align": align,
                               "bytes": nbytes})

    def exit(self, budget: int) -> None:
        """``budget``'s ``with`` block ended."""
        self._event("exit", {"b": budget})

    def flush(self) -> None:
        """Hand the buffered lines to the operating system."""
        with self._lock:
            self._flush(time.perf_counter())

    def close(self) -> None:
        """Flush, then close the file (which releases its lock)."""
        with self._lock:
            if self._closed is None:
                try:
                    self._flush(time.perf_counter())
                finally:
                    self._closed = f"trace file {self.path!r} is closed"
                    os.close(self._fd)

    def forget(self, why: str) -> None:
        """In a process forked from the writing one: drop the buffered lines and write
        nothing more, saying ``why`` to whoever tries."""
        self._lock = threading.Lock()  # the parent's may have been held at the fork
        self._pending.clear()
        if self._closed is None:
            self._closed = why
            try:
                os.close(self._fd)  # this process's copy only: the parent keeps its lock
            except OSError:
                pass

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        now = time.perf_counter()
        self._line({"ev": kind, "t": round(now - self._t0, 9), **fields}, now)

    def _line(self, record: dict[str, Any], now: float) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._closed is not None:
                raise ValueError(self._closed)
            self._pending.append(line)
            if len(self._pending) >= FLUSH_EVERY or now - self._flushed_at >= FLUSH_SECONDS:
                self._flush(now)

    def _flush(self, now: float) -> None:
        """Lock held: write out the buffered lines (all of them, or an ``OSError``)."""
        if self._closed is not None or not self._pending:
            return
        data = "".join(self._pending).encode("utf-8", "surrogatepass")
        self._pending.clear()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            self._frames.clear()  # their lines may be lost: write them again, new ids
            raise
        self._flushed_at = now


_writers: dict[str, TraceWriter] = {}  # by path, for trace= and the variable alike
_from_env: dict[str, TraceWriter | str] = {}  # a variable's value: its writer, or why none
_writers_lock = threading.Lock()


def _key(path: str) -> str:
    """One name per file for the cache: directories resolved, not the file itself (a link
    there is refused, not followed)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _writer(path: str) -> TraceWriter:
    """Lock held: the process's writer for ``path`` ({pid} replaced), opened on first use."""
    key = _key(path)
    writer = _writers.get(key)
    if writer is None:
        writer = _writers[key] = TraceWriter(key)
    return writer


def writer_for(path: str | os.PathLike[str]) -> TraceWriter:
    """The process's writer for ``path`` (``{pid}`` replaced by the process id), opened on
    first use as :class:`TraceWriter` says: what ``trace=`` uses. :class:`TraceError`, in one
    line, if the file cannot be written."""
    with _writers_lock:
        return _writer(resolve(path))


def writer_from_env(value: str, variable: str) -> tuple[TraceWriter | None, str | None]:
    """The writer for a root that ``variable`` (``GPUBUDGET_TRACE``), set to ``value``, asks
    to trace, and ``None``; or ``None`` and why not, said once per value with a
    ``RuntimeWarning`` (the budgets go on untraced).

    Where another process writes the file, this process writes ``<stem>.<pid><suffix>``
    instead (:func:`~gpubudget.tracefile.files.per_process`), which the warning names.
    """
    path = resolve(value)
    with _writers_lock:
        found = _from_env.get(path)
        if found is None:
            warning: str | None
            try:
                found = _writer(path)
            except TraceBusy as busy:
                found, warning = _own_file(path, variable, busy)
            except TraceError as exc:
                found = warning = f"{variable}={printable(repr(value))}: {exc}; not traced"
            else:
                warning = None
            _from_env[path] = found
            if warning is not None:
                warnings.warn(f"gpubudget: {warning}", RuntimeWarning,
                              stacklevel=user_stacklevel())
    return (found, None) if isinstance(found, TraceWriter) else (None, found)


def _own_file(path: str, variable: str, busy: TraceBusy) -> tuple[TraceWriter | str, str]:
    """Lock held: the writer of this process's own file, when another writes ``path``; and
    what to say."""
    own = per_process(path, os.getpid())
    who = f"process {busy.pid}" if busy.pid is not None else "another process"
    try:
        writer = _writer(own)
    except TraceError as exc:
        why = (f"{variable}: {printable(repr(path))} is being written by {who}, and this "
               f"process's own file cannot be: {exc}; not traced")
        return why, why
    return writer, (f"{variable}: {printable(repr(path))} is being written by {who}; this "
                    f"process ({os.getpid()}) writes its trace to {printable(repr(own))}")


def _after_fork() -> None:
    """In a child made by ``fork``: the parent's writers are the parent's."""
    global _writers_lock
    _writers_lock = threading.Lock()
    why = f"the trace is written by process {os.getppid()}, from which this one was forked"
    for writer in _writers.values():
        writer.forget(f"{why}: {writer.path!r} is not written here")
    _writers.clear()
    _from_env.clear()


os.register_at_fork(after_in_child=_after_fork)


@atexit.register
def _close_all() -> None:
    with _writers_lock:
        for writer in _writers.values():
            try:
                writer.close()
            except OSError:  # a full disk at exit: nothing more can be done, quietly
                pass
