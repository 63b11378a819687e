"""``gpubudget top``: every budget of every process on the host, per device, live.

The view is the host ledger (:func:`gpubudget.hostledger.host_view`): one block per device
(its memory, cap, what the roots claimed and use), one row per root budget of a live
process (pid, process, budget, limit, used, peak, denials) and, where NVML answers, the
memory each process holds on the device outside its budgets, with the processes that hold
GPU memory and have no budget at all. On a terminal it redraws every second: ``s`` changes
the column rows are sorted by, ``r`` reverses the order, ``/`` filters (type, then Enter;
Esc cancels), ``c`` clears the filter, ``q`` quits. ``--once`` prints the view once as text
(as does ``top`` when its output is not a terminal), ``--json`` once as JSON. Names come from
other processes: unprintable characters are shown escaped.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

from ..hostledger import DeviceView, Entry, HostView, host_view
from ..tracefile import printable
from ..units import format_size

__all__ = ["SORT_KEYS", "TopOptions", "render", "top_command"]

SORT_KEYS: Final = ("used", "limit", "peak", "denials", "outside", "pid", "budget", "process")
"""What rows may be sorted by (``--sort``, and ``s`` cycles through them)."""
_NUMERIC: Final = frozenset({"used", "limit", "peak", "denials", "outside"})
_COLUMNS: Final = (("PID", 8), ("PROCESS", 24), ("BUDGET", 20), ("LIMIT", 11), ("USED", 11),
                   ("PEAK", 11), ("DENIED", 7), ("OUTSIDE", 11))


@dataclass(frozen=True)
class TopOptions:
    """How ``top`` shows the view."""

    sort: str = "used"
    reverse: bool = False
    """Numbers sort largest first, names A to Z; ``reverse`` turns that around."""
    filter: str = ""
    """Only rows whose pid, process, budget or device contains this (any case)."""
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

    def key(self, sort: str) -> Any:
        entry = self.entry
        values: dict[str, Any] = {
            "used": entry.used if entry else -1, "limit": entry.limit if entry else -1,
            "peak": entry.peak if entry else -1, "denials": entry.denials if entry else -1,
            "outside": self.outside if self.outside is not None else -1, "pid": self.pid,
            "budget": self.budget.lower(), "process": self.process.lower()}
        return values[sort]


def _rows(device: DeviceView, options: TopOptions) -> list[_Row]:
    rows = [_Row(entry.pid, entry.process, entry.name, entry, device.outside(entry.pid))
            for entry in device.entries]
    budgeted = {entry.pid for entry in device.entries}
    rows += [_Row(pid, "?", "(no budget)", None, device.outside(pid))
             for pid in device.pids if pid not in budgeted]
    wanted = options.filter.lower()
    if wanted and wanted not in f"{device.identity} {device.label}".lower():
        rows = [row for row in rows if wanted in f"{row.pid} {row.process} {row.budget}".lower()]
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


def _device_line(device: DeviceView) -> str:
    processes = len({entry.pid for entry in device.entries})
    named = device.label if device.identity in device.label else (
        f"{device.identity} {device.label}")
    parts = [printable(named),
             f"{format_size(device.total)}"]
    if device.cap is not None:
        parts.append(f"cap {format_size(device.cap)}")
    parts.append(f"claimed {format_size(device.claimed)} by {len(device.entries)} budgets "
                 f"in {processes} processes")
    parts.append(f"used {format_size(device.used)}")
    if device.ended:
        parts.append(f"{device.ended} ended not yet cleared")
    return " · ".join(parts)


def render(view: HostView, options: TopOptions = TopOptions()) -> list[str]:
    """The text of the view, one string per line (what ``--once`` prints and the live view
    draws).

    >>> import tempfile
    >>> render(host_view(tempfile.mkdtemp(), nvml=False))[-1]
    'no budgets registered on this host'
    """
    order = f"{options.sort} {'▲' if (options.sort in _NUMERIC) == options.reverse else '▼'}"
    lines = [f"gpubudget top · {view.taken_at.astimezone():%Y-%m-%d %H:%M:%S} · "
             f"{printable(view.directory)} · sort {order}"
             + (f" · filter {printable(options.filter)!r}" if options.filter else "")
             + ("" if view.nvml_error is None else " · outside: -, no NVML")]
    shown = 0
    for device in view.devices:
        rows = _rows(device, options)
        if not rows and (options.filter or not options.idle):
            continue
        lines += ["", _device_line(device),
                  "".join(_cell(title, width, index != 1 and index != 2) + " "
                          for index, (title, width) in enumerate(_COLUMNS)).rstrip()]
        for row in rows:
            entry = row.entry
            cells = [str(row.pid), row.process, row.budget,
                     _size(entry.limit if entry else None), _size(entry.used if entry else None),
                     _size(entry.peak if entry else None),
                     str(entry.denials) if entry else "-", _size(row.outside)]
            lines.append("".join(_cell(text, width, index not in (1, 2)) + " " for index, (
                text, (_, width)) in enumerate(zip(cells, _COLUMNS))).rstrip())
            shown += 1
    if not shown:
        lines += ["", "no budgets registered on this host" if not options.filter
                  else "no budget matches the filter"]
    return lines


def top_command(options: TopOptions, *, once: bool, as_json: bool) -> int:
    """Run ``gpubudget top``; return the exit status (errors propagate to the command
    line, which prints one line and exits 2)."""
    if as_json:
        print(json.dumps(host_view(options.directory, idle=options.idle).as_dict(), indent=2))
        return 0
    if once or not _terminal():
        print("\n".join(render(host_view(options.directory, idle=options.idle), options)))
        return 0
    import curses

    def read() -> HostView:
        return host_view(options.directory, idle=options.idle)

    first = read()  # a bad ledger is said before the terminal is taken over
    for stale in ("LINES", "COLUMNS"):  # curses would take them over the terminal's own size
        os.environ.pop(stale, None)
    result: int = curses.wrapper(lambda screen: _live(screen, options, read, first))
    return result


def _terminal() -> bool:
    """Whether standard input and output are a terminal the live view can take over."""
    try:
        return sys.stdin.isatty() and sys.stdout.isatty()
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
        lines = render(view, shown)
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
