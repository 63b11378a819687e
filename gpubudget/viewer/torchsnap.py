"""A PyTorch memory snapshot (``torch.cuda.memory._dump_snapshot``) as a viewer model, so that
the viewer shows PyTorch's caching allocator too, with or without budgets.

A snapshot is a pickled dictionary (read by :func:`~gpubudget.viewer.plainpickle.load_plain`,
which refuses anything but plain data): ``segments``, the memory the allocator holds from the
device when the snapshot was taken, each with its blocks (``active_allocated``,
``active_pending_free`` or ``inactive``: cached); and ``device_traces``, per device, the last
actions recorded since ``torch.cuda.memory._record_memory_history()`` (``alloc``,
``free_requested``, ``free_completed``, ``segment_alloc``, ``segment_free``,
``segment_map``/``segment_unmap`` for expandable segments, ``oom``, ``snapshot``), each with
``addr``, ``size``, ``stream``, its stack in ``frames`` (innermost first) and, in the
versions that have them, ``time_us``, ``pool_id`` and ``user_metadata``. Before PyTorch 2.0
a snapshot was the list of segments alone (each block's ``history`` its allocations, with
their frames): read as a dictionary with those segments and no actions.

The model: a root budget per device (``cuda:N``, no limit) and a child per private memory
pool (``pool (a, b)``, from ``segment_pool_id``/``pool_id``; a CUDA graph's or a
``MemPool``'s); ``used`` is what the allocator reserved from the device (its segments), a
budget's own bytes its live blocks'. A block lives from its ``alloc`` to its
``free_completed``; one freed before any ``alloc`` of it was recorded, or live in the
snapshot without one, was allocated before the record began. A ``user_metadata`` string is
the block's tag; each ``oom`` a denial. Stacks keep their Python frames (all frames where
there is none), outermost first. Times are seconds from the first action recorded; without
``time_us`` they are the actions' numbers.
"""

from __future__ import annotations

import bisect
import math
import os
import stat
import sys
from typing import Any, Final

from ..tracefile import MAX_FRAMES, MAX_TEXT, MAX_TRACE_BYTES
from ..text import printable
from ..units import format_size
from .model import ViewBudget, ViewModel
from .plainpickle import SnapshotError, load_plain
from .sources import read_bounded, shown

__all__ = ["looks_like_pickle", "model_from_torch_snapshot", "model_from_torch_data"]

_LIVE_STATES: Final = ("active_allocated", "active_pending_free", "active_awaiting_free")
_MIN_BLOCK: Final = 512
"""What PyTorch's caching allocator rounds a request up to a multiple of (``kMinBlockSize``;
a ``roundup_power2_divisions`` setting rounds further, which a snapshot's actions do not
show)."""


def _rounded(size: int) -> int:
    """``size`` as the caching allocator rounds a request: up to a multiple of 512 bytes."""
    return max(_MIN_BLOCK, -(-size // _MIN_BLOCK) * _MIN_BLOCK)
_DEFAULT_POOL: Final = (0, 0)


def looks_like_pickle(path: str) -> bool:
    """Whether the file at ``path`` starts as a pickle of protocol 2 or later does, or is
    named ``*.pickle``/``*.pkl`` (``False`` where it cannot be read: the trace reader then
    says why)."""
    if path.lower().endswith((".pickle", ".pkl")):
        return True
    try:
        if path == "-":
            peek = getattr(sys.stdin.buffer, "peek", None)
            return bool(peek is not None and peek(1)[:1] == b"\x80")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 1) == b"\x80"
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):
        return False


def model_from_torch_snapshot(path: str | os.PathLike[str], *, title: str | None = None,
                              max_bytes: int = MAX_TRACE_BYTES) -> ViewModel:
    """Read the PyTorch memory snapshot at ``path`` (``-``: standard input) into a model;
    :class:`~gpubudget.viewer.plainpickle.SnapshotError` in one line if it cannot be read, is
    not plain data or not a snapshot.

    Examples
    --------
    >>> import os, pickle, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
    >>> frames = [{"filename": "train.py", "line": 7, "name": "step"}]
    >>> snapshot = {"segments": [{"device": 0, "address": 4096, "total_size": 2097152,
    ...     "stream": 0, "segment_pool_id": (0, 0), "blocks": [
    ...         {"address": 4096, "size": 1024, "requested_size": 1000,
    ...          "state": "active_allocated", "frames": frames}]}],
    ...     "device_traces": [[{"action": "alloc", "addr": 4096, "size": 1024, "stream": 0,
    ...                         "time_us": 10, "frames": frames}]]}
    >>> with open(path, "wb") as file:
    ...     pickle.dump(snapshot, file)
    >>> model = model_from_torch_snapshot(path)
    >>> [b.name for b in model.budgets], list(model.block_size), model.frames
    (['cuda:0'], [1024.0], ['train.py:7 in step'])
    """
    text = os.fspath(path)
    data = load_plain(read_bounded(text, max_bytes, "snapshot", SnapshotError), printable(text))
    return model_from_torch_data(data, title=title or os.path.basename(text),
                                 name=printable(text))


