"""Reading traces: a stream, every line checked against the format (see the package's
docstring), every problem one :class:`~gpubudget.tracefile.TraceError` naming the file and line."""

from __future__ import annotations

import json
import math
import os
import stat
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, BinaryIO, Final

from ..units import format_size
from .events import Alloc, Enter, Exit, Free, Header, Resize, TraceEvent
from .format import (
    FORMAT,
    LIMIT_REASONS,
    MAX_LINE_BYTES,
    MAX_TRACE_BYTES,
    VERSION,
    TraceError,
    _quote,
    printable,
)

__all__ = ["Trace", "TraceReader", "read_trace"]
_INT_RANGE: Final = 1 << 63
_READ_PROGRESS_EVERY: Final = 16_384
"""Lines between two calls of a reader's progress callback."""


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant)
_scan: Final = _DECODER.raw_decode  # one value from the start, and where it ends
_INFINITY: Final = math.inf


class _Bad(Exception):
    """One line's problem, before the reader adds the file name and line number."""


class _Budget:
    """What the validator remembers of one entered budget."""

    __slots__ = ("name", "line", "root", "exited")

    def __init__(self, name: str, line: int, root: int) -> None:
        self.name = name
        self.line = line
        self.root = root  # the id of its tree's root
        self.exited = 0  # the line of its exit, 0 while open


def _field(record: dict[str, Any], key: str) -> Any:
    try:
        return record[key]
    except KeyError:
        raise _Bad(f"missing field {key!r}") from None


def _integer(record: dict[str, Any], key: str, low: int = -_INT_RANGE) -> int:
    value = _field(record, key)
    if type(value) is not int:
        raise _Bad(f"{key!r} must be an integer, got {_quote(value)}")
    if not low <= value < _INT_RANGE:
        bound = f">= {low}" if low > -_INT_RANGE else "within 64 bits"
        raise _Bad(f"{key!r} must be an integer {bound} and below 2**63, got {_quote(value)}")
    return value


def _optional_integer(record: dict[str, Any], key: str, low: int) -> int | None:
    if record.get(key) is None:
        return None
    return _integer(record, key, low)


def _text(record: dict[str, Any], key: str, *, optional: bool) -> str | None:
    value = record.get(key) if optional else _field(record, key)
    if value is None and optional:
        return None
    if type(value) is not str:
        kind = "a string or null" if optional else "a string"
        raise _Bad(f"{key!r} must be {kind}, got {_quote(value)}")
    return value


def _time(record: dict[str, Any]) -> float:
    value = _field(record, "t")
    if type(value) is float:
        if value >= 0.0 and value != math.inf:  # NaN fails the first test
            return value
    elif type(value) is int and 0 <= value < _INT_RANGE:
        return float(value)
    raise _Bad(f"'t' must be a finite number of seconds >= 0, got {_quote(value)}")


def _alignment(record: dict[str, Any], *, zero: bool) -> int:
    value = _integer(record, "align", 0)
    if value == 0 and zero:
        return 0
    if value <= 0 or value & (value - 1):
        allowed = "0 or a power of two" if zero else "a power of two"
        raise _Bad(f"'align' must be {allowed}, got {value}")
    return value


