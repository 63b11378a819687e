"""A trace or a report in the Trace Event Format (JSON), which ui.perfetto.dev and
``chrome://tracing`` open: ``gpubudget export --perfetto TRACE -o out.json``.

Each root budget is a process, each budget a thread of it (``"ph": "M"`` events name both):

- a budget's life is a complete slice (``"ph": "X"``, category ``budget``) from its entry to
  its exit (to the end of the run while open), its limit, peak and counts in its arguments;
- every block is a complete slice from its allocation to its free (to the end while live),
  named after its tag (``untagged`` without one), its bytes in its arguments, and its stack
  where the trace kept stacks: the Trace Event Format's own way (``"sf"``, a node of the
  top-level ``stackFrames`` tree, which ``chrome://tracing`` shows whole) and the frame
  that allocated it in the argument ``at`` (what Perfetto, which reads no ``stackFrames``,
  shows). Slices of one thread must nest, so a budget's blocks go on threads of their own
  beside it, ``NAME blocks``, ``NAME blocks 2``..., as many as blocks were live at once;
- the ``used`` bytes of every budget are counters of its root (``"ph": "C"`` named ``used``,
  a series per budget: Perfetto shows the track ``used NAME``), one event per root and
  moment, with the budgets that changed;
- each denial is an instant (``"ph": "i"``, on the budget's thread) with the bytes, the
  reason and the tag.

Times are whole microseconds since the trace began, and the counters keep the last value of
each microsecond. The file holds no blanks; where every change would make it larger than the
trace (and over 1 MiB), the counters are kept at a coarser resolution instead, 10 µs, 100
µs, ... (see :func:`write_perfetto`): each interval's largest value at its first moment, and
its last value at its last moment, so that no peak is lost.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

from .viewer.model import ViewModel, model_from_report
from .viewer.tracemodel import model_from_trace
from .units import format_size

if TYPE_CHECKING:
    from .report import BudgetReport

__all__ = ["RESOLUTIONS", "perfetto_events", "write_perfetto", "write_perfetto_report"]


def _us(seconds: float) -> int:
    """``seconds`` in whole microseconds."""
    return round(seconds * 1e6)


class _Layout:
    """Where everything of ``model`` goes: processes, threads, lanes of blocks, stacks."""

    def __init__(self, model: ViewModel) -> None:
        self.model = model
        budgets = model.budgets
        self.roots: list[int] = []
        for index, budget in enumerate(budgets):  # parents come before children
            self.roots.append(index if budget.parent is None else self.roots[budget.parent])
        self.names: list[str] = []  # each budget's thread and series: ``#2`` for a second
        seen: dict[tuple[int, str], int] = {}
        for index, budget in enumerate(budgets):
            key = (self.roots[index], budget.name)
            seen[key] = seen.get(key, 0) + 1
            self.names.append(budget.name if seen[key] == 1 else f"{budget.name} #{seen[key]}")
        self.spans = [self._span(block) for block in range(len(model.block_budget))]
        self.lane_of = self._lanes()
        lanes = [0] * len(budgets)
        for block, lane in enumerate(self.lane_of):
            owner = model.block_budget[block]
            lanes[owner] = max(lanes[owner], lane + 1)
        # tids in the order the threads are shown: each budget, then its lanes of blocks
        self.tids: list[int] = []
        self.lane_tids: list[list[int]] = []
        tid = 0
        for count in lanes:
            self.tids.append(tid + 1)
            self.lane_tids.append(list(range(tid + 2, tid + 2 + count)))
            tid += 1 + count
        self.stack_nodes, self.frames = self._stack_tree()

    def _span(self, block: int) -> tuple[int, int]:
        """The block's life in whole microseconds; a block older than a report's log starts
        with its budget."""
        model = self.model
        start = model.block_start[block]
        if math.isnan(start):
            start = model.budgets[model.block_budget[block]].entered
        end = model.block_end[block]
        begin = _us(start)
        return begin, max(_us(model.end if math.isnan(end) else end), begin)

    def _lanes(self) -> list[int]:
        """Each block's lane among its budget's: the lowest free when it starts (blocks of one
        lane never overlap)."""
        model = self.model
        busy: list[list[tuple[int, int]]] = [[] for _ in model.budgets]  # (end, lane) heaps
        idle: list[list[int]] = [[] for _ in model.budgets]  # lanes free, a heap
        count = [0] * len(model.budgets)
        lane_of = [0] * len(self.spans)
        for block in sorted(range(len(self.spans)), key=lambda b: (self.spans[b], b)):
            start, end = self.spans[block]
            owner = model.block_budget[block]
            ends, free = busy[owner], idle[owner]
            while ends and ends[0][0] <= start:
                heapq.heappush(free, heapq.heappop(ends)[1])
            if free:
                lane = heapq.heappop(free)
            else:
                lane, count[owner] = count[owner], count[owner] + 1
            heapq.heappush(ends, (end, lane))
            lane_of[block] = lane
        return lane_of

    def _stack_tree(self) -> tuple[list[int], dict[str, dict[str, str]]]:
        """Each stack's innermost node in the ``stackFrames`` tree (-1 for none), and the
        tree: node id -> its frame and its parent (its caller)."""
        model = self.model
        nodes: dict[tuple[int, int], int] = {}  # (parent node, frame) -> node
        frames: dict[str, dict[str, str]] = {}
        innermost: list[int] = []
        for stack in model.stacks:  # outermost frame first
            node = -1
            for frame in stack:
                found = nodes.get((node, frame))
                if found is None:
                    found = nodes[(node, frame)] = len(nodes)
                    entry = {"name": model.frames[frame]}
                    if node >= 0:
                        entry["parent"] = str(node)
                    frames[str(found)] = entry
                node = found
            innermost.append(node)
        return innermost, frames

    def budget_events(self) -> Iterator[dict[str, Any]]:
        """Metadata, a slice per budget's life, and the names of its lanes of blocks (threads
        numbered, and sorted, in the order they are shown: each budget, then its blocks)."""
        model = self.model
        for index, budget in enumerate(model.budgets):
            pid, tid = self.roots[index] + 1, self.tids[index]
            if budget.parent is None:
                yield {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": f"gpubudget {budget.name}"}}
            for lane, thread in [(-1, tid), *enumerate(self.lane_tids[index])]:
                name = (self.names[index] if lane < 0 else
                        f"{self.names[index]} blocks" + (f" {lane + 1}" if lane else ""))
                yield {"ph": "M", "name": "thread_name", "pid": pid, "tid": thread,
                       "args": {"name": name}}
                yield {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": thread,
                       "args": {"sort_index": thread}}
            start = _us(budget.entered)
            end = _us(budget.exited if budget.exited is not None else model.end)
            yield {"ph": "X", "name": self.names[index], "cat": "budget", "pid": pid,
                   "tid": tid, "ts": start, "dur": max(end - start, 0),
                   "args": {"limit": budget.limit, "reserve": budget.reserve,
                            "peak": budget.peak, "allocations": budget.allocations,
                            "frees": budget.frees, "denied": budget.denied}}

    def block_lines(self) -> Iterator[str]:
        """A complete slice per block, as JSON text (written from templates: most of the
        file)."""
        model = self.model
        tags = [_text(tag) for tag in model.tags]
        untagged = _text("untagged")
        sites = [f',"at":{_text(model.frames[stack[-1]])}' if stack else ""
                 for stack in model.stacks]
        for block, (start, end) in enumerate(self.spans):
            owner = model.block_budget[block]
            tag = model.block_tag[block]
            stack = model.block_stack[block]
            node = self.stack_nodes[stack] if stack >= 0 else -1
            yield (f'{{"ph":"X","name":{tags[tag] if tag >= 0 else untagged},'
                   f'"pid":{self.roots[owner] + 1},'
                   f'"tid":{self.lane_tids[owner][self.lane_of[block]]},"ts":{start},'
                   f'"dur":{end - start},"args":{{"bytes":{int(model.block_size[block])}'
                   f'{sites[stack] if node >= 0 else ""}}}'
                   f'{f",{_SF}:{node}" if node >= 0 else ""}}}')

    def intervals(self, resolution: int) -> int:
        """How many counter events at ``resolution`` at least: one per root and interval."""
        count = 0
        key = None
        for t, member in zip(self.model.point_t, self.model.point_budget):
            here = (self.roots[member], round(t * 1e6) // resolution)
            if here != key:
                count, key = count + 1, here
        return count

    def counter_lines(self, resolution: int = 1) -> Iterator[str]:
        """The ``used`` counters of every root, as JSON text: one event per root and
        microsecond with the last value of each budget changed; with a coarser
        ``resolution`` (microseconds), per root and interval of that length, each budget's
        largest value at the interval's first moment (where it differs from the last) and
        its last value at the interval's last."""
        model = self.model
        names = [_text(name) for name in self.names]
        key: tuple[int, int] | None = None  # (root, interval)
        first = last = 0  # the interval's first and last moments, in microseconds
        peaks: dict[str, int] = {}
        ends: dict[str, int] = {}
        for t, member, used in zip(model.point_t, model.point_budget, model.point_used):
            moment = round(t * 1e6)
            here = (self.roots[member], moment // resolution)
            if here != key:
                if key is not None:
                    yield from _interval(key[0], first, last, peaks, ends)
                key, first, peaks, ends = here, moment, {}, {}
            last = moment
            name, value = names[member], int(used)
            ends[name] = value
            if value > peaks.get(name, -1):
                peaks[name] = value
        if key is not None:
            yield from _interval(key[0], first, last, peaks, ends)

    def denial_events(self) -> Iterator[dict[str, Any]]:
        model = self.model
        for t, member, nbytes, reason, tag in model.denials:
            yield {"ph": "i", "s": "t", "name": f"denied {format_size(nbytes)}",
                   "cat": "denial", "pid": self.roots[member] + 1, "tid": self.tids[member],
                   "ts": _us(t), "args": {"bytes": nbytes, "reason": reason,
                                          "tag": model.tags[tag] if tag >= 0 else None}}


RESOLUTIONS: Final = (1, 10, 100, 1_000, 10_000)
"""The counters' resolutions :func:`write_perfetto` tries, in microseconds, finest first."""
_SMALL: Final = 1 << 20
"""Bytes below which a file's size does not matter: the export of a smaller trace keeps every
change of the counters, however it compares with the trace."""


_SF: Final = '"sf"'


def _interval(root: int, first: int, last: int, peaks: dict[str, int], ends: dict[str, int]
              ) -> Iterator[str]:
    """The counter events of one root's interval (names already JSON text)."""
    head = f'{{"ph":"C","name":"used","pid":{root + 1},"ts":'
    higher = ",".join(f"{name}:{peak}" for name, peak in peaks.items() if peak != ends[name])
    if higher and first != last:
        yield f'{head}{first},"args":{{{higher}}}}}'
    values = ",".join(f"{name}:{value}" for name, value in ends.items())
    yield f'{head}{last},"args":{{{values}}}}}'


def perfetto_events(model: ViewModel, resolution: int = 1) -> Iterator[dict[str, Any]]:
    """The Trace Event Format events of ``model``: metadata, slices, counters (at
    ``resolution`` microseconds), instants: what the files written hold in ``traceEvents``,
    as dicts."""
    layout = _Layout(model)
    yield from layout.budget_events()
    yield from (json.loads(line) for line in layout.block_lines())
    yield from (json.loads(line) for line in layout.counter_lines(resolution))
    yield from layout.denial_events()


def _text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))  # ASCII: characters are bytes