class _Checked:
    """Typed access to the snapshot's plain data, each failure a :class:`SnapshotError`
    naming the file and where; every dictionary and list walked once (a pickle can share
    one object many times: walking it again would multiply the work)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: set[int] = set()

    def fail(self, where: str, what: str) -> SnapshotError:
        """The error for ``where`` (a path into the snapshot) being ``what``."""
        return SnapshotError(f"{self.name}: not a PyTorch memory snapshot: {where} {what}")

    def once(self, value: object, where: str) -> None:
        if id(value) in self.seen:
            raise self.fail(where, "is the same object as another part (PyTorch never "
                                   "writes that)")
        self.seen.add(id(value))

    def as_dict(self, value: object, where: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"is {shown(value)}, not a dictionary")
        self.once(value, where)
        return value

    def as_list(self, value: object, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(where, f"is {shown(value)}, not a list")
        self.once(value, where)
        return value

    def integer(self, entry: dict[Any, Any], key: str, where: str,
            default: int | None = None) -> int:
        value = entry.get(key, default)
        if type(value) is not int or not 0 <= value < 2**64:
            raise self.fail(f"{where}[{key!r}]", f"is {shown(value)}, not a whole number "
                                                 f"from 0 to 2**64")
        return value

    def pool(self, entry: dict[Any, Any], key: str, where: str) -> tuple[int, int] | None:
        value = entry.get(key)
        if value is None:
            return None
        if (not isinstance(value, (tuple, list)) or len(value) != 2
                or not all(type(x) is int for x in value)):
            raise self.fail(f"{where}[{key!r}]", f"is {shown(value)}, not a pair of integers")
        return (value[0], value[1])


class _Regions:
    """A device's mapped regions by start address (``address -> (size, from, budget)``),
    with their starts kept sorted: finding those a range overlaps costs a bisection, not a
    pass over all of them (a snapshot may hold a hundred thousand)."""

    def __init__(self) -> None:
        self.by_start: dict[int, tuple[int, int, int]] = {}
        self.starts: list[int] = []

    def put(self, address: int, region: tuple[int, int, int]) -> None:
        if address not in self.by_start:
            bisect.insort(self.starts, address)
        self.by_start[address] = region

    def pop(self, address: int) -> tuple[int, int, int]:
        del self.starts[bisect.bisect_left(self.starts, address)]
        return self.by_start.pop(address)

    def overlapping(self, start: int, end: int) -> list[int]:
        """The starts of the regions that overlap ``[start, end)``, regions being apart as
        a device's are: the one that begins last at or below ``start`` if it reaches past
        it, and those that begin inside."""
        first = bisect.bisect_right(self.starts, start)
        last = bisect.bisect_left(self.starts, end, first)
        below = self.starts[first - 1] if first else None
        found = [below] if below is not None and below + self.by_start[below][0] > start else []
        return found + self.starts[first:last]


def _frame_text(frame: dict[Any, Any]) -> tuple[str, bool]:
    """``file:line in function`` of a recorded frame (each part a string or a whole number,
    else ``?``, cut to the trace format's text length), and whether it is a Python frame."""
    parts = []
    for key in ("filename", "line", "name"):
        value = frame.get(key)
        text = (value if isinstance(value, str) else str(value)
                if type(value) is int and value.bit_length() <= 64 else "?")
        parts.append(printable(text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 1] + "…"))
    text = f"{parts[0]}:{parts[1]} in {parts[2]}"
    return text, ".py:" in text