class _Validator:
    """The rules of the module docstring that span lines: ids, parents, live blocks."""

    def __init__(self) -> None:
        self.budgets: dict[int, _Budget] = {}
        self.live: dict[int, int] = {}  # address -> the id of the budget that holds it
        self.line = 0  # the line being checked
        self.handlers: dict[str, Callable[[dict[str, Any]], TraceEvent]] = {
            "enter": self.enter, "alloc": self.alloc, "free": self.free,
            "resize": self.resize, "exit": self.exit,
        }

    def known(self, record: dict[str, Any]) -> int:
        budget = _integer(record, "b", 0)
        if budget not in self.budgets:
            raise _Bad(f"budget {budget} was not entered before this line")
        return budget

    def describe(self, budget: int) -> str:
        return f"budget {budget} ({_quote(self.budgets[budget].name)})"

    def enter(self, record: dict[str, Any]) -> Enter:
        t = _time(record)
        budget = _integer(record, "b", 0)
        name = _text(record, "name", optional=False)
        assert name is not None
        if not name.strip():
            raise _Bad(f"'name' must not be blank, got {_quote(name)}")
        parent = _field(record, "parent")
        if parent is not None:
            parent = _integer(record, "parent", 0)
        limit = _integer(record, "limit", 1)
        align = _alignment(record, zero=False)
        reserve = _integer(record, "reserve", 0)
        backend = _text(record, "backend", optional=True)
        earlier = self.budgets.get(budget)
        if earlier is not None:
            raise _Bad(f"budget id {budget} was already entered, at line {earlier.line}")
        if parent == budget:
            raise _Bad(f"budget {budget} names itself as its parent")
        if parent is not None:
            above = self.budgets.get(parent)
            if above is None:
                raise _Bad(f"parent {parent} was not entered before this line")
            if above.exited:
                raise _Bad(f"parent {self.describe(parent)} had already exited, at line "
                           f"{above.exited}")
        root = budget if parent is None else self.budgets[parent].root
        self.budgets[budget] = _Budget(name, self.line, root)
        return Enter(t, budget, name, parent, limit, align, reserve, backend)

    def alloc(self, record: dict[str, Any]) -> Alloc:
        """A granted allocation as the writer writes it, checked in one expression; anything
        else (a denial, a problem) goes the long way, which names what is wrong."""
        get = record.get
        t, budget, size, align, ptr, nbytes, tag = (
            get("t"), get("b"), get("size"), get("align"), get("ptr"), get("bytes"), get("tag"))
        if (type(t) is float and 0.0 <= t < _INFINITY and type(budget) is int
                and budget in self.budgets and type(size) is int and 0 < size < _INT_RANGE
                and type(align) is int and 0 <= align < _INT_RANGE and not align & (align - 1)
                and (tag is None or type(tag) is str) and type(ptr) is int
                and 0 <= ptr < _INT_RANGE and ptr not in self.live and type(nbytes) is int
                and size <= nbytes < _INT_RANGE and get("reason") is None):
            self.live[ptr] = budget
            return Alloc(t, budget, size, align, tag, ptr, nbytes, None)
        return self.checked_alloc(record)

    def checked_alloc(self, record: dict[str, Any]) -> Alloc:
        t = _time(record)
        budget = self.known(record)
        size = _integer(record, "size")
        align = _alignment(record, zero=True)
        tag = _text(record, "tag", optional=True)
        ptr = _field(record, "ptr")
        reason = _text(record, "reason", optional=True)
        nbytes = _optional_integer(record, "bytes", -_INT_RANGE)
        if ptr is None:
            if reason is None:
                raise _Bad("a denied allocation ('ptr' null) needs a 'reason'")
            if reason in LIMIT_REASONS and size < 1:
                raise _Bad(f"a request denied for {reason} needs 'size' >= 1, got {size}")
            return Alloc(t, budget, size, align, tag, None, size if nbytes is None else nbytes,
                         reason)
        ptr = _integer(record, "ptr", 0)
        if reason is not None:
            raise _Bad(f"a granted allocation ('ptr' {ptr:#x}) has 'reason' {_quote(reason)}")
        if size < 1:
            raise _Bad(f"a granted allocation needs 'size' >= 1, got {size}")
        if nbytes is None:
            nbytes = size
        elif nbytes < size:
            raise _Bad(f"'bytes' {nbytes} is less than 'size' {size}")
        holder = self.live.get(ptr)
        if holder is not None and self.budgets[holder].root == self.budgets[budget].root:
            raise _Bad(f"block {ptr:#x} is handed out again while {self.describe(holder)} "
                       f"still holds it")
        # A block live in another tree: that tree was garbage-collected with the block (a
        # leak) and its memory went back, to be handed out again. It is gone.
        self.live[ptr] = budget
        return Alloc(t, budget, size, align, tag, ptr, nbytes, None)

    def held(self, record: dict[str, Any], budget: int) -> int:
        ptr = _integer(record, "ptr", 0)
        holder = self.live.get(ptr)
        if holder is None:
            raise _Bad(f"block {ptr:#x} is not live")
        if holder != budget:
            raise _Bad(f"block {ptr:#x} is held by {self.describe(holder)}, not by "
                       f"{self.describe(budget)}")
        return ptr

    def free(self, record: dict[str, Any]) -> Free:
        get = record.get
        t, budget, ptr = get("t"), get("b"), get("ptr")
        if (type(t) is float and 0.0 <= t < _INFINITY and type(budget) is int
                and type(ptr) is int and self.live.get(ptr) == budget):
            del self.live[ptr]
            return Free(t, budget, ptr)
        return self.checked_free(record)

    def checked_free(self, record: dict[str, Any]) -> Free:
        t = _time(record)
        budget = self.known(record)
        ptr = self.held(record, budget)
        del self.live[ptr]
        return Free(t, budget, ptr)

    def resize(self, record: dict[str, Any]) -> Resize:
        t = _time(record)
        budget = self.known(record)
        ptr = self.held(record, budget)
        size = _integer(record, "size", 1)
        align = _alignment(record, zero=True)
        nbytes = _integer(record, "bytes", 1)
        if nbytes < size:
            raise _Bad(f"'bytes' {nbytes} is less than 'size' {size}")
        return Resize(t, budget, ptr, size, align, nbytes)

    def exit(self, record: dict[str, Any]) -> Exit:
        t = _time(record)
        budget = self.known(record)
        entry = self.budgets[budget]
        if entry.exited:
            raise _Bad(f"{self.describe(budget)} already exited, at line {entry.exited}")
        entry.exited = self.line
        return Exit(t, budget)


