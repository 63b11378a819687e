"""Reading traces: a stream, every line checked against the format (see the package's
docstring), every problem one :class:`~gpubudget.tracefile.TraceError` naming the file and line."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Final, Literal, cast, overload

from ..units import format_size
from .checks import Bad, Validator, header
from .events import Door, Header, Map, MappingEvent, TraceEvent, Unmap
from .cscan import NATIVE, Sink, scanner
from .fastparse import AVAILABLE, fast_lines
from .format import (
    MAX_LINE_BYTES,
    MAX_TRACE_BYTES,
    TraceError,
)
from ..text import printable, quote as _quote

if TYPE_CHECKING:
    from ._scan import Scanner

__all__ = ["PARSERS", "PARSER_ENV", "Trace", "TraceReader", "read_trace"]
_STOP_EVENT: Final = 2
"""``Scanner.stopped`` after an event that a replay's sink handed back (see ``_scan.c``)."""
_READ_PROGRESS_EVERY: Final = 16_384
"""Lines between two calls of a reader's progress callback."""
_BUFFER: Final = 1 << 20
"""Bytes a reader reads from a file at a time."""
PARSERS: Final = ("auto", "c", "msgspec", "json")
"""What ``TraceReader(parser=...)`` takes."""
PARSER_ENV: Final = "GPUBUDGET_TRACE_PARSER"
"""Set to ``c``, ``msgspec`` or ``json`` to make ``parser="auto"`` use that path where it is
there (comparisons, tests): ``json`` is the plain path alone."""
_NEVER: Final = 1 << 62
"""A line count no trace reaches."""
_MAPPINGS: Final = (Map, Unmap)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)
_scan: Final = _DECODER.raw_decode  # one value from the start, and where it ends


def _open(path: str | os.PathLike[str], display: str) -> BinaryIO:
    """The trace as a binary stream: a regular file, or standard input for ``-``."""
    name = os.fspath(path)
    if name == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise TraceError("-: standard input is a terminal; pipe a trace into it or name "
                             "a file")
        return sys.stdin.buffer
    try:
        info = os.stat(name)
    except FileNotFoundError:
        raise TraceError(f"{display}: no such file") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{display}: cannot read: {_reason(exc)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise TraceError(f"{display}: is a directory, not a trace file")
    if not stat.S_ISREG(info.st_mode):
        raise TraceError(f"{display}: not a regular file ({_file_kind(info.st_mode)}); "
                         f"to read a stream, pipe it into '-'")
    try:
        return open(name, "rb", buffering=_BUFFER)  # noqa: SIM115 - closed by TraceReader.close
    except OSError as exc:
        raise TraceError(f"{display}: cannot read: {_reason(exc)}") from None


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a file"


def _reason(exc: BaseException) -> str:
    return printable(exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc))


