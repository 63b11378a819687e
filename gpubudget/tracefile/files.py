"""Opening a trace file for writing: one process per file, no link followed, nothing
overwritten that is not an earlier trace of this user's.

A trace is often written where others write too (``/tmp``, a directory shared by the
replicas of a service), so :func:`open_for_writing` opens the path as follows, and refuses
with a one-line :class:`~gpubudget.errors.TraceError` otherwise:

1. without following a symbolic link at the last component (``O_NOFOLLOW``), creating the
   file if it is missing, and without truncating it;
2. it must be a regular file (not a FIFO, a device, a directory);
3. it takes an advisory lock on it (``flock``, exclusive, without waiting), held as long as
   the file is open: if another live process holds it, :class:`TraceBusy` says which (the
   ``pid`` of the header that process wrote);
4. a file that is not empty is truncated only if it belongs to this user and begins with a
   gpubudget trace header (an earlier trace): anything else is left as it is. A trace whose
   header names another process that still runs (and already ran when the header was
   written, so that a reused pid does not count) is that process's, even while it has the
   file closed between two root budgets: :class:`TraceBusy` too.

A writer closes its file while no root budget uses it; :func:`reopen` takes it back to
append, only if it is still the very file it wrote (same file, same size), else says why.

``{pid}`` in a path (:func:`resolve`) becomes the process id, so that ``trace="run.{pid}.jsonl"``
or ``GPUBUDGET_TRACE=run.{pid}.jsonl`` gives each process its own file.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import stat
from typing import Final

from ..errors import TraceWriteError, raise_if_from_outside
from ..text import printable
from .format import FORMAT

__all__ = ["PID", "FileId", "TraceBusy", "file_id", "open_for_writing", "per_process", "reopen",
           "resolve"]

FileId = tuple[int, int]
"""A file's identity: ``(st_dev, st_ino)``."""

PID: Final = "{pid}"
"""Replaced by the process id in a trace path."""
_HEADER_BYTES: Final = 4096
"""Bytes of an existing file read to find its header (the writer's is about 100)."""
_START_SLACK: Final = 2.0
"""Seconds by which a process's start time, as ``/proc`` gives it (boot time to the second,
clock ticks after it), may seem to follow the header it wrote."""


class TraceBusy(TraceWriteError):
    """The trace file is being written by another live process: ``pid``, if its header
    says which."""

    def __init__(self, message: str, pid: int | None) -> None:
        super().__init__(message)
        self.pid = pid


def resolve(path: str | os.PathLike[str]) -> str:
    """``path`` with each ``{pid}`` replaced by this process's id (other text unchanged).

    >>> resolve("run.{pid}.jsonl") == f"run.{os.getpid()}.jsonl"
    True
    """
    return os.fspath(path).replace(PID, str(os.getpid()))


def per_process(path: str, pid: int) -> str:
    """``path`` with ``.<pid>`` before its suffix: ``run.jsonl`` -> ``run.123.jsonl``.

    >>> per_process("/tmp/run.jsonl", 123), per_process("trace", 7)
    ('/tmp/run.123.jsonl', 'trace.7')
    """
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{pid}{suffix}"


def open_for_writing(path: str, *, continued: bool = False
                     ) -> tuple[int, dict[str, object] | None]:
    """A descriptor of the trace file ``path``, locked by this process, empty and at offset
    0, opened as the module docstring says; :class:`~gpubudget.errors.TraceWriteError` (one
    line) if it cannot be. With ``continued``, a trace that this very process wrote (its
    header names this process, written since it started) is kept, the descriptor at its
    end, and its header is returned too (else ``None``): it is written on.
    """
    shown = printable(repr(path))
    fd = _open(path, os.O_RDWR | os.O_CREAT, shown)
    try:
        earlier = _claim(fd, shown, continued)
    except BaseException:
        os.close(fd)
        raise
    return fd, earlier