def _write(model: ViewModel, path: str | os.PathLike[str], within: int | None,
           resolution: int | None) -> int:
    """Write ``model``; return the counters' resolution: ``resolution``, else the finest of
    :data:`RESOLUTIONS` at which the file takes at most ``within`` bytes (the coarsest if
    none does)."""
    layout = _Layout(model)
    head = (f'{{"displayTimeUnit":"ms","otherData":'
            f'{_text({"generator": "gpubudget", "source": model.title})},'
            f'"stackFrames":{_text(layout.frames)},"traceEvents":[\n')
    fixed = (sum(len(_text(event)) + 2 for event in layout.budget_events())
             + sum(len(line) + 2 for line in layout.block_lines())
             + sum(len(_text(event)) + 2 for event in layout.denial_events()))
    chosen = resolution or RESOLUTIONS[0]
    counters: Iterable[str] | None = None
    if resolution is None and within is not None:
        room = within - len(head) - fixed - 3  # for the counters
        least = len('{"ph":"C","name":"used","pid":1,"ts":0,"args":{"":0}}') + 2
        for chosen in RESOLUTIONS:
            if layout.intervals(chosen) * least > room:
                continue  # too many events, whatever they hold: no need to write them out
            lines = list(layout.counter_lines(chosen))  # no more than the trace's size
            if sum(len(line) + 2 for line in lines) <= room:
                counters = lines
                break
    with open(path, "w", encoding="utf-8") as out:
        out.write(head)
        first = True
        chunk: list[str] = []
        for part in ((_text(event) for event in layout.budget_events()), layout.block_lines(),
                     counters if counters is not None else layout.counter_lines(chosen),
                     (_text(event) for event in layout.denial_events())):
            for line in part:
                chunk.append(line)
                if len(chunk) >= 65536:
                    out.write(("" if first else ",\n") + ",\n".join(chunk))
                    first = False
                    chunk.clear()
        if chunk:
            out.write(("" if first else ",\n") + ",\n".join(chunk))
        out.write("\n]}\n")
    return chosen