def _header(record: dict[str, Any]) -> Header:
    if record.get("format") != FORMAT:
        raise _Bad(f"not a gpubudget trace: the first line has no \"format\": \"{FORMAT}\"")
    version = record.get("version")
    if type(version) is not int or version < 1:
        raise _Bad(f"bad trace version {_quote(version)}: expected an integer >= 1")
    if version > VERSION:
        raise _Bad(f"trace version {version} is newer than this gpubudget reads ({VERSION}); "
                   f"upgrade gpubudget")
    created = _text(record, "created", optional=True)
    pid = _optional_integer(record, "pid", 0)
    return Header(version, created, pid)


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
        return open(name, "rb")  # noqa: SIM115 - closed by TraceReader.close
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
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.name = printable(os.fspath(path))
        """The file's name as given, safe to print."""
        self.max_bytes = max_bytes
        self.lines = 0
        """Lines read so far."""
        self.bytes_read = 0
        self.cut_short: str | None = None
        """Set when the last line was cut short and skipped: a sentence saying so."""
        self._progress = progress
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
            self.header = self._read_header()
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
        validator = _Validator()
        handlers = validator.handlers
        for record in self._records():
            validator.line = self.lines
            kind = record.get("ev")
            handler = handlers.get(kind) if type(kind) is str else None
            if handler is None:
                raise self._error(f"unknown event {_quote(kind)} (expected one of "
                                  f"{', '.join(handlers)})")
            try:
                event = handler(record)
            except _Bad as exc:
                raise self._error(f"{kind} event: {exc}") from None
            yield event

    def _error(self, message: str) -> TraceError:
        return TraceError(f"{self.name}:{self.lines}: {self._prefix}{message}")

    def _read_header(self) -> Header:
        self._prefix = "not a gpubudget trace: "
        for record in self._records():
            self._prefix = ""
            try:
                return _header(record)
            except _Bad as exc:
                raise self._error(str(exc)) from None
        if self.cut_short is not None:
            raise TraceError(f"{self.name}:{self.lines}: the header line is cut short (the "
                             f"writing process was killed?)")
        if self.lines == 0:
            raise TraceError(f"{self.name}: the file is empty")
        raise TraceError(f"{self.name}: no header: the file holds only blank lines")

    def _records(self) -> Iterator[dict[str, Any]]:
        """Each non-blank line as a JSON object, checked for size, encoding and syntax."""
        readline = self._file.readline
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
            if self.bytes_read > self.max_bytes:
                raise self._error(f"the trace passes the limit of "
                                  f"{format_size(self.max_bytes)}")
            if self._progress is not None and self.lines % _READ_PROGRESS_EVERY == 0:
                self._progress(self.lines, self.bytes_read)
            if len(raw) > limit:
                raise self._error(f"line longer than {format_size(limit)}")
            try:
                record = self._parse(raw)
            except _Bad as exc:
                if raw.endswith(b"\n"):
                    raise self._error(str(exc)) from None
                self.cut_short = (f"{self.name}:{self.lines}: the last line is cut short "
                                  f"(the writing process was killed?); skipped")
                return
            if record is not None:
                yield record

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any] | None:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _Bad(f"not UTF-8 text (byte {raw[exc.start]:#04x} at column "
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
            raise _Bad("JSON nested too deeply (a trace line is one flat object)") from None
        except json.JSONDecodeError as exc:
            raise _Bad(f"not JSON ({exc.msg} at column {exc.colno})") from None
        except ValueError as exc:  # a constant such as NaN, an integer of 4,300+ digits
            raise _Bad(f"not JSON this reader accepts ({printable(str(exc))[:80]})") from None
        if type(record) is not dict:
            raise _Bad(f"expected a JSON object, got {_json_kind(record)}")
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
