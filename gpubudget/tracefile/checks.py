"""Checking a trace's records, one line at a time, against the format: every field's type
and range, and what spans lines (ids, parents, exits, live blocks and their owners)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Final

from .events import (Alloc, Door, Enter, Exit, Free, Header, Map, MappingEvent, Resize,
                     TraceEvent, Unmap)
from ..text import quote as _quote
from .format import FORMAT, LIMIT_REASONS, MAX_FRAMES, VERSION

__all__ = ["Bad", "Validator", "header"]

_INT_RANGE: Final = 1 << 63
_INFINITY: Final = math.inf


class Bad(Exception):
    """One line's problem, before the reader adds the file name and line number."""


class _Budget:
    """What the validator remembers of one entered budget."""

    __slots__ = ("name", "line", "root", "exited", "door", "granules")

    def __init__(self, name: str, line: int, root: int) -> None:
        self.name = name
        self.line = line
        self.root = root  # the id of its tree's root
        self.exited = 0  # the line of its exit, 0 while open
        self.door = 0  # the line of its door line, 0 while none
        self.granules: _Granules | None = None  # a growable root's


class _Granules:
    """A growable root's range, and which of its granules are mapped (``map`` lines)."""

    __slots__ = ("base", "granule", "mapped")

    def __init__(self, base: int, granule: int, span: int) -> None:
        self.base = base
        self.granule = granule
        self.mapped = bytearray(span // granule)  # 1 where mapped

    def change(self, ptr: int, nbytes: int, to: int) -> None:
        """Granules ``[ptr, ptr + nbytes)`` become mapped (``to`` 1) or unmapped (0)."""
        offset = ptr - self.base
        if offset < 0 or offset % self.granule or nbytes % self.granule:
            raise Bad(f"[{ptr:#x}, +{nbytes}) is not whole granules of {self.granule} bytes "
                      f"from the root's base {self.base:#x}")
        first, count = offset // self.granule, nbytes // self.granule
        if first + count > len(self.mapped):
            raise Bad(f"[{ptr:#x}, +{nbytes}) passes the end of the root's range "
                      f"({self.base + len(self.mapped) * self.granule:#x})")
        run = self.mapped[first: first + count]
        if run.count(1 - to) != count:
            at = first + run.index(to)
            raise Bad(f"granule at {self.base + at * self.granule:#x} is "
                      f"{'mapped' if to else 'not mapped'} already")
        self.mapped[first: first + count] = bytes([to]) * count


def _field(record: dict[str, Any], key: str) -> Any:
    try:
        return record[key]
    except KeyError:
        raise Bad(f"missing field {key!r}") from None


def _integer(record: dict[str, Any], key: str, low: int = -_INT_RANGE) -> int:
    value = _field(record, key)
    if type(value) is not int:
        raise Bad(f"{key!r} must be an integer, got {_quote(value)}")
    if not low <= value < _INT_RANGE:
        bound = f">= {low}" if low > -_INT_RANGE else "within 64 bits"
        raise Bad(f"{key!r} must be an integer {bound} and below 2**63, got {_quote(value)}")
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
        raise Bad(f"{key!r} must be {kind}, got {_quote(value)}")
    return value


def _time(record: dict[str, Any]) -> float:
    value = _field(record, "t")
    if type(value) is float:
        if value >= 0.0 and value != math.inf:  # NaN fails the first test
            return value
    elif type(value) is int and 0 <= value < _INT_RANGE:
        return float(value)
    raise Bad(f"'t' must be a finite number of seconds >= 0, got {_quote(value)}")


def _alignment(record: dict[str, Any], *, zero: bool) -> int:
    value = _integer(record, "align", 0)
    if value == 0 and zero:
        return 0
    if value <= 0 or value & (value - 1):
        allowed = "0 or a power of two" if zero else "a power of two"
        raise Bad(f"'align' must be {allowed}, got {value}")
    return value


def _libraries(record: dict[str, Any]) -> tuple[tuple[str, int, int], ...]:
    """A ``door`` line's ``libraries``: ``[name, live bytes, refusals]`` triples."""
    value = _field(record, "libraries")
    if type(value) is not list:
        raise Bad(f"'libraries' must be a list of [name, bytes, refusals], got "
                  f"{_quote(value)}")
    found = []
    for index, item in enumerate(value):
        if (type(item) is not list or len(item) != 3 or type(item[0]) is not str
                or not item[0].strip() or any(type(number) is not int
                                              or not 0 <= number < _INT_RANGE
                                              for number in item[1:])):
            raise Bad(f"'libraries'[{index}] must be [name, bytes, refusals] (a non-blank "
                      f"string and two integers >= 0 and below 2**63), got {_quote(item)}")
        found.append((item[0], item[1], item[2]))
    return tuple(found)


class Validator:
    """The rules of the module docstring that span lines: ids, parents, live blocks."""

    def __init__(self) -> None:
        self.budgets: dict[int, _Budget] = {}
        self.live: dict[int, int] = {}  # address -> the id of the budget that holds it
        self.frames: dict[int, str] = {}  # frame id -> its text (``frame`` lines)
        self.frame_lines: dict[int, int] = {}  # frame id -> the line that defined it
        self.line = 0  # the line being checked
        self.handlers: dict[str, Callable[[dict[str, Any]],
                                          TraceEvent | MappingEvent | Door | None]] = {
            "enter": self.enter, "alloc": self.alloc, "free": self.free,
            "resize": self.resize, "exit": self.exit, "frame": self.frame,
            "map": self.map, "unmap": self.unmap, "lost": self.lost_line,
            "door": self.door,
        }
        self.lost = 0  # events the writer dropped (``lost`` lines), the trace stopping there
        self.lost_at: float | None = None  # the ``t`` of the first ``lost`` line

    def known(self, record: dict[str, Any]) -> int:
        budget = _integer(record, "b", 0)
        if budget not in self.budgets:
            raise Bad(f"budget {budget} was not entered before this line")
        return budget

    def describe(self, budget: int) -> str:
        return f"budget {budget} ({_quote(self.budgets[budget].name)})"

    def enter(self, record: dict[str, Any]) -> Enter:
        t = _time(record)
        budget = _integer(record, "b", 0)
        name = _text(record, "name", optional=False)
        assert name is not None
        if not name.strip():
            raise Bad(f"'name' must not be blank, got {_quote(name)}")
        parent = _field(record, "parent")
        if parent is not None:
            parent = _integer(record, "parent", 0)
        limit = _integer(record, "limit", 1)
        align = _alignment(record, zero=False)
        reserve = _integer(record, "reserve", 0)
        backend = _text(record, "backend", optional=True)
        base = _optional_integer(record, "base", 0)
        granule = None
        if record.get("granule") is not None:
            granule = _integer(record, "granule", 1)
            if granule & (granule - 1):
                raise Bad(f"'granule' must be a power of two, got {granule}")
            if parent is not None or base is None:
                raise Bad("'granule' is for a root's line, with its 'base'")
        earlier = self.budgets.get(budget)
        if earlier is not None:
            raise Bad(f"budget id {budget} was already entered, at line {earlier.line}")
        if parent == budget:
            raise Bad(f"budget {budget} names itself as its parent")
        if parent is not None:
            above = self.budgets.get(parent)
            if above is None:
                raise Bad(f"parent {parent} was not entered before this line")
            if above.exited:
                raise Bad(f"parent {self.describe(parent)} had already exited, at line "
                           f"{above.exited}")
        root = budget if parent is None else self.budgets[parent].root
        entered = _Budget(name, self.line, root)
        event = Enter(t, budget, name, parent, limit, align, reserve, backend, base, granule)
        if granule is not None and base is not None:
            entered.granules = _Granules(base, granule, event.span)
        self.budgets[budget] = entered
        return event

    def map(self, record: dict[str, Any]) -> Map:
        t, budget, ptr, nbytes = self._mapping(record, 1)
        return Map(t, budget, ptr, nbytes)

    def unmap(self, record: dict[str, Any]) -> Unmap:
        t, budget, ptr, nbytes = self._mapping(record, 0)
        return Unmap(t, budget, ptr, nbytes)

    def _mapping(self, record: dict[str, Any], to: int) -> tuple[float, int, int, int]:
        """A ``map`` (``to`` 1) or ``unmap`` line: granules of a growable root."""
        t = _time(record)
        budget = self.known(record)
        granules = self.budgets[budget].granules
        if granules is None:
            raise Bad(f"{self.describe(budget)} is not a growable root (its line has no "
                      f"'granule')")
        ptr = _integer(record, "ptr", 0)
        nbytes = _integer(record, "bytes", 1)
        granules.change(ptr, nbytes, to)
        return t, budget, ptr, nbytes

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
                and size <= nbytes < _INT_RANGE and get("reason") is None
                and get("stack") is None):
            self.live[ptr] = budget
            return Alloc(t, budget, size, align, tag, ptr, nbytes, None)
        return self.checked_alloc(record)

    def stack(self, record: dict[str, Any]) -> tuple[str, ...] | None:
        """An allocation's ``stack``: frame ids, each defined on an earlier line."""
        ids = record.get("stack")
        if ids is None:
            return None
        if type(ids) is not list:
            raise Bad(f"'stack' must be a list of frame ids or null, got {_quote(ids)}")
        if len(ids) > MAX_FRAMES:
            raise Bad(f"'stack' has {len(ids)} frames, more than {MAX_FRAMES}")
        frames = self.frames
        for frame in ids:
            if type(frame) is not int or frame not in frames:
                if type(frame) is int:
                    raise Bad(f"'stack' names frame {frame}, which no earlier line defines")
                raise Bad(f"'stack' must hold frame ids (integers), got {_quote(frame)}")
        return tuple([frames[frame] for frame in ids])

    def frame(self, record: dict[str, Any]) -> None:
        """A ``frame`` line: defines a frame id for the ``stack`` of later allocations."""
        frame = _integer(record, "id", 0)
        text = _text(record, "at", optional=False)
        assert text is not None
        earlier = self.frame_lines.get(frame)
        if earlier is not None:
            raise Bad(f"frame id {frame} was already defined, at line {earlier}")
        self.frames[frame] = text
        self.frame_lines[frame] = self.line
        return None

    def checked_alloc(self, record: dict[str, Any]) -> Alloc:
        t = _time(record)
        budget = self.known(record)
        size = _integer(record, "size")
        align = _alignment(record, zero=True)
        tag = _text(record, "tag", optional=True)
        ptr = _field(record, "ptr")
        reason = _text(record, "reason", optional=True)
        nbytes = _optional_integer(record, "bytes", -_INT_RANGE)
        stack = self.stack(record)
        if ptr is None:
            if reason is None:
                raise Bad("a denied allocation ('ptr' null) needs a 'reason'")
            if reason in LIMIT_REASONS and size < 1:
                raise Bad(f"a request denied for {reason} needs 'size' >= 1, got {size}")
            return Alloc(t, budget, size, align, tag, None, size if nbytes is None else nbytes,
                         reason, stack)
        ptr = _integer(record, "ptr", 0)
        if reason is not None:
            raise Bad(f"a granted allocation ('ptr' {ptr:#x}) has 'reason' {_quote(reason)}")
        if size < 1:
            raise Bad(f"a granted allocation needs 'size' >= 1, got {size}")
        if nbytes is None:
            nbytes = size
        elif nbytes < size:
            raise Bad(f"'bytes' {nbytes} is less than 'size' {size}")
        holder = self.live.get(ptr)
        if holder is not None and self.budgets[holder].root == self.budgets[budget].root:
            raise Bad(f"block {ptr:#x} is handed out again while {self.describe(holder)} "
                       f"still holds it")
        # A block live in another tree: that tree was garbage-collected with the block (a
        # leak) and its memory went back, to be handed out again. It is gone.
        self.live[ptr] = budget
        return Alloc(t, budget, size, align, tag, ptr, nbytes, None, stack)

    def held(self, record: dict[str, Any], budget: int) -> int:
        ptr = _integer(record, "ptr", 0)
        holder = self.live.get(ptr)
        if holder is None:
            raise Bad(f"block {ptr:#x} is not live")
        if holder != budget:
            raise Bad(f"block {ptr:#x} is held by {self.describe(holder)}, not by "
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
            raise Bad(f"'bytes' {nbytes} is less than 'size' {size}")
        return Resize(t, budget, ptr, size, align, nbytes)

    def lost_line(self, record: dict[str, Any]) -> None:
        """A ``lost`` line: the writer's queue was full at ``t`` and dropped ``events``
        events from there on (the trace stops there; the counts of such lines add up)."""
        t = _time(record)
        self.lost += _integer(record, "events", 1)
        if self.lost_at is None:
            self.lost_at = t
        return None

    def door(self, record: dict[str, Any]) -> Door:
        """A ``door`` line: what the driver door charged a budget entered earlier, written
        before its ``exit``."""
        t = _time(record)
        budget = self.known(record)
        entry = self.budgets[budget]
        if entry.exited:
            raise Bad(f"{self.describe(budget)} already exited, at line {entry.exited}; its "
                      f"door line comes before its exit")
        if entry.door:
            raise Bad(f"{self.describe(budget)} has a door line already, at line "
                      f"{entry.door}: one per budget")
        held, own, allocations, peak, refusals, last_refused = (
            _integer(record, key, 0) for key in ("held", "own", "allocations", "peak",
                                                 "refusals", "last_refused"))
        last_refused_by = _text(record, "last_refused_by", optional=True)
        if last_refused_by is not None and not last_refused_by.strip():
            raise Bad(f"'last_refused_by' must not be blank, got {_quote(last_refused_by)}")
        if not refusals and (last_refused or last_refused_by is not None):
            raise Bad("'last_refused' and 'last_refused_by' name a refusal where 'refusals' "
                      "is 0")
        attribute_only = record.get("attribute_only", False)
        if type(attribute_only) is not bool:
            raise Bad(f"'attribute_only' must be true or false, got {_quote(attribute_only)}")
        door = Door(t, budget, held, own, allocations, peak, refusals, last_refused,
                    last_refused_by, _libraries(record), attribute_only)
        entry.door = self.line
        return door

    def exit(self, record: dict[str, Any]) -> Exit:
        t = _time(record)
        budget = self.known(record)
        entry = self.budgets[budget]
        if entry.exited:
            raise Bad(f"{self.describe(budget)} already exited, at line {entry.exited}")
        entry.exited = self.line
        return Exit(t, budget)


def header(record: dict[str, Any]) -> Header:
    if record.get("format") != FORMAT:
        raise Bad(f"not a gpubudget trace: the first line has no \"format\": \"{FORMAT}\"")
    version = record.get("version")
    if type(version) is not int or version < 1:
        raise Bad(f"bad trace version {_quote(version)}: expected an integer >= 1")
    if version > VERSION:
        raise Bad(f"trace version {version} is newer than this gpubudget reads ({VERSION}); "
                   f"upgrade gpubudget")
    created = _text(record, "created", optional=True)
    pid = _optional_integer(record, "pid", 0)
    return Header(version, created, pid)
