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
   gpubudget trace header (an earlier trace): anything else is left as it is.

``{pid}`` in a path (:func:`resolve`) becomes the process id, so that ``trace="run.{pid}.jsonl"``
or ``GPUBUDGET_TRACE=run.{pid}.jsonl`` gives each process its own file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from typing import Final

from .format import FORMAT, TraceError, printable

__all__ = ["PID", "TraceBusy", "open_for_writing", "per_process", "resolve"]

PID: Final = "{pid}"
"""Replaced by the process id in a trace path."""
_HEADER_BYTES: Final = 4096
"""Bytes of an existing file read to find its header (the writer's is about 100)."""


class TraceBusy(TraceError):
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


def open_for_writing(path: str) -> int:
    """A descriptor of the trace file ``path``, locked by this process, empty and at offset
    0, opened as the module docstring says; :class:`TraceError` (one line) if it cannot be.
    """
    shown = printable(repr(path))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                     | os.O_NONBLOCK, 0o666)  # non-blocking: a FIFO must not hang the open
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise TraceError(f"trace file {shown} is a symbolic link: not followed (name the "
                             f"file itself)") from None
        raise TraceError(f"cannot write trace file {shown}: {_reason(exc)}") from None
    try:
        _claim(fd, shown)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _claim(fd: int, shown: str) -> None:
    """Check the open file, lock it, and empty it if it is an earlier trace of this user's."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TraceError(f"trace file {shown} is not a regular file "
                             f"({_kind(info.st_mode)}): not written")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _header(fd).get("pid")
            pid = pid if type(pid) is int else None
            who = f"process {pid}" if pid is not None else "another process"
            raise TraceBusy(f"trace file {shown} is being written by {who}; give each process "
                            f"a file of its own (e.g. 'run.{{pid}}.jsonl')", pid) from None
        info = os.fstat(fd)  # under the lock: what it holds now
        if info.st_size:
            if info.st_uid != os.geteuid() or _header(fd).get("format") != FORMAT:
                raise TraceError(f"trace file {shown} exists and is not a gpubudget trace of "
                                 f"this user's: not overwritten (remove it or name another "
                                 f"file)")
            os.ftruncate(fd, 0)  # an earlier trace of ours
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except OSError as exc:
        raise TraceError(f"cannot write trace file {shown}: {_reason(exc)}") from None


def _header(fd: int) -> dict[str, object]:
    """The first line of the file if it is a JSON object, else ``{}``."""
    try:
        first = os.pread(fd, _HEADER_BYTES, 0).partition(b"\n")[0]
        found = json.loads(first)
    except (OSError, ValueError):
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