def reopen(path: str, written: FileId, size: int) -> int | None:
    """A descriptor to append to ``path`` again, locked by this process: if it is still the
    file ``written`` (:func:`file_id`), of ``size`` bytes, as this process left it. ``None``
    if the file is gone or another file has its name now; :class:`TraceBusy` if another
    process writes it; :class:`~gpubudget.errors.TraceWriteError` if it changed.
    """
    shown = printable(repr(path))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK)
    except OSError as exc:
        raise_if_from_outside(exc)
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return None  # removed, or a link put in its place: not the file written
        raise TraceWriteError(f"cannot write trace file {shown}: {_reason(exc)}") from None
    try:
        info = os.fstat(fd)
        if file_id(info) != written:
            os.close(fd)
            return None
        _lock(fd, shown)
        now = os.fstat(fd).st_size
        if now != size:
            raise TraceWriteError(f"trace file {shown} changed since this process last wrote "
                                  f"it ({size} bytes, now {now}): not appended to")
        _blocking(fd)
    except OSError as exc:
        os.close(fd)
        raise_if_from_outside(exc)
        raise TraceWriteError(f"cannot write trace file {shown}: {_reason(exc)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_id(info: os.stat_result) -> FileId:
    """The identity of a file from its ``stat``."""
    return (info.st_dev, info.st_ino)


def _open(path: str, flags: int, shown: str) -> int:
    try:  # non-blocking: a FIFO must not hang the open
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        raise_if_from_outside(exc)
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise TraceWriteError(f"trace file {shown} is a symbolic link: not followed (name "
                                  f"the file itself)") from None
        raise TraceWriteError(f"cannot write trace file {shown}: {_reason(exc)}") from None


def _claim(fd: int, shown: str, continued: bool) -> dict[str, object] | None:
    """Check the open file, lock it, and empty it if it is an earlier trace of this user's;
    or, ``continued``, keep a trace of this process's and return its header."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TraceWriteError(f"trace file {shown} is not a regular file "
                                  f"({_kind(info.st_mode)}): not written")
        _lock(fd, shown)
        info = os.fstat(fd)  # under the lock: what it holds now
        if info.st_size:
            header = _header(fd)
            if info.st_uid != os.geteuid() or header.get("format") != FORMAT:
                raise TraceWriteError(f"trace file {shown} exists and is not a gpubudget trace "
                                      f"of this user's: not overwritten (remove it or name "
                                      f"another file)")
            writer = _live_writer(header)
            if writer is not None:  # closed between two roots, and still that process's
                raise _busy(shown, writer) from None
            if continued and _mine(header):
                _blocking(fd)
                os.lseek(fd, 0, os.SEEK_END)
                return header
            os.ftruncate(fd, 0)  # an earlier trace of ours
        _blocking(fd)
        return None
    except OSError as exc:
        raise_if_from_outside(exc)
        raise TraceWriteError(f"cannot write trace file {shown}: {_reason(exc)}") from None


def _lock(fd: int, shown: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _header(fd).get("pid")
        raise _busy(shown, pid if type(pid) is int else None) from None


def _busy(shown: str, pid: int | None) -> TraceBusy:
    who = f"process {pid}" if pid is not None else "another process"
    return TraceBusy(f"trace file {shown} is being written by {who}; give each process a "
                     f"file of its own (e.g. 'run.{{pid}}.jsonl')", pid)


def _blocking(fd: int) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def _live_writer(header: dict[str, object]) -> int | None:
    """The pid of the process that wrote ``header`` if it is another process that still
    runs, else ``None``. A header without its creation time is not judged (``None``)."""
    pid, written = header.get("pid"), _created(header)
    if type(pid) is not int or pid <= 0 or pid == os.getpid() or written is None:
        return None
    started = _started(pid)
    if started is None or started > written + _START_SLACK:
        return None  # ended; or its pid now belongs to a process started after the header
    return pid


def _mine(header: dict[str, object]) -> bool:
    """Whether ``header`` was written by this process (not by an earlier one that had its
    pid): it names this pid and was written since this process started."""
    created = _created(header)
    started = _started(os.getpid())
    return (header.get("pid") == os.getpid() and created is not None and started is not None
            and created + _START_SLACK >= started)


def _created(header: dict[str, object]) -> float | None:
    """When ``header`` was written (seconds since the epoch), if it says so."""
    created = header.get("created")
    if not isinstance(created, str):
        return None
    try:
        return datetime.datetime.fromisoformat(created).timestamp()
    except (ValueError, OverflowError):
        return None


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch; ``-inf`` where it runs but
    ``/proc`` cannot say when), or ``None`` if it does not run."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rpartition(b")")[2].split()
        with open("/proc/stat", "rb") as file:
            boot = next(int(line.split()[1]) for line in file if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except FileNotFoundError:
        return None if os.path.isdir("/proc") else _exists(pid)
    except (OSError, ValueError, IndexError, StopIteration) as exc:
        raise_if_from_outside(exc)
        return _exists(pid)


def _exists(pid: int) -> float | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError as exc:  # another user's
        raise_if_from_outside(exc)
    return -float("inf")


def _header(fd: int) -> dict[str, object]:
    """The first line of the file if it is a JSON object, else ``{}``."""
    try:
        first = os.pread(fd, _HEADER_BYTES, 0).partition(b"\n")[0]
        found = json.loads(first)
    except (OSError, ValueError) as exc:
        raise_if_from_outside(exc)
        return {}
    return found if isinstance(found, dict) else {}


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"  # pragma: no cover - every other kind is listed


def _reason(exc: OSError) -> str:
    return printable(exc.strerror or str(exc))