def write_perfetto(trace: str | os.PathLike[str], path: str | os.PathLike[str], *,
                   max_bytes: int | None = None, resolution: int | None = None) -> int:
    """Write the trace file ``trace`` into ``path`` in the Trace Event Format; return the
    counters' resolution in microseconds.

    ``resolution``: that of the counters (each interval's peak and last value; see the
    module docstring). By default the finest of :data:`RESOLUTIONS` (1 µs: every change)
    at which the file is no larger than the trace, or than 1 MiB for a smaller trace (its
    size does not matter, its detail does); the coarsest where none is.

    Examples
    --------
    >>> import json, os, tempfile
    >>> from gpubudget import gpu_budget
    >>> folder = tempfile.mkdtemp()
    >>> with gpu_budget("1MiB", name="pool", backend="host",
    ...                 trace=os.path.join(folder, "run.jsonl")) as pool:
    ...     _ = pool.allocate(4096, tag="weights")
    ...     _ = pool.allocate(2**21)
    >>> write_perfetto(os.path.join(folder, "run.jsonl"), os.path.join(folder, "run.json"))
    1
    >>> events = json.load(open(os.path.join(folder, "run.json")))["traceEvents"]
    >>> sorted({event["ph"] for event in events})
    ['C', 'M', 'X', 'i']
    >>> [(e["name"], e["args"]) for e in events if e["ph"] == "X" and "cat" not in e]
    [('weights', {'bytes': 4096})]
    """
    if resolution is not None and (isinstance(resolution, bool) or not isinstance(
            resolution, int) or resolution < 1):
        raise ValueError(f"resolution must be a whole number of microseconds >= 1, got "
                         f"{resolution!r}")
    model = (model_from_trace(trace) if max_bytes is None
             else model_from_trace(trace, max_bytes=max_bytes))
    try:
        within = max(os.path.getsize(trace), _SMALL) if os.fspath(trace) != "-" else None
    except OSError:
        within = None
    return _write(model, path, within, resolution)


def write_perfetto_report(report: BudgetReport, path: str | os.PathLike[str], *,
                          resolution: int = 1) -> None:
    """Write ``report``'s timeline into ``path`` in the Trace Event Format."""
    _write(model_from_report(report), path, None, resolution)
