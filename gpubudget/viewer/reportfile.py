"""A report written as JSON (``report().to_json()``, or ``gpubudget report --json``'s document
of every root) read back for the viewer, every field checked: one line naming the file and
the field for anything else.

A report's JSON holds what the viewer needs of each budget (its name, state, limit, reserve,
counts, peak, live blocks and children) and, written with ``timeline=True``, its event log;
``report --json`` wraps one report per root as ``{"trace", "cut_short", "after_release",
"roots": [...]}``. The page draws the first root (a note names the others). Fields the
viewer does not draw are not read.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Final

from ..errors import TraceError
from ..report import BudgetReport, DoorLibrary, DoorUsage, LiveBlock, TimelineEvent, Totals
from ..text import printable
from .model import ViewModel, model_from_report
from .sources import read_bounded

__all__ = ["ReportFileError", "looks_like_report", "model_from_report_file"]

_PEEK: Final = 4096
_INT_RANGE: Final = 2**64


class ReportFileError(TraceError):
    """A report's JSON cannot be read or is not a report; the message is one line naming the
    file and the field."""


def looks_like_report(path: str) -> bool:
    """Whether the regular file at ``path`` begins as a report's JSON does (``{`` alone on
    its first line, or ``{"name": ...`` or ``{"trace": ...``); a trace's first line is its
    header, which begins otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (OSError, ValueError):
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        first = os.read(fd, _PEEK).split(b"\n", 1)[0].strip()
    except OSError:
        return False
    finally:
        os.close(fd)
    return first == b"{" or first.startswith((b'{"name": ', b'{"trace": '))


class _Fields:
    """Typed access to the report's plain data; each failure names the file and the field."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fail(self, where: str, what: str) -> ReportFileError:
        return ReportFileError(f"{self.name}: not a gpubudget report: {where} {what}")

    def value(self, entry: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:
        if key in entry:
            return entry[key]
        if default is ...:
            raise self.fail(where, f"has no {key!r}")
        return default

    def integer(self, entry: dict[str, Any], key: str, where: str, default: Any = ...,
                signed: bool = False) -> int:
        value = self.value(entry, key, where, default)
        low = -_INT_RANGE if signed else 0
        if type(value) is not int or not low <= value < _INT_RANGE:
            raise self.fail(f"{where}[{key!r}]", f"is {_shown(value)}, not a whole number "
                                                 f"from {'-2**64' if signed else 0} to 2**64")
        return value

    def text(self, entry: dict[str, Any], key: str, where: str, default: Any = ...,
             optional: bool = False) -> Any:
        value = self.value(entry, key, where, default)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise self.fail(f"{where}[{key!r}]", f"is {_shown(value)}, not a string")
        return value

    def number(self, entry: dict[str, Any], key: str, where: str) -> float:
        value = self.value(entry, key, where)
        if type(value) not in (int, float) or not 0 <= value < 1e15:
            raise self.fail(f"{where}[{key!r}]", f"is {_shown(value)}, not a time in seconds")
        return float(value)

    def as_dict(self, value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"is {_shown(value)}, not an object")
        return value

    def as_list(self, value: object, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"is {_shown(value)}, not a list")
        return value


def _shown(value: object) -> str:
    """A short description of a JSON value, never its whole text."""
    if value is None or isinstance(value, bool):
        return repr(value).lower() if value is not None else "null"
    if isinstance(value, (int, float)):
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else "a huge number"
        return text[:40]
    if isinstance(value, str):
        return repr(printable(value[:40]))
    return "an object" if isinstance(value, dict) else "a list"


def _block(fields: _Fields, value: object, where: str) -> LiveBlock:
    entry = fields.as_dict(value, where)
    stack = fields.value(entry, "stack", where, None)
    if stack is not None:
        frames = fields.as_list(stack, f"{where}['stack']")
        if not all(isinstance(frame, str) for frame in frames):
            raise fields.fail(f"{where}['stack']", "holds something other than strings")
        stack = tuple(frames)
    return LiveBlock(fields.integer(entry, "address", where), fields.integer(entry, "size", where),
                     fields.text(entry, "tag", where, None, optional=True), stack)


def _event(fields: _Fields, value: object, where: str) -> TimelineEvent:
    entry = fields.as_dict(value, where)
    kind = fields.text(entry, "kind", where)
    if kind not in ("alloc", "free", "deny"):
        raise fields.fail(f"{where}['kind']", f"is {_shown(kind)}, not alloc, free or deny")
    return TimelineEvent(fields.number(entry, "time", where), kind,
                         fields.text(entry, "budget", where),
                         fields.integer(entry, "size", where),
                         fields.text(entry, "tag", where, None, optional=True),
                         fields.integer(entry, "used", where),
                         fields.integer(entry, "total", where))


def _door(fields: _Fields, entry: dict[str, Any], where: str) -> DoorUsage | None:
    """A budget's ``driver_door`` (a report taken under the driver door), if it has one."""
    value = entry.get("driver_door")
    if value is None:
        return None
    at = f"{where}['driver_door']"
    door = fields.as_dict(value, at)
    libraries = []
    for i, item in enumerate(fields.as_list(fields.value(door, "libraries", at, []),
                                            f"{at}['libraries']")):
        lib = fields.as_dict(item, f"{at}['libraries'][{i}]")
        here = f"{at}['libraries'][{i}]"
        libraries.append(DoorLibrary(fields.text(lib, "name", here),
                                     fields.integer(lib, "live", here, 0),
                                     fields.integer(lib, "refusals", here, 0)))
    return DoorUsage(fields.integer(door, "held", at), fields.integer(door, "peak", at, 0),
                     fields.integer(door, "allocations", at, 0),
                     fields.integer(door, "refusals", at, 0),
                     fields.integer(door, "last_refused", at, 0),
                     fields.text(door, "last_refused_by", at, None, optional=True),
                     tuple(libraries), door.get("attribute_only") is True)


def _report(fields: _Fields, data: object, where: str) -> BudgetReport:
    """The report in ``data`` and its children, built children first, without recursion."""
    made: dict[int, BudgetReport] = {}
    order: list[tuple[dict[str, Any], str, list[Any]]] = []
    todo: list[tuple[object, str]] = [(data, where)]
    seen: set[int] = set()
    while todo:
        value, at = todo.pop()
        entry = fields.as_dict(value, at)
        if id(entry) in seen:  # pragma: no cover - JSON builds no shared objects
            raise fields.fail(at, "appears twice")
        seen.add(id(entry))
        children = fields.as_list(fields.value(entry, "children", at, []), f"{at}['children']")
        order.append((entry, at, children))
        todo.extend((child, f"{at}['children'][{i}]") for i, child in enumerate(children))
    for entry, at, children in reversed(order):
        blocks = fields.as_list(fields.value(entry, "live_blocks", at, []), f"{at}['live_blocks']")
        timeline = fields.as_list(fields.value(entry, "timeline", at, []), f"{at}['timeline']")
        mapped = entry.get("mapped")
        state = fields.text(entry, "state", at)
        if state not in ("new", "open", "exited", "released"):
            raise fields.fail(f"{at}['state']", f"is {_shown(state)}, not new, open, exited "
                                                f"or released")
        made[id(entry)] = BudgetReport(
            name=fields.text(entry, "name", at), state=state, backend=None, device=None,
            limit=fields.integer(entry, "limit", at), reserve=fields.integer(entry, "reserve", at, 0),
            align=fields.integer(entry, "align", at, 256), used=fields.integer(entry, "used", at),
            peak=fields.integer(entry, "peak", at), available=0,
            allocations=fields.integer(entry, "allocations", at, 0),
            frees=fields.integer(entry, "frees", at, 0), invalid_frees=0,
            denied=fields.integer(entry, "denied", at, 0), largest_denied=0, denials=(),
            free_bytes=0, largest_free_block=0,
            live_blocks=tuple(_block(fields, b, f"{at}['live_blocks'][{i}]")
                              for i, b in enumerate(blocks)),
            peak_blocks=0, refused=0, totals=Totals(0, 0, 0, 0), usage=(), callback_errors=(),
            by_tag=(), children=tuple(made.pop(id(child)) for child in children),
            timeline=tuple(_event(fields, e, f"{at}['timeline'][{i}]")
                           for i, e in enumerate(timeline)),
            mapped=None if mapped is None else fields.integer(entry, "mapped", at),
            mapped_peak=None if entry.get("mapped_peak") is None
            else fields.integer(entry, "mapped_peak", at),
            driver_door=_door(fields, entry, at))
    return made[id(order[0][0])]


def model_from_report_file(path: str | os.PathLike[str], *, max_bytes: int,
                           title: str | None = None) -> ViewModel:
    """The viewer's model of the report (or ``report --json`` document) at ``path``;
    :class:`ReportFileError` in one line for a file that is not one.

    Examples
    --------
    >>> import os, tempfile
    >>> from gpubudget import gpu_budget
    >>> path = os.path.join(tempfile.mkdtemp(), "r.json")
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     block = pool.allocate(1000, tag="weights")
    ...     with open(path, "w") as file:
    ...         _ = file.write(pool.report().to_json(timeline=True))
    >>> model = model_from_report_file(path, max_bytes=2**20)
    >>> [b.name for b in model.budgets], list(model.block_size), model.tags
    (['pool'], [1024.0], ['weights'])
    """
    text = os.fspath(path)
    name = printable(text)
    data = read_bounded(text, max_bytes, "report", ReportFileError)
    try:
        document = json.loads(data)
    except RecursionError:
        raise ReportFileError(f"{name}: not a gpubudget report: nested too deeply to read "
                              f"(a budget tree deeper than about 400 levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        detail = " ".join(str(exc).split())[:120]
        raise ReportFileError(f"{name}: not a gpubudget report: not JSON ({detail})") from None
    fields = _Fields(name)
    document = fields.as_dict(document, "the file")
    notes: list[str] = []
    if "roots" in document:  # gpubudget report --json: one report per root
        roots = fields.as_list(document["roots"], "'roots'")
        if not roots:
            raise fields.fail("'roots'", "is empty: the trace had no root budget")
        report = _report(fields, roots[0], "roots[0]")
        if len(roots) > 1:
            others = ", ".join(printable(str(fields.as_dict(r, f"roots[{i + 1}]").get("name")))
                               for i, r in enumerate(roots[1:4]))
            notes.append(f"the report holds {len(roots)} roots; this page shows the first "
                         f"({others}{', ...' if len(roots) > 4 else ''} not shown)")
    else:
        report = _report(fields, document, "the report")
    model = model_from_report(report, title=title or os.path.basename(text))
    if not report.timeline:
        notes.append("the report was written without its timeline: the blocks are those "
                     "live when it was taken (to_json(timeline=True) keeps its events)")
    model.notes.extend(notes)
    return model
