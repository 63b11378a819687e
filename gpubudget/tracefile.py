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

__all__ = ["FORMAT", "VERSION", "TraceError", "TraceWriter", "read_trace", "writer_for"]

FORMAT: Final = "gpubudget-trace"
VERSION: Final = 1
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
    """Appends events to one trace file; thread-safe; flushed on :meth:`flush` and at exit."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115
        self._t0 = time.perf_counter()
        header = {
            "format": FORMAT,
            "version": VERSION,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "pid": os.getpid(),
        }
        self._file.write(json.dumps(header) + "\n")

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "t": round(time.perf_counter() - self._t0, 9), **fields})
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def flush(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


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
            writer.close()


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
