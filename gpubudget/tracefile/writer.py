"""Writing traces: one typed method per event, buffered and flushed often enough that a
killed process loses little (see :class:`TraceWriter`)."""

from __future__ import annotations

import atexit
import datetime
import json
import math
import os
import threading
import time
from typing import IO, Any

from .format import FLUSH_EVERY, FLUSH_SECONDS, FORMAT, VERSION, TraceError

__all__ = ["TraceWriter", "writer_for"]


class TraceWriter:
    """Appends events to one trace file, in the format above; thread-safe.

    Each method writes one event. Lines are buffered and flushed to the operating system
    every :data:`FLUSH_EVERY` events, at any event that comes :data:`FLUSH_SECONDS` or more
    after the last flush (the header is flushed at once), at :meth:`flush` (a root budget's
    exit) and at interpreter exit. So a process killed outright (``SIGKILL``, the OOM
    killer) loses at most the last ``FLUSH_EVERY - 1`` events, all written within
    ``FLUSH_SECONDS`` of the last flush; its last line may be cut short, which readers skip.
    Errors (a full disk, a closed file) propagate to the caller: budgets catch them, stop
    tracing that tree and say so in its report.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._t0 = time.perf_counter()
        self._unflushed = 0
        self._flushed_at = -math.inf  # so that the header is flushed at once
        header = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "pid": os.getpid(),
        }
        self._line(header, self._t0)

    def enter(self, budget: int, name: str, parent: int | None, limit: int, align: int,
              reserve: int, backend: str | None) -> None:
        """Budget ``budget`` was entered (``parent`` ``None`` for a root)."""
        self._event("enter", {"b": budget, "name": name, "parent": parent, "limit": limit,
                              "align": align, "reserve": reserve, "backend": backend})

    def alloc(self, budget: int, size: int, align: int, tag: str | None, address: int,
              nbytes: int) -> None:
        """``budget`` was granted ``nbytes`` (aligned) at ``address`` for ``size`` asked."""
        self._event("alloc", {"b": budget, "size": size, "align": align, "tag": tag,
                              "ptr": address, "bytes": nbytes, "reason": None})

    def deny(self, budget: int, size: int, align: int, tag: str | None, nbytes: int,
             reason: str) -> None:
        """``budget`` refused a request of ``size`` bytes (``nbytes`` aligned) for ``reason``."""
        self._event("alloc", {"b": budget, "size": size, "align": align, "tag": tag,
                              "ptr": None, "bytes": nbytes, "reason": reason})

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
        with self._lock:
            if self._file is not None:
                self._file.flush()
                self._unflushed = 0
                self._flushed_at = time.perf_counter()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                file, self._file = self._file, None
                file.close()

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        now = time.perf_counter()
        self._line({"ev": kind, "t": round(now - self._t0, 9), **fields}, now)

    def _line(self, record: dict[str, Any], now: float) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"trace file {self.path!r} is closed")
            self._file.write(line)
            self._unflushed += 1
            if self._unflushed >= FLUSH_EVERY or now - self._flushed_at >= FLUSH_SECONDS:
                self._file.flush()
                self._unflushed = 0
                self._flushed_at = now


_writers: dict[str, TraceWriter] = {}
_writers_lock = threading.Lock()


def writer_for(path: str | os.PathLike[str]) -> TraceWriter:
    """The process's writer for ``path`` (created, truncating the file, on first use)."""
    key = os.path.abspath(os.fspath(path))
    with _writers_lock:
        writer = _writers.get(key)
        if writer is None:
            try:
                writer = _writers[key] = TraceWriter(key)
            except OSError as exc:
                raise TraceError(f"cannot write trace file {os.fspath(path)!r}: {exc}") from exc
        return writer


@atexit.register
def _close_all() -> None:
    with _writers_lock:
        for writer in _writers.values():
            try:
                writer.close()
            except OSError:  # a full disk at exit: nothing more can be done, quietly
                pass