class _Device:
    """One device's budgets and their running totals while its actions are replayed."""

    def __init__(self, model: ViewModel, device: int) -> None:
        self.model = model
        self.root = len(model.budgets)
        model.budgets.append(ViewBudget(f"cuda:{device}", None, 0, 0, 0.0))
        self.pools: dict[tuple[int, int], int] = {}
        self.reserved: dict[int, int] = {self.root: 0}  # budget -> bytes, children within
        self.own: dict[int, int] = {self.root: 0}
        self.changes: list[tuple[int, int, int, int]] = []  # (event, budget, reserved, own)
        self.segments: list[tuple[int, int, tuple[int, int]]] = []  # (address, end, pool)
        self.live: dict[int, int] = {}  # address -> block index
        self.regions = _Regions()

    def budget(self, pool: tuple[int, int] | None, address: int | None = None) -> int:
        if pool is None and address is not None and self.segments:
            index = bisect.bisect_right(self.segments, (address, math.inf)) - 1
            if index >= 0 and address < self.segments[index][1]:
                pool = self.segments[index][2]
        if pool is None or pool == _DEFAULT_POOL:
            return self.root
        found = self.pools.get(pool)
        if found is None:
            found = self.pools[pool] = len(self.model.budgets)
            self.model.budgets.append(ViewBudget(f"pool {pool}", self.root, 0, 0, 0.0))
            self.reserved[found] = self.own[found] = 0
        return found

    def change(self, at: int, budget: int, reserved: int, own: int) -> None:
        """``at`` -1: before the record began (what the first point starts from)."""
        if at < 0:
            self.reserved[budget] += reserved
            self.own[budget] += own
            if budget != self.root:
                self.reserved[self.root] += reserved
        else:
            self.changes.append((at, budget, reserved, own))

    def points(self, first: int) -> None:
        """Every budget's points: its totals before the record, then each change."""
        model, root = self.model, self.root
        used = dict(self.reserved)
        own = dict(self.own)
        for budget in used:
            model.point(first, budget, used[budget], own[budget])
        for at, budget, reserved, owned in self.changes:
            used[budget] += reserved
            own[budget] += owned
            model.point(at, budget, used[budget], own[budget])
            if budget != root and reserved:
                used[root] += reserved
                model.point(at, root, used[root], own[root])


