"""Trace files: every event of a budget tree as JSON lines, after a versioned header.

Format, version 1. The first line is the header::

    {"format": "gpubudget-trace", "version": 1, "created": "2026-11-29T18:00:00Z", "pid": 123}

Then one object per event, ``t`` in seconds since the header, ``b`` a budget id unique in
the file:

- ``{"ev": "enter", "t", "b", "name", "parent": id | null, "limit", "align", "reserve",
  "backend"}``: a budget was entered (``parent`` null for a root);
- ``{"ev": "alloc", "t", "b", "size", "align", "tag", "ptr", "bytes", "reason"}``: an
  allocation by budget ``b``: ``ptr`` the address handed out and ``bytes`` the aligned size
  charged, or ``ptr`` null and ``reason`` why it was denied;
- ``{"ev": "free", "t", "b", "ptr"}``: the block at ``ptr`` of budget ``b`` was freed;
- ``{"ev": "resize", "t", "b", "ptr", "size", "align", "bytes"}``: the block at ``ptr`` was
  resized in place (a move is recorded as an ``alloc`` and a ``free``);
- ``{"ev": "exit", "t", "b"}``: the budget's ``with`` block ended.

Readers refuse files of a newer version. Writers are shared per path within a process, so
several root budgets (``GPUBUDGET_TRACE``) write one file with one header.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Final

from .errors import GpuBudgetError

__all__ = [
    "FLUSH_EVERY", "FORMAT", "VERSION", "TraceError", "TraceWriter", "read_trace", "writer_for"
]

FORMAT: Final = "gpubudget-trace"
VERSION: Final = 1
FLUSH_EVERY: Final = 64
"""Events a writer buffers at most before it flushes them to the file."""
_EVENTS: Final = {
    "enter": ("t", "b", "name", "parent", "limit", "align", "reserve"),
    "alloc": ("t", "b", "size", "align", "ptr"),
    "free": ("t", "b", "ptr"),
    "resize": ("t", "b", "ptr", "size", "align", "bytes"),
    "exit": ("t", "b"),
}


class TraceError(GpuBudgetError, ValueError):
    """A trace file is missing, malformed or of a newer version."""


class TraceWriter:
    """Appends events to one trace file, in the format above; thread-safe.

    Each method writes one event. Lines are buffered and flushed every
    :data:`FLUSH_EVERY` events, at :meth:`flush` (a root budget's exit) and at interpreter
    exit, so a process killed outright (``SIGKILL``, the OOM killer) loses at most the last
    ``FLUSH_EVERY - 1`` events. Errors (a full disk, a closed file) propagate to the caller:
    budgets catch them, stop tracing that tree and say so in its report.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._t0 = time.perf_counter()
        self._unflushed = 0
        header = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "pid": os.getpid(),
        }
        self._line(header)

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

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                file, self._file = self._file, None
                file.close()

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        self._line({"ev": kind, "t": round(time.perf_counter() - self._t0, 9), **fields})

    def _line(self, record: dict[str, Any]) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._file is None:
                raise ValueError(f"trace file {self.path!r} is closed")
            self._file.write(line)
            self._unflushed += 1
            if self._unflushed >= FLUSH_EVERY:
                self._file.flush()
                self._unflushed = 0


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


@dataclass(frozen=True)
class Trace:
    """A trace file's header and events, validated."""

    header: dict[str, Any]
    events: list[dict[str, Any]]


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a trace file; raise :class:`TraceError` with one clear line."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except FileNotFoundError:
        raise TraceError(f"trace file {name!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace file {name!r}: {exc}") from None
    if not lines:
        raise TraceError(f"trace file {name!r} is empty")
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{name}:{number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TraceError(f"{name}:{number}: expected a JSON object")
        records.append(record)
    header = records[0]
    if header.get("format") != FORMAT:
        raise TraceError(f"{name}: not a gpubudget trace (no '{FORMAT}' header)")
    version = header.get("version")
    if not isinstance(version, int) or version < 1:
        raise TraceError(f"{name}: bad trace version {version!r}")
    if version > VERSION:
        raise TraceError(
            f"{name}: trace version {version} is newer than this gpubudget reads "
            f"({VERSION}); upgrade gpubudget"
        )
    for number, event in enumerate(records[1:], start=2):
        required = _EVENTS.get(str(event.get("ev")))
        if required is None:
            raise TraceError(f"{name}: event {number}: unknown event {event.get('ev')!r}")
        missing = [key for key in required if key not in event]
        if missing:
            raise TraceError(f"{name}: event {number} ({event['ev']}): missing {missing}")
    return Trace(header, records[1:])