class TraceReader:
    """The validated events of one trace file, read as a stream.

    Opening reads and checks the header (:attr:`header`); iterating yields each event as a
    :data:`TraceEvent` (once: the file is read as it goes). Every problem is a
    :class:`TraceError` naming the file, the line and what is wrong (see the module
    docstring for the rules). Use it as a context manager, or call :meth:`close`.

    Parameters
    ----------
    path
        A trace file, or ``"-"`` for standard input.
    max_bytes
        Refuse a trace longer than this (default :data:`MAX_TRACE_BYTES`).
    progress
        Called with ``(lines, bytes)`` read so far every 16,384 lines.
    parser
        ``"c"``: the C scanner (built with gpubudget where a C compiler was at hand;
        :class:`ImportError` without it), the standard library's :mod:`json` for the few
        lines it leaves; ``"msgspec"``: msgspec's fast path (the ``traces`` extra, ``pip install
        'gpubudget[traces]'``; :class:`ImportError` without it); ``"json"``: the standard
        library's alone; ``"auto"`` (default): the fastest of these that is there, or the
        one the environment variable ``GPUBUDGET_TRACE_PARSER`` names. Events and error
        messages are the same either way (see :mod:`gpubudget.tracefile.cscan` and
        :mod:`gpubudget.tracefile.fastparse`).

    Examples
    --------
    >>> import os, tempfile
    >>> from gpubudget import gpu_budget
    >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
    >>> with gpu_budget("1MiB", name="pool", backend="host", trace=path) as pool:
    ...     block = pool.allocate(1000)
    >>> with TraceReader(path) as reader:
    ...     [type(event).__name__ for event in reader]
    ['Enter', 'Alloc', 'Exit']
    """

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES,
                 progress: Callable[[int, int], None] | None = None,
                 parser: str = "auto") -> None:
        if parser not in PARSERS:
            raise ValueError(f"parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        if parser == "msgspec" and not AVAILABLE:
            raise ImportError("TraceReader(parser='msgspec') needs msgspec: pip install "
                              "'gpubudget[traces]'")
        if parser == "c" and not NATIVE:
            raise ImportError("TraceReader(parser='c') needs gpubudget's C scanner, built "
                              "where a C compiler is at hand (and not under GPUBUDGET_PURE=1)")
        if parser == "auto":
            parser = _auto_parser()
        self.parser = parser
        """The parser that reads the lines: ``"c"``, ``"msgspec"`` or ``"json"``."""
        self.name = printable(os.fspath(path))
        """The file's name as given, safe to print."""
        self.max_bytes = max_bytes
        self.lines = 0
        """Lines read so far."""
        self.bytes_read = 0
        self.cut_short: str | None = None
        """Set when the last line was cut short and skipped, or when the writer dropped
        events (a ``lost`` line: the trace stops there): a sentence saying so."""
        self.lost = 0
        """Events the writer dropped, its queue full (``lost`` lines: see
        :mod:`~gpubudget.tracefile.queue`)."""
        self._progress = progress
        self._next_progress = _READ_PROGRESS_EVERY
        self._prefix = ""  # what a problem on the current line means, before the message
        self._iterated = False
        self._file = _open(path, self.name)
        self._owned = os.fspath(path) != "-"
        self.size: int | None = None
        """The file's size in bytes, ``None`` for a stream."""
        try:
            if self._owned:
                self.size = os.fstat(self._file.fileno()).st_size
                if self.size > max_bytes:
                    raise TraceError(f"{self.name}: the trace is {format_size(self.size)}, "
                                     f"over the limit of {format_size(max_bytes)}")
            self.header = self._readheader()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (never standard input)."""
        if self._owned:
            self._file.close()

    def __iter__(self) -> Iterator[TraceEvent]:
        return self.events()

    @overload
    def events(self, sink: Sink | None = None, *,
               door: Literal[False] = False) -> Iterator[TraceEvent]: ...

    @overload
    def events(self, sink: Sink | None = None, *,
               door: Literal[True]) -> Iterator[TraceEvent | Door]: ...

    def events(self, sink: Sink | None = None, *,
               door: bool = False) -> Iterator[TraceEvent] | Iterator[TraceEvent | Door]:
        """The events, as iterating the reader gives them; with ``sink`` (the tables of a
        replay, see :mod:`gpubudget.replay.run`) and the C scanner, the granted allocations
        and frees that the replay can take whole are replayed into it as they are read, and
        only the other events are yielded, in order. With ``door=True``, the
        :class:`~gpubudget.tracefile.Door` events of a trace written under the driver door
        come too (left out otherwise, checked).

        >>> import os, tempfile
        >>> from gpubudget import gpu_budget
        >>> path = os.path.join(tempfile.mkdtemp(), "run.jsonl")
        >>> with gpu_budget("1MiB", name="pool", backend="host", trace=path) as pool:
        ...     pool.free(pool.allocate(4096))
        True
        >>> with TraceReader(path) as reader:
        ...     [(type(event).__name__, event.t >= 0) for event in reader.events()]
        [('Enter', True), ('Alloc', True), ('Free', True), ('Exit', True)]
        """
        if door:
            return cast("Iterator[TraceEvent | Door]", self._events(sink, False, True))
        return cast("Iterator[TraceEvent]", self._events(sink, False, False))  # none left out

    @overload
    def events_with_mappings(self, *, door: Literal[False] = False
                             ) -> Iterator[TraceEvent | MappingEvent]: ...

    @overload
    def events_with_mappings(self, *, door: Literal[True]
                             ) -> Iterator[TraceEvent | MappingEvent | Door]: ...

    def events_with_mappings(self, *, door: bool = False
                             ) -> Iterator[TraceEvent | MappingEvent | Door]:
        """The events, with the :class:`~gpubudget.tracefile.Map` and
        :class:`~gpubudget.tracefile.Unmap` events of growable roots among them (which the
        other ways of reading check and leave out: a replay maps its own memory); with
        ``door=True``, the :class:`~gpubudget.tracefile.Door` events too."""
        return self._events(None, True, door)

    def _events(self, sink: Sink | None, mappings: bool, door: bool
                ) -> Iterator[TraceEvent | MappingEvent | Door]:
        if self._iterated:
            raise RuntimeError(f"{self.name}: a TraceReader is read once; open another")
        self._iterated = True
        left_out = (() if mappings else _MAPPINGS) + (() if door else (Door,))
        validator = Validator()
        handlers = validator.handlers
        # the C scanner leaves few lines, not worth importing msgspec for
        fast = fast_lines(validator) if self.parser == "msgspec" else None
        scan = scanner(validator, sink) if self.parser == "c" else None
        peek = getattr(self._file, "peek", None)
        skip = self._skipper() if scan is not None else None
        buffered, origin = b"", 0  # what the file's buffer held, from byte ``origin`` on
        lines = self._raw_lines()
        while True:
            if scan is not None and peek is not None:
                if self.bytes_read - origin >= len(buffered):
                    buffered, origin = _peeked(peek), self.bytes_read
                if buffered:
                    assert skip is not None
                    yield from self._scanned(scan, skip, buffered, self.bytes_read - origin)
                    if scan.stopped == _STOP_EVENT:
                        continue
            raw = next(lines, None)
            if raw is None:
                return
            if fast is not None:
                found = fast(raw)
                if found is not None:
                    yield found
                    continue
            record = self._record(raw)
            if record is None:
                if self.cut_short is not None:
                    return
                continue
            validator.line = self.lines
            kind = record.get("ev")
            handler = handlers.get(kind) if type(kind) is str else None
            if handler is None:
                raise self._error(f"unknown event {_quote(kind)} (expected one of "
                                  f"{', '.join(handlers)})")
            try:
                event = handler(record)
            except Bad as exc:
                raise self._error(f"{kind} event: {exc}") from None
            if kind == "lost":
                self._lost(validator)
            if event is not None and type(event) not in left_out:
                yield event  # None: a frame line, kept by the validator

    def _lost(self, validator: Validator) -> None:
        """After a ``lost`` line: the trace stops there, :attr:`cut_short` says why."""
        self.lost = validator.lost
        self.cut_short = (f"{self.name}:{self.lines}: the trace stops at {validator.lost_at:g} s: "
                          f"the writer's queue was full (its file written slower than events "
                          f"came) and {self.lost:,} event(s) from there on were not written")

    def _scanned(self, scan: Scanner, skip: Callable[[int], object], buffered: bytes,
                 position: int) -> list[TraceEvent]:
        """The events of the lines that the C scanner takes from ``buffered`` (the file's
        buffer, the file at its byte ``position``); the file, the line and byte counts moved
        past them, even when replaying one raised."""
        stop = self._next_progress if self._progress is not None else _NEVER
        try:
            return scan.scan(buffered, position, self.lines, self.bytes_read, stop,
                             self.max_bytes)
        finally:
            taken = scan.bytes_read - self.bytes_read
            if taken:
                skip(taken)  # within the file's buffer: no system call
                self.lines, self.bytes_read = scan.lines, scan.bytes_read

    def _skipper(self) -> Callable[[int], object]:
        """Moves the file ``n`` bytes on, bytes it has buffered: a seek where the file
        seeks (nothing copied), else a read."""
        try:
            seekable = self._file.seekable()
        except (OSError, ValueError):
            seekable = False
        if not seekable:
            return self._file.read
        seek = self._file.seek
        return lambda n: seek(n, os.SEEK_CUR)

    def _error(self, message: str) -> TraceError:
        return TraceError(f"{self.name}:{self.lines}: {self._prefix}{message}")

    def _readheader(self) -> Header:
        self._prefix = "not a gpubudget trace: "
        for record in self._records():
            self._prefix = ""
            try:
                return header(record)
            except Bad as exc:
                raise self._error(str(exc)) from None
        if self.cut_short is not None:
            raise TraceError(f"{self.name}:{self.lines}: the header line is cut short (the "
                             f"writing process was killed?)")
        if self.lines == 0:
            raise TraceError(f"{self.name}: the file is empty")
        raise TraceError(f"{self.name}: no header: the file holds only blank lines")

    def _records(self) -> Iterator[dict[str, Any]]:
        """Each non-blank line as a JSON object, checked for size, encoding and syntax."""
        for raw in self._raw_lines():
            record = self._record(raw)
            if record is not None:
                yield record
            elif self.cut_short is not None:
                return

    def _record(self, raw: bytes) -> dict[str, Any] | None:
        """``raw`` as a JSON object; ``None`` for a blank line, or for a last line cut short
        (then :attr:`cut_short` says so)."""
        try:
            return self._parse(raw)
        except Bad as exc:
            if raw.endswith(b"\n"):
                raise self._error(str(exc)) from None
            self.cut_short = (f"{self.name}:{self.lines}: the last line is cut short "
                              f"(the writing process was killed?); skipped")
            return None

    def _raw_lines(self) -> Iterator[bytes]:
        """Each line but the empty ones, checked for size, counted, progress told. A run of
        empty lines is skipped a buffer at a time (a file of nothing else reads at disk
        speed)."""
        readline = self._file.readline
        peek = getattr(self._file, "peek", None)
        limit = MAX_LINE_BYTES
        while True:
            try:
                raw = readline(limit + 1)
            except OSError as exc:
                raise self._error(f"cannot read: {_reason(exc)}") from None
            if not raw:
                return
            self.lines += 1
            self.bytes_read += len(raw)
            if raw == b"\n" and peek is not None:
                self._skip_empty(peek)
            if self.bytes_read > self.max_bytes:
                raise self._error(f"the trace passes the limit of "
                                  f"{format_size(self.max_bytes)}")
            if self._progress is not None and self.lines >= self._next_progress:
                self._next_progress = (self.lines // _READ_PROGRESS_EVERY + 1) * _READ_PROGRESS_EVERY
                self._progress(self.lines, self.bytes_read)
            if len(raw) > limit:
                raise self._error(f"line longer than {format_size(limit)}")
            if raw != b"\n":
                yield raw

    def _skip_empty(self, peek: Callable[[int], bytes]) -> None:
        """After an empty line: skip the empty lines that follow, a buffer at a time, and
        count them (stops at the limit of ``max_bytes``, which the caller then refuses)."""
        while self.bytes_read <= self.max_bytes:
            try:
                buffered = peek(1)
            except OSError:
                return  # the next readline says why
            run = len(buffered) - len(buffered.lstrip(b"\n"))
            if not run:
                return
            self._file.read(run)
            self.lines += run
            self.bytes_read += run
            if run < len(buffered):
                return

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Bad(f"not UTF-8 text (byte {raw[exc.start]:#04x} at column "
                       f"{exc.start + 1})") from None
        if text.startswith("{"):  # the writer's lines: one object, then a newline
            try:
                found, end = _scan(text)
            except (ValueError, RecursionError):
                found, end = None, 0
            if type(found) is dict and (end == len(text) or text[end:].isspace()):
                return found
        if not text.strip():
            return None
        try:
            record = _DECODER.decode(text)
        except RecursionError:
            raise Bad("JSON nested too deeply (a trace line is one flat object)") from None
        except json.JSONDecodeError as exc:
            raise Bad(f"not JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:  # a constant such as NaN, an integer of 4,300+ digits
            raise Bad(f"not JSON this reader accepts ({printable(str(exc))[:80]})") from None
        if type(record) is not dict:
            raise Bad(f"expected a JSON object, got {_json_kind(record)}")
        return record


def _auto_parser() -> str:
    """The parser ``"auto"`` stands for (see :class:`TraceReader`)."""
    there = {"c": NATIVE, "msgspec": AVAILABLE, "json": True}
    asked = os.environ.get(PARSER_ENV, "").strip().lower()
    if there.get(asked):
        return asked
    return next(name for name, present in there.items() if present)


def _peeked(peek: Callable[[int], bytes]) -> bytes:
    """What the file's buffer holds (reading once if it is empty); ``b""`` at the end, or
    when reading fails (the next ``readline`` says why)."""
    try:
        return peek(1)
    except OSError:
        return b""


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else "a number"


@dataclass(frozen=True)
class Trace:
    """A trace file's header and events, validated and held in memory (small traces);
    ``door``: the :class:`~gpubudget.tracefile.Door` events of a trace written under the
    driver door, apart (``events`` holds what iterating a reader gives)."""

    header: Header
    events: list[TraceEvent]
    door: list[Door] = field(default_factory=list)


def read_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES) -> Trace:
    """Read and validate a whole trace file into memory; :class:`TraceError` with one clear
    line if it is not a valid trace. For large traces iterate a :class:`TraceReader`."""
    events: list[TraceEvent] = []
    door: list[Door] = []
    with TraceReader(path, max_bytes=max_bytes) as reader:
        for event in reader.events(door=True):
            if isinstance(event, Door):
                door.append(event)
            else:
                events.append(event)
        return Trace(reader.header, events, door)