class _Reader:
    def __init__(self, data: object, title: str, name: str) -> None:
        self.check = _Checked(name)
        self.model = ViewModel(title, "torch")
        self.stacks: dict[int, int] = {}  # id(frames list) -> stack index
        # id(frame dict) -> (its text, whether a Python frame): a frame a pickle shares
        # many times is formatted once
        self.frame_texts: dict[int, tuple[str, bool]] = {}
        self.old = isinstance(data, list)  # before PyTorch 2.0: the segments alone
        self.data = ({"segments": data} if self.old
                     else self.check.as_dict(data, "the pickle"))
        if "segments" not in self.data and "device_traces" not in self.data:
            raise self.check.fail("the pickle", "has neither 'segments' nor 'device_traces'")

    def stack(self, frames: object, where: str) -> int:
        if frames is None:
            return -1
        found = self.stacks.get(id(frames))
        if found is not None:
            return found
        if not isinstance(frames, list):
            raise self.check.fail(where, f"is {shown(frames)}, not a list of frames")
        texts, python, known = [], [], self.frame_texts
        for index, frame in enumerate(frames):
            found_text = known.get(id(frame))
            if found_text is None:
                if not isinstance(frame, dict):
                    raise self.check.fail(f"{where}[{index}]", f"is {shown(frame)}, not a "
                                                               f"dictionary")
                found_text = known[id(frame)] = _frame_text(frame)
            texts.append(found_text[0])
            if found_text[1]:
                python.append(found_text[0])
        kept = (python or texts)[:MAX_FRAMES]
        found = self.stacks[id(frames)] = self.model.stack_id(kept[::-1])
        return found

    def requested(self, entry: dict[Any, Any], where: str) -> int:
        """The bytes a block's allocation asked for (``requested_size``; an old snapshot's
        first ``history`` entry's ``real_size``), -1 where the record does not say."""
        if "requested_size" in entry:
            return self.check.integer(entry, "requested_size", where)
        history = entry.get("history")
        if isinstance(history, list) and history and isinstance(history[0], dict) \
                and "real_size" in history[0]:
            return self.check.integer(history[0], "real_size", f"{where}['history'][0]")
        return -1

    def stream(self, entry: dict[Any, Any], key: str, where: str) -> int:
        """The stream an action or segment names (0 where it names none)."""
        value = self.check.integer(entry, key, where, 0)
        return value if value < 2**63 else -1

    def run(self) -> ViewModel:
        check, model = self.check, self.model
        segments = check.as_list(self.data.get("segments", []), "'segments'")
        traces = check.as_list(self.data.get("device_traces", []), "'device_traces'")
        by_device: dict[int, list[tuple[int, dict[Any, Any]]]] = {}
        for index, segment in enumerate(segments):
            where = f"segments[{index}]"
            segment = check.as_dict(segment, where)
            by_device.setdefault(check.integer(segment, "device", where, 0), []).append(
                (index, segment))
        lists = [check.as_list(trace, f"device_traces[{d}]") for d, trace in enumerate(traces)]
        entries = [[check.as_dict(e, f"device_traces[{d}][{i}]") for i, e in enumerate(trace)]
                   for d, trace in enumerate(lists)]
        timed = all("time_us" in e for trace in entries for e in trace)
        model.time_unit = "s" if timed else "event"
        actions: list[tuple[float, int, int]] = []  # (time, device, index), every device
        for device, trace in enumerate(entries):
            for index, entry in enumerate(trace):
                where = f"device_traces[{device}][{index}]"
                actions.append((check.integer(entry, "time_us", where) if timed else index + 1,
                                device, index))
        actions.sort()
        first = actions[0][0] if actions and timed else 0
        start = model.tick(0.0)
        states = {device: self.segments(device, by_device.get(device, []))
                  for device in sorted(set(by_device) | {d for _, d, _ in actions})}
        for t, device, index in actions:
            self.action(states[device], entries[device][index], (t - first) / 1e6 if timed
                        else float(t), f"device_traces[{device}][{index}]")
        for device, state in states.items():
            self.finish(state, by_device.get(device, []))
            state.points(start)
        last = actions[-1][0] if actions else 0  # an out-of-memory or the snapshot itself
        model.end = max(model.times[-1], (last - first) / 1e6 if timed else float(last))
        model.notes.append("a PyTorch memory snapshot: used is what the caching allocator "
                           "reserved from the device, the bands its live blocks" +
                           ("" if timed else "; it has no clock: times are action numbers"))
        if self.old:
            model.notes.append("an old snapshot (a list of segments, before PyTorch 2.0): "
                               "the blocks live when it was taken, no history")
        return model

    def segments(self, device: int, segments: list[tuple[int, dict[Any, Any]]]) -> _Device:
        """The device's budgets, and where its segments were when the snapshot was taken."""
        check = self.check
        state = _Device(self.model, device)
        for index, segment in segments:
            where = f"segments[{index}]"
            address = check.integer(segment, "address", where)
            size = check.integer(segment, "total_size", where)
            pool = check.pool(segment, "segment_pool_id", where) or _DEFAULT_POOL
            state.segments.append((address, address + size, pool))
        state.segments.sort()
        return state

    def action(self, state: _Device, entry: dict[Any, Any], t: float, where: str) -> None:
        """One recorded action of ``state``'s device, at ``t``."""
        check, model = self.check, self.model
        action = entry.get("action")
        if action == "oom":
            free = format_size(check.integer(entry, "device_free", where, 0))
            model.denials.append((max(t, model.times[-1]), state.root,
                                  check.integer(entry, "size", where),
                                  f"out of memory: the device had {free} free", -1))
            model.budgets[state.root].denied += 1
            return
        if action not in ("alloc", "free_completed", "free", "segment_alloc",
                          "segment_free", "segment_map", "segment_unmap"):
            return
        address = check.integer(entry, "addr", where)
        size = check.integer(entry, "size", where)
        asked = -1
        if action in ("alloc", "free_completed", "free"):  # a block's action: its request
            asked = self.requested(entry, where)
            if asked < 0:  # PyTorch 2.x records what was asked (2.11: checked), not the block
                asked, size = size, _rounded(size)
        at = model.tick(t)
        budget = state.budget(check.pool(entry, "pool_id", where), address)
        live = state.live
        if action == "alloc":
            tag = entry.get("user_metadata")
            block = model.block(budget, size, model.tag_id(tag) if isinstance(tag, str)
                                and tag else -1, address, at,
                                self.stack(entry.get("frames"), f"{where}['frames']"),
                                asked, self.stream(entry, "stream", where))
            previous = live.pop(address, None)
            if previous is not None:  # its free was not recorded
                self.free(state, previous, at)
            live[address] = block
            model.budgets[budget].allocations += 1
            state.change(at, budget, 0, size)
        elif action in ("free_completed", "free"):
            block = live.pop(address, -1)
            if block < 0:  # allocated before the record began
                block = model.block(budget, size, -1, address, -1,
                                    self.stack(entry.get("frames"), f"{where}['frames']"),
                                    asked, self.stream(entry, "stream", where))
                model.budgets[budget].allocations += 1
                state.change(-1, budget, 0, size)
            self.free(state, block, at)
        elif action in ("segment_alloc", "segment_map"):
            state.regions.put(address, (size, at, budget))
            state.change(at, budget, size, 0)
        else:
            self.unmap(state, address, size, at, budget)

    def finish(self, state: _Device, segments: list[tuple[int, dict[Any, Any]]]) -> None:
        """The snapshot's segments and live blocks that no recorded action accounts for,
        then every region."""
        for index, segment in segments:
            self.final_segment(state, segment, index)
        for address, (size, first, _budget) in state.regions.by_start.items():
            self.model.regions.append((state.root, address, size, first, -1))

    def free(self, state: _Device, block: int, at: int) -> None:
        model = self.model
        budget = model.block_budget[block]
        model.end_block(block, at)
        model.budgets[budget].frees += 1
        state.change(at, budget, 0, -int(model.block_size[block]))

    def unmap(self, state: _Device, address: int, size: int, at: int, budget: int) -> None:
        """End the regions ``[address, address + size)`` overlaps at ``at``; what they had
        outside it lives on as new regions."""
        regions, end, covered = state.regions, address + size, 0
        for start in regions.overlapping(address, end):
            length, first, owner = regions.pop(start)
            self.model.regions.append((state.root, start, length, first, at))
            covered += min(end, start + length) - max(address, start)
            if start < address:
                regions.put(start, (address - start, at, owner))
            if start + length > end:
                regions.put(end, (start + length - end, at, owner))
        if covered < size:  # mapped before the record began
            self.model.regions.append((state.root, address, size, -1, at))
            state.change(-1, budget, size - covered, 0)
        state.change(at, budget, -size, 0)

    def final_segment(self, state: _Device, segment: dict[Any, Any], index: int) -> None:
        """A segment of the snapshot: a region from the start unless its allocation was
        recorded, and its live blocks from the start unless theirs were."""
        check, model, regions, live = self.check, self.model, state.regions, state.live
        where = f"segments[{index}]"
        address = check.integer(segment, "address", where)
        size = check.integer(segment, "total_size", where)
        budget = state.budget(check.pool(segment, "segment_pool_id", where))
        if not regions.overlapping(address, address + 1):
            regions.put(address, (size, -1, budget))
            state.change(-1, budget, size, 0)
        offset = address
        for number, block in enumerate(check.as_list(segment.get("blocks", []),
                                                  f"{where}['blocks']")):
            inside = f"{where}['blocks'][{number}]"
            block = check.as_dict(block, inside)
            nbytes = check.integer(block, "size", inside)
            at_address = check.integer(block, "address", inside, offset)
            offset = at_address + nbytes
            requested = self.requested(block, inside)
            if block.get("state") in _LIVE_STATES and at_address in live and requested >= 0:
                model.block_requested[live[at_address]] = requested  # the segment's word
            if block.get("state") not in _LIVE_STATES or at_address in live:
                continue
            frames = block.get("frames")
            history = block.get("history")
            if frames is None and isinstance(history, list) and history:
                first = history[0]
                frames = first.get("frames") if isinstance(first, dict) else None
            tag = block.get("user_metadata")
            model.block(budget, nbytes, model.tag_id(tag) if isinstance(tag, str) and tag
                        else -1, at_address, -1, self.stack(frames, f"{inside}['frames']"),
                        requested, self.stream(segment, "stream", where))
            model.budgets[budget].allocations += 1
            state.change(-1, budget, 0, nbytes)


def model_from_torch_data(snapshot: object, *, title: str = "PyTorch memory snapshot",
                          name: str = "snapshot") -> ViewModel:
    """The model of a snapshot already in memory (what ``torch.cuda.memory._snapshot()``
    returns); :class:`~gpubudget.viewer.plainpickle.SnapshotError` (naming ``name``) if it
    is not one."""
    return _Reader(snapshot, title, name).run()

