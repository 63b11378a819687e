"""Reading traces: a stream, every line checked against the format (see the package's
docstring), every problem one :class:`~gpubudget.tracefile.TraceError` naming the file and line."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Final

from ..units import format_size
from .checks import Bad, Validator, header
from .events import Header, TraceEvent
from .fastparse import AVAILABLE, fast_lines
from .format import (
    MAX_LINE_BYTES,
    MAX_TRACE_BYTES,
    TraceError,
)
from ..text import printable, quote as _quote

__all__ = ["PARSERS", "PARSER_ENV", "Trace", "TraceReader", "read_trace"]
_READ_PROGRESS_EVERY: Final = 16_384
"""Lines between two calls of a reader's progress callback."""
_BUFFER: Final = 1 << 20
"""Bytes a reader reads from a file at a time."""
PARSERS: Final = ("auto", "msgspec", "json")
"""What ``TraceReader(parser=...)`` takes."""
PARSER_ENV: Final = "GPUBUDGET_TRACE_PARSER"
"""Set to ``json`` to make ``parser="auto"`` use the plain path (comparisons, tests)."""


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
        ``"msgspec"``: the fast path (the ``traces`` extra, ``pip install
        'gpubudget[traces]'``; :class:`ImportError` without it); ``"json"``: the standard
        library's alone; ``"auto"`` (default): msgspec where it is installed, unless the
        environment variable ``GPUBUDGET_TRACE_PARSER`` is ``json``. Events and error
        messages are the same either way (see :mod:`gpubudget.tracefile.fastparse`).

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
        if parser == "auto":
            plain = not AVAILABLE or os.environ.get(PARSER_ENV, "").strip().lower() == "json"
            parser = "json" if plain else "msgspec"
        self.parser = parser
        """The parser that reads the lines: ``"msgspec"`` or ``"json"``."""
        self.name = printable(os.fspath(path))
        """The file's name as given, safe to print."""
        self.max_bytes = max_bytes
        self.lines = 0
        """Lines read so far."""
        self.bytes_read = 0
        self.cut_short: str | None = None
        """Set when the last line was cut short and skipped: a sentence saying so."""
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
        if self._iterated:
            raise RuntimeError(f"{self.name}: a TraceReader is read once; open another")
        self._iterated = True
        validator = Validator()
        handlers = validator.handlers
        fast = fast_lines(validator) if self.parser == "msgspec" else None
        for raw in self._raw_lines():
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
            if event is not None:  # None: a frame line, kept by the validator
                yield event

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
    """A trace file's header and events, validated and held in memory (small traces)."""

    header: Header
    events: list[TraceEvent]


def read_trace(path: str | os.PathLike[str], *, max_bytes: int = MAX_TRACE_BYTES) -> Trace:
    """Read and validate a whole trace file into memory; :class:`TraceError` with one clear
    line if it is not a valid trace. For large traces iterate a :class:`TraceReader`."""
    with TraceReader(path, max_bytes=max_bytes) as reader:
        return Trace(reader.header, list(reader))
