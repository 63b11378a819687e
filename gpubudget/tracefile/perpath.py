"""The process's trace writer for a path (:func:`writer_for`, for ``trace=``) and for
``GPUBUDGET_TRACE`` (:func:`writer_from_env`): one :class:`~.writer.TraceWriter` per file,
shared by every root budget that names it; forgotten in a child made by ``fork``, closed at
interpreter exit.

The writer last handed out holds its file open for the root about to enter, until the next
is handed out. A later root that names the same path appends to the same trace (one header,
one clock), as long as the file is still the one written (see
:func:`~gpubudget.tracefile.files.reopen`); the writers of the last :data:`_IDLE_KEPT` paths
are kept, and a path named after that is written on by a new writer, which continues this
process's trace there."""

from __future__ import annotations

import os
import threading
import warnings
from typing import Final

from ..callers import user_stacklevel
from .files import TraceBusy, per_process, resolve
from .format import TraceError
from ..text import printable
from .writer import TraceWriter, writers_in_use

__all__ = ["writer_for", "writer_from_env"]


_writers: dict[str, TraceWriter] = {}  # by path, for trace= and the variable alike; LRU
_handed: list[TraceWriter] = []  # the writer last handed out, open for a root about to enter
_IDLE_KEPT: Final = 256
"""Writers kept without an open root (their files closed) for paths named again; beyond
that the least recently used are dropped, and a path named again after that is written on
by a new writer (:func:`~gpubudget.tracefile.files.open_for_writing`, ``continued``)."""
_from_env: dict[str, TraceWriter | str] = {}  # a variable's value: its writer, or why none
_writers_lock = threading.Lock()


def _key(path: str) -> str:
    """One name per file for the cache: directories resolved, not the file itself (a link
    there is refused, not followed)."""
    absolute = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(absolute)), os.path.basename(absolute))


def _writer(path: str) -> TraceWriter:
    """Lock held: the process's writer for ``path`` ({pid} replaced), opened on first use,
    and again (a new trace) if the file it wrote was removed or replaced since."""
    key = _key(path)
    writer = _writers.pop(key, None)  # put back last: the most recently used
    if writer is None or not writer.resume():
        writer = TraceWriter(key, continued=writer is None)
    _writers[key] = writer
    # Its file stays open for the root about to enter; if that root fails to enter, the
    # next call closes it: at most one descriptor is held for a root that never came.
    for earlier in _handed:
        if earlier is not writer:
            earlier.close_if_idle()
    _handed[:] = [writer]
    if len(_writers) > 2 * _IDLE_KEPT:
        _drop_idle()
    return writer


def _drop_idle() -> None:
    """Lock held: forget the least recently used writers that hold no file open and have
    nothing buffered, down to :data:`_IDLE_KEPT` writers (once there are twice as many: a
    pass over them costs little per call)."""
    for key, writer in list(_writers.items()):
        if len(_writers) <= _IDLE_KEPT:
            return
        if writer.idle:
            del _writers[key]


def writer_for(path: str | os.PathLike[str]) -> TraceWriter:
    """The process's writer for ``path`` (``{pid}`` replaced by the process id), opened on
    first use as :class:`TraceWriter` says: what ``trace=`` uses. A path named again appends
    to the same trace. :class:`~gpubudget.errors.TraceWriteError` (a :class:`TraceError` and
    a ``BudgetError``), in one line, if the file cannot be written."""
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
        if isinstance(found, TraceWriter):
            try:
                found = _writer(found.path)  # the same, or a new trace if the file went
            except TraceError:  # another process took it meanwhile: as if met first now
                found = None
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
    for writer in writers_in_use():
        writer.forget(f"{why}: {writer.path!r} is not written here")
    _writers.clear()
    _from_env.clear()
    _handed.clear()


os.register_at_fork(after_in_child=_after_fork)


def _close_all() -> None:  # at exit: gpubudget.budget registers it at import (see there)
    with _writers_lock:
        for writer in writers_in_use():  # dropped from the cache, a writer may still have lines
            try:
                writer.close()
            except (OSError, TraceError):  # a full disk, a file gone: nothing more can be done
                pass
