"""``gpubudget top``: every budget of every process on the host, per device, live.

The view is the host ledger (:func:`gpubudget.hostledger.host_view`): one block per device
(its memory, cap, what the roots claimed, what is left unclaimed, what they use), one row
per root budget of a live process (pid, process, budget, limit, used, free under its limit,
peak, denials) with its child budgets indented under it as a tree (limit, used, what one
more block could still be charged to it, peak; a line says how many children the ledger had
no room to show) and, where NVML answers, the memory each process holds on the device
outside its budgets, with the processes that hold GPU memory and have no budget at all. On
a terminal it redraws every second: ``s`` changes the column roots are sorted by (a root's
children stay under it, in the order they entered), ``r`` reverses the order, ``/`` filters
roots by pid, process or the name of the root or of one of its children (type, then Enter;
Esc cancels), ``c`` clears the filter, ``q`` quits; ``--device`` keeps the devices whose UUID or
name holds some text. The view fits the terminal: header and device lines wrap, the name
columns shrink, then the least needed columns go (OUTSIDE, PROCESS, PEAK, DENIED, FREE,
LIMIT, in that order). ``--once`` prints the view once as text (as does ``top`` when its
output is not a terminal), ``--json`` once as JSON. Names come from other processes:
unprintable characters are shown escaped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from ..hostledger import DeviceView, Entry, HostView, host_view
from ..hostledger.children import ChildBudget

if TYPE_CHECKING:
    from ..door.shared import DoorShare
from ..text import printable
from ..units import format_size

__all__ = ["SORT_KEYS", "TopOptions", "render", "top_command"]

SORT_KEYS: Final = ("used", "limit", "free", "peak", "denials", "outside", "pid", "budget",
                    "process")
"""What rows may be sorted by (``--sort``, and ``s`` cycles through them)."""
_NUMERIC: Final = frozenset({"used", "limit", "free", "peak", "denials", "outside"})


@dataclass(frozen=True)
class _Column:
    title: str
    width: int
    right: bool
    keep: int
    """Columns with the smallest ``keep`` go first when the terminal is too narrow."""
    least: int = 0
    """A name column shrinks down to this before any column goes (0: it does not shrink)."""


_COLUMNS: Final = (_Column("PID", 8, True, 8), _Column("PROCESS", 24, False, 2, 10),
                   _Column("BUDGET", 20, False, 9, 10), _Column("LIMIT", 11, True, 6),
                   _Column("USED", 11, True, 7), _Column("FREE", 11, True, 5),
                   _Column("PEAK", 11, True, 3), _Column("DENIED", 7, True, 4),
                   _Column("OUTSIDE", 11, True, 1))
"""The table's columns: wide enough for ``1023.99 GiB``; on a narrow terminal the names
shrink first, then columns go, the least needed first (see :func:`_fit`)."""


@dataclass(frozen=True)
class TopOptions:
    """How ``top`` shows the view."""

    sort: str = "used"
    reverse: bool = False
    """Numbers sort largest first, names A to Z; ``reverse`` turns that around."""
    filter: str = ""
    """Only rows whose pid, process or budget contains this (any case)."""
    device: str = ""
    """Only devices whose identity (a GPU's UUID) or label (its name) contains this."""
    directory: str | None = None
    interval: float = 1.0
    idle: bool = False
    """Also devices without budgets."""


@dataclass(frozen=True)
class _Row:
    pid: int
    process: str
    budget: str
    entry: Entry | None
    outside: int | None
    children: tuple[ChildBudget, ...] = ()
    """The root's child budgets shown, depth first."""
    doors: tuple[DoorShare | None, ...] = ()
    """Under the driver door: the root's numbers there, then each child's (``None``: none)."""

    @property
    def free(self) -> int | None:
        """What the budget has left under its limit."""
        return None if self.entry is None else max(self.entry.limit - self.entry.used, 0)

    def matches(self, wanted: str) -> bool:
        """Whether ``wanted`` is in the row's pid, process or budget, or a child's name."""
        return (wanted in f"{self.pid} {self.process} {self.budget}".lower()
                or any(wanted in child.name.lower() for child in self.children))

    def lines(self) -> list[list[str] | str]:
        """The cells of the row, then of each child (indented under it), then a line saying
        how many children are hidden, if any. Under the driver door, a budget whose scope
        took memory through it, or was refused there, is followed by a line saying so (a
        string: it spans the table)."""
        doors = self.doors or (None,) * (1 + len(self.children))
        found: list[list[str] | str] = [self.cells()]
        if doors[0] is not None and _door_shown(doors[0]):
            found.append(_door_text(doors[0], ""))
        for child, branch, door in zip(self.children, _branches(self.children), doors[1:]):
            found.append(["", "", branch + child.name, _size(child.limit), _size(child.used),
                          _size(child.free), _size(child.peak), "-", ""])
            if door is not None and _door_shown(door):
                found.append(_door_text(door, branch.replace("├", "│").replace("└", " ")))
        hidden = self.entry.hidden if self.entry is not None else 0
        if hidden:
            found.append(["", "", f"… {hidden} hidden", "", "", "", "", "", ""])
        return found

    def key(self, sort: str) -> Any:
        entry = self.entry
        free = self.free
        values: dict[str, Any] = {
            "used": entry.used if entry else -1, "limit": entry.limit if entry else -1,
            "free": free if free is not None else -1,
            "peak": entry.peak if entry else -1, "denials": entry.denials if entry else -1,
            "outside": self.outside if self.outside is not None else -1, "pid": self.pid,
            "budget": self.budget.lower(), "process": self.process.lower()}
        return values[sort]

    def cells(self) -> list[str]:
        entry = self.entry
        return [str(self.pid), self.process, self.budget,
                _size(entry.limit if entry else None), _size(entry.used if entry else None),
                _size(self.free), _size(entry.peak if entry else None),
                str(entry.denials) if entry else "-", _size(self.outside)]


def _door_shown(door: DoorShare) -> bool:
    return bool(door.held or door.refusals or door.libraries)


def _door_text(door: DoorShare, indent: str) -> str:
    """A budget's driver-door line: what libraries took through the door in its scope, its
    own allocations by library, and its refusals with the library that asked last."""
    text = f"{indent}  ↳ driver door {format_size(door.held)}"
    holding = [lib for lib in door.libraries if lib.live]
    if holding:
        text += ": " + ", ".join(f"{lib.name} {format_size(lib.live)}" for lib in holding[:4])
        text += ", …" if len(holding) > 4 else ""
    if door.refusals:
        text += (f" · {door.refusals} refused, the last {format_size(door.last_refused)} "
                 f"asked by {door.last_refused_by or 'an unknown library'}")
    if door.attribute_only:
        text += " · attribute only"
    return text


def _branches(children: tuple[ChildBudget, ...]) -> list[str]:
    """The tree drawn before each child's name (children depth first, each with its
    depth): ``├ `` or ``└ `` (its last sibling), after ``│ `` or blanks for each ancestor
    below the root that has siblings after it."""
    last = []
    for index, child in enumerate(children):
        after = next((other.depth for other in children[index + 1:]
                      if other.depth <= child.depth), 0)
        last.append(after < child.depth)
    drawn: list[str] = []
    open_levels: list[bool] = []  # open_levels[d]: whether depth d + 1 has siblings to come
    for child, final in zip(children, last):
        del open_levels[child.depth - 1:]
        drawn.append("".join("│ " if more else "  " for more in open_levels)
                     + ("└ " if final else "├ "))
        open_levels.append(not final)
    return drawn


def _rows(device: DeviceView, options: TopOptions) -> list[_Row]:
    rows = [_Row(entry.pid, entry.process, entry.name, entry, device.outside(entry.pid),
                 device.children_of(entry),
                 (device.door_of(entry),
                  *(device.door_of(entry, child) for child in device.children_of(entry))))
            for entry in device.entries]
    budgeted = {entry.pid for entry in device.entries}
    rows += [_Row(pid, "?", "(no budget)", None, device.outside(pid))
             for pid in device.pids if pid not in budgeted]
    wanted = options.filter.lower()
    if wanted:  # rows only: a device's name would match all of its rows
        rows = [row for row in rows if row.matches(wanted)]
    rows.sort(key=lambda row: (row.pid, row.budget))  # ties stay in this order
    rows.sort(key=lambda row: row.key(options.sort),
              reverse=(options.sort in _NUMERIC) != options.reverse)
    return rows


def _size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def _cell(text: str, width: int, right: bool) -> str:
    text = printable(text)
    if len(text) > width:
        text = text[: width - 1] + "…"
    return text.rjust(width) if right else text.ljust(width)


def _fit(width: int | None) -> list[_Column]:
    """The columns that fit in ``width`` characters (all for ``None``): names shrink to their
    least first, then the least needed columns go, PID, BUDGET and USED last."""
    columns = list(_COLUMNS)
    if width is None:
        return columns

    def total() -> int:
        return sum(column.width for column in columns) + len(columns) - 1

    for index, column in enumerate(columns):  # names shrink first
        if column.least and total() > width:
            columns[index] = replace(column, width=max(column.least,
                                                       column.width - (total() - width)))
    for column in sorted(columns, key=lambda c: c.keep):
        if total() <= width or len(columns) <= 3:
            break
        columns.remove(column)
    for title in ("BUDGET", "PROCESS"):  # room left: the names take it back
        for index, column in enumerate(columns):
            full = next(c.width for c in _COLUMNS if c.title == title)
            if column.title == title and total() < width:
                columns[index] = replace(column, width=min(full, column.width + width - total()))
    return columns


def _line(cells: list[str], columns: list[_Column]) -> str:
    """A row's cells in the columns shown."""
    shown = {column.title: column for column in columns}
    return " ".join(_cell(text, shown[column.title].width, column.right)
                    for text, column in zip(cells, _COLUMNS) if column.title in shown).rstrip()


def _spanning(text: str, columns: list[_Column], width: int | None) -> str:
    """A line that spans the table, starting under the BUDGET column, cut to ``width``."""
    start = 0
    for column in columns:
        if column.title == "BUDGET":
            break
        start += column.width + 1
    line = " " * start + printable(text)
    if width is not None and len(line) > width:
        line = line[: width - 1] + "…"
    return line


def _wrapped(parts: list[str], width: int | None) -> list[str]:
    """``parts`` joined by `` · `` on as few lines as ``width`` allows."""
    if width is not None:  # a part longer than a line (a long directory) is cut
        parts = [part if len(part) <= width - 2 else part[: width - 3] + "…" for part in parts]
    lines = [parts[0]]
    for part in parts[1:]:
        if width is not None and len(lines[-1]) + 3 + len(part) > width:
            lines.append("  " + part)
        else:
            lines[-1] += " · " + part
    return lines


def _device_lines(device: DeviceView, width: int | None) -> list[str]:
    processes = len({entry.pid for entry in device.entries})
    named = device.label if device.identity in device.label else (
        f"{device.identity} {device.label}")
    parts = [printable(named), f"{format_size(device.total)}"]
    if device.cap is not None:
        parts.append(f"cap {format_size(device.cap)}")
    if device.limit is not None:  # set from outside: MPS, HAMi, the cgroup's dmem.max, NVML
        parts.append(f"limit {format_size(device.limit)} ({printable(device.limited_by)})")
    parts.append(f"claimed {format_size(device.claimed)}")
    budgets = len(device.entries)
    parts.append(f"{budgets} budget{'s' * (budgets != 1)} in {processes} "
                 f"process{'es' * (processes != 1)}")
    room = min(value for value in (device.cap, device.limit, device.total)
               if value is not None) - device.claimed
    parts.append(f"unclaimed {format_size(max(room, 0))}")
    parts.append(f"used {format_size(device.used)}")
    if device.hidden:
        parts.append(f"{device.hidden} child budget{'s' * (device.hidden != 1)} hidden "
                     f"(no room in the ledger)")
    if device.ended:
        parts.append(f"{device.ended} ended not yet cleared")
    return _wrapped(parts, width)


def render(view: HostView, options: TopOptions = TopOptions(), width: int | None = None
           ) -> list[str]:
    """The text of the view, one string per line (what ``--once`` prints and the live view
    draws), fitted to ``width`` characters when given (a terminal's): header and device lines
    wrap, the table's names shrink and its least needed columns go.

    >>> import tempfile
    >>> render(host_view(tempfile.mkdtemp(), nvml=False))[-1]
    'no budgets registered on this host'
    """
    order = f"{options.sort} {'▲' if (options.sort in _NUMERIC) == options.reverse else '▼'}"
    parts = ["gpubudget top", f"{view.taken_at.astimezone():%Y-%m-%d %H:%M:%S}",
             printable(view.directory), f"sort {order}"]
    if options.filter:
        parts.append(f"filter {printable(options.filter)!r}")
    if options.device:
        parts.append(f"device {printable(options.device)!r}")
    if view.nvml_error is not None:
        parts.append("outside: -, no NVML")
    lines = _wrapped(parts, width)
    columns = _fit(width)
    shown = 0
    wanted = options.device.lower()
    for device in view.devices:
        if wanted and wanted not in f"{device.identity} {device.label}".lower():
            continue
        rows = _rows(device, options)
        if not rows and (options.filter or not options.idle):
            continue
        lines += ["", *_device_lines(device, width),
                  _line([column.title for column in _COLUMNS], columns)]
        for row in rows:
            lines.extend(_line(cells, columns) if isinstance(cells, list)
                         else _spanning(cells, columns, width) for cells in row.lines())
            shown += 1
    if not shown:
        lines += ["", "no budgets registered on this host"
                  if not (options.filter or options.device) else "no budget matches the filter"]
    return lines


def top_command(options: TopOptions, *, once: bool, as_json: bool) -> int:
    """Run ``gpubudget top``; return the exit status (errors propagate to the command
    line, which prints one line and exits 2)."""
    if as_json:
        print(json.dumps(host_view(options.directory, idle=options.idle).as_dict(), indent=2))
        return 0
    if once or not _terminal():
        width = shutil.get_terminal_size().columns if _terminal(stdin=False) else None
        print("\n".join(render(host_view(options.directory, idle=options.idle), options,
                               width)))
        return 0
    import curses

    def read() -> HostView:
        return host_view(options.directory, idle=options.idle)

    first = read()  # a bad ledger is said before the terminal is taken over
    for stale in ("LINES", "COLUMNS"):  # curses would take them over the terminal's own size
        os.environ.pop(stale, None)
    result: int = curses.wrapper(lambda screen: _live(screen, options, read, first))
    return result


def _terminal(*, stdin: bool = True) -> bool:
    """Whether standard output (and input, with ``stdin``) are a terminal: the live view can
    take it over, and ``--once`` fits its width."""
    try:
        return (not stdin or sys.stdin.isatty()) and sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def _live(screen: Any, options: TopOptions, read: Callable[[], HostView], view: HostView
          ) -> int:
    """The live view: redraw every ``interval`` seconds, answer keys in between."""
    import curses

    try:
        curses.curs_set(0)
    except curses.error:
        pass
    screen.timeout(100)
    typing: str | None = None  # the filter being typed, after '/'
    refreshed = time.monotonic()
    while True:
        shown = replace(options, filter=typing) if typing is not None else options
        lines = render(view, shown, max(screen.getmaxyx()[1] - 1, 20))
        if typing is not None:
            lines[0] += " (typing: Enter keeps it, Esc cancels)"
        _draw(screen, lines)
        key = screen.getch()
        if typing is not None:
            if key in (10, 13, curses.KEY_ENTER):
                options, typing = replace(options, filter=typing), None
            elif key == 27:
                typing = None
            elif key in (curses.KEY_BACKSPACE, 127, 8):
                typing = typing[:-1]
            elif 32 <= key < 127:
                typing += chr(key)
        elif key in (ord("q"), ord("Q")):
            return 0
        elif key == ord("s"):
            options = replace(options, sort=SORT_KEYS[(SORT_KEYS.index(options.sort) + 1)
                                                      % len(SORT_KEYS)])
        elif key == ord("r"):
            options = replace(options, reverse=not options.reverse)
        elif key == ord("c"):
            options = replace(options, filter="")
        elif key == ord("/"):
            typing = ""
        if time.monotonic() - refreshed >= options.interval:
            view, refreshed = read(), time.monotonic()


def _draw(screen: Any, lines: list[str]) -> None:
    import curses

    height, width = screen.getmaxyx()
    screen.erase()
    for row, line in enumerate(lines[:height]):
        try:
            screen.addnstr(row, 0, line, max(width - 1, 0))
        except curses.error:  # the last cell of the screen
            pass
    screen.refresh()
