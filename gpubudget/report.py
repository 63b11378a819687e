"""``BudgetReport``: a frozen snapshot of a budget tree, with text and JSON forms.

Trees may be of any depth (a budget per request, nested a thousand deep): every walk here is
a loop over an explicit stack, never a recursion.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from .jsontext import dumps
from .units import format_size

if TYPE_CHECKING:
    from .tracefile import Door

__all__ = [
    "FRAMES_SHOWN",
    "TAGS_SHOWN",
    "BudgetReport",
    "Denial",
    "DoorLibrary",
    "DoorUsage",
    "LiveBlock",
    "TagUsage",
    "TimelineEvent",
    "Totals",
    "Usage",
]


@dataclass(frozen=True)
class LiveBlock:
    """A block still allocated when the report was taken."""

    address: int
    size: int
    """Aligned size in bytes: what the budget is charged."""
    tag: str | None
    stack: tuple[str, ...] | None
    """``"file:line in function"`` frames, outermost first (``track_stacks=True`` only)."""


@dataclass(frozen=True)
class Denial:
    """Allocations refused for one reason by one budget."""

    reason: str
    """``over_limit``, ``fragmented``, ``invalid_size``, ``invalid_alignment``,
    ``invalid_tag``, ``invalid_stream``, ``invalid_address`` (resizing a block that is not there), ``inactive``,
    ``released``, ``interrupted`` (a Ctrl-C arrived during the call), ``wrong_device`` (an
    adapter was called while another CUDA device was current), ``asleep`` (a growable root
    put to sleep by ``offload()``), ``device_full`` (a growable root whose device had no
    memory to map for it) or ``internal_error``."""
    refused_by: str
    """Name of the budget whose limit or arena refused (this budget or an ancestor)."""
    count: int
    largest: int
    """Largest refused request, in aligned bytes (raw bytes for invalid requests)."""


@dataclass(frozen=True)
class TagUsage:
    """Bytes of one budget's own blocks that carry one tag."""

    tag: str
    live: int
    peak: int


@dataclass(frozen=True)
class Usage:
    """What one allocator routed into a budget (CuPy, PyTorch) holds there."""

    source: str
    charged: int
    """Bytes of the budget's blocks it holds (what the budget is charged for it)."""
    in_use: int
    """Of those, bytes in live arrays or tensors."""
    cached: int
    """Of those, bytes it keeps for reuse (``charged - in_use``)."""
    library: int = 0
    """Of ``in_use``, bytes that libraries keep across calls (CuPy's cached FFT plans'
    work areas); returned when the budget ends."""
    outside: int = 0
    """Library memory the adapter keeps outside every budget on the device (PyTorch's
    cuBLAS/cuBLASLt workspaces, one per thread and stream): never charged, shown here."""
    waiting_in_use: int = 0
    """Of ``in_use``, bytes in pools the adapter has retired (the budget's scope ended): they
    return to the budget once those arrays or tensors are gone and the adapter's
    ``release_cached()`` runs."""
    waiting_cached: int = 0
    """Of ``cached``, bytes in retired pools that return at the adapter's next
    ``release_cached()``."""


@dataclass(frozen=True)
class DoorLibrary:
    """One library's part of what the driver door charged a budget."""

    name: str
    """The file name of the library that called the CUDA driver (``libcublasLt.so.13``)."""
    live: int
    """Bytes its driver allocations charged to this budget hold now."""
    refusals: int
    """Its requests this budget refused."""


@dataclass(frozen=True)
class DoorUsage:
    """What the driver door (``gpubudget run``) charged a budget: device memory that
    libraries took from the CUDA driver themselves, in this budget's scope or its children's."""

    held: int
    """Bytes live, this budget's and its children's (not a root's own reservation)."""
    peak: int
    """The most bytes held at once, a root's own memory included."""
    allocations: int
    """Driver allocations live that were made in this budget itself (not counting a root's
    own reservation or granules)."""
    refusals: int
    """Requests refused by this budget's limit (with ``CUDA_ERROR_OUT_OF_MEMORY``)."""
    last_refused: int
    """The size of the last request refused here, 0 if none."""
    last_refused_by: str | None
    """The library that asked it."""
    libraries: tuple[DoorLibrary, ...]
    """This budget's own driver allocations by library, largest first."""
    attribute_only: bool
    """Counted without refusing (``gpubudget run --attribute-only``)."""

    @classmethod
    def from_trace(cls, door: Door) -> DoorUsage:
        """The numbers of a trace's ``door`` line (what the door had charged the budget
        when it exited), as a live report gives them."""
        return cls(door.foreign, door.peak, door.allocations, door.refusals,
                   door.last_refused, door.last_refused_by,
                   tuple(DoorLibrary(name, live, refusals)
                         for name, live, refusals in door.libraries), door.attribute_only)


@dataclass(frozen=True)
class Totals:
    """Counts over a budget and all its descendants together (released ones included)."""

    allocations: int
    frees: int
    denied: int
    """Requests denied to any budget of the subtree (each counted once, where it was asked)."""
    live_blocks: int


@dataclass(frozen=True)
class TimelineEvent:
    """One entry of a budget tree's event log."""

    time: float
    """Seconds since the first event kept."""
    kind: str
    """``alloc``, ``free`` or ``deny``."""
    budget: str
    size: int
    """Aligned bytes allocated or freed; for ``deny`` the refused size."""
    tag: str | None
    used: int
    """The budget's ``used`` after the event."""
    total: int
    """The root budget's ``used`` after the event."""


_REASONS = {
    "over_limit": "over the limit of",
    "fragmented": "no free block large enough in",
    "invalid_size": "invalid size, asked of",
    "invalid_alignment": "alignment not 0 or a power of two, asked of",
    "invalid_tag": "tag not a string, asked of",
    "invalid_stream": "stream not an integer handle, asked of",
    "invalid_address": "resize of a block it does not hold, asked of",
    "inactive": "not entered yet:",
    "released": "already released:",
    "forked": "inherited from the process this one was forked from:",
    "interrupted": "interrupted (Ctrl-C) in",
    "wrong_device": "another CUDA device was current, asked of",
    "asleep": "asleep (offloaded; restore() first), asked of",
    "device_full": "the device had no memory to map for the growth of",
    "internal_error": "internal error in",
}
def _door_line(door: DoorUsage) -> str:
    """The report's line for what the driver door charged a budget."""
    line = (f"driver allocations (through the door): {format_size(door.held)} held, peak "
            f"{format_size(door.peak)}")
    if door.libraries:
        line += "; by library: " + ", ".join(f"{lib.name} {format_size(lib.live)}"
                                              for lib in door.libraries[:8])
        if len(door.libraries) > 8:
            line += f", {len(door.libraries) - 8} more"
    if door.refusals:
        line += (f"; {door.refusals} refused, the last {format_size(door.last_refused)} asked "
                 f"by {door.last_refused_by or 'an unknown library'}")
    if door.attribute_only:
        line += " (counted only: nothing refused)"
    return line


_EVENT_FIELDS: Final = tuple(field.name for field in dataclasses.fields(TimelineEvent))
_SHOW_BLOCKS: Final = 20
"""Live blocks the text report lists per budget; the rest are counted."""
TAGS_SHOWN: Final = 20
"""Tags the text report lists per budget, largest peak first; the rest are counted."""
FRAMES_SHOWN: Final = 3
"""Innermost stack frames shown per live block (text report, leaks listed at exit)."""


@dataclass(frozen=True)
class BudgetReport:
    """What a budget (and its children) used, refused and still holds.

    Every size is in bytes. ``str(report)`` renders an indented tree; :meth:`as_dict` and
    :meth:`to_json` give machine-readable forms.

    Examples
    --------
    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     block = pool.allocate(1000, tag="weights")
    ...     pool.allocate(2**21) is None
    True
    >>> report = pool.report()
    >>> report.used, report.peak, report.denied, report.live_blocks[0].tag
    (1024, 1024, 1, 'weights')
    """

    name: str
    state: str
    """``new``, ``open``, ``exited`` (scope left, memory still held) or ``released``."""
    backend: str | None
    device: int | None
    """The CUDA device the tree's memory is on; ``None`` for host memory or before entry."""
    limit: int
    reserve: int
    align: int
    used: int
    """Aligned bytes charged now, including children's (and their reserves)."""
    peak: int
    available: int
    """Bytes this budget could still allocate by its own and its ancestors' limits."""
    allocations: int
    frees: int
    invalid_frees: int
    """Frees of addresses this budget did not own, or double frees."""
    denied: int
    largest_denied: int
    denials: tuple[Denial, ...]
    free_bytes: int
    """Free bytes in the arena(s) this budget draws from."""
    largest_free_block: int
    live_blocks: tuple[LiveBlock, ...]
    """Blocks this budget itself holds (children's are in their reports)."""
    peak_blocks: int
    """The most blocks this budget held at once."""
    refused: int
    """Requests this budget's limit refused, asked of it or of a budget below it (a request
    refused here for a child counts in the child's ``denied`` and here)."""
    totals: Totals
    """This budget and its descendants together: the numbers ``torch.cuda.memory_stats``
    would give for a device, for this subtree."""
    usage: tuple[Usage, ...]
    """Per framework routed into this budget (``gpubudget.cupy``, ``gpubudget.torch``)."""
    callback_errors: tuple[str, ...]
    """Errors caught and answered instead of raised: inside allocator callbacks (answered
    with ``None``), stream events and copies that failed (the operation refused or the
    block kept). The most recent 16."""
    by_tag: tuple[TagUsage, ...]
    """Live and peak bytes of this budget's own blocks, per tag."""
    children: tuple[BudgetReport, ...]
    timeline: tuple[TimelineEvent, ...] = ()
    """The event log of this budget and its descendants (on the report that ``report()``
    returned; children's reports leave it empty). At most ``EVENT_LOG_LIMIT`` events of a
    tree are kept; ``events_dropped`` counts the older ones."""
    events_dropped: int = 0
    outside_bytes: int | None = None
    """Root budgets on the PyCUDA backend: device memory taken by others (TensorRT's own
    allocations, cuBLAS workspaces, other libraries) while the scope was open: free memory
    just after the reservation minus free memory at exit (or now, while open)."""
    trace_error: str | None = None
    """Root budgets: why the trace file stopped (a write failed, or its writer's queue was
    full and dropped events: how many), if it did."""
    mapped: int | None = None
    """Growable roots (``initial=``): bytes of device memory mapped now; ``None`` for a root
    that reserved its whole limit."""
    mapped_peak: int | None = None
    """Growable roots: the most bytes mapped at once."""
    asleep: int | None = None
    """Growable roots put to sleep (``offload()``): the bytes of live blocks waiting in host
    memory for ``restore()``; ``None`` while awake."""
    host_kept: int = 0
    """Growable roots: host memory a ``restore(keep_host=True)`` kept for the next sleep."""
    limited_by: str | None = None
    """Root budgets in the host ledger: the limit set from outside the process (an MPS or
    HAMi variable, the cgroup's ``dmem.max``, NVML's) under the device's memory, within
    which the root's share or limit was decided, with its size; ``None`` if none was."""
    driver_door: DoorUsage | None = None
    """Under the driver door (``gpubudget run``): what libraries took from the CUDA driver
    in this budget's scope; ``None`` without the door."""

    @property
    def leaks(self) -> tuple[LiveBlock, ...]:
        """Blocks of this budget and its descendants still live after their scope exited."""
        return tuple(block for report in self.walk() if report.state in ("exited", "released")
                     for block in report.live_blocks)

    def plot(self, path: str) -> None:
        """Draw used bytes over time for this budget and its children (12 at most), limits as
        dashed lines, denials as crosses, into ``path``: PNG, SVG or PDF after its suffix
        (``ValueError`` for another). Needs matplotlib (``pip install 'gpubudget[plot]'``)."""
        from .plot import plot_report

        plot_report(self, path)

    @property
    def live_bytes(self) -> int:
        """Bytes held by this budget's own live blocks."""
        return sum(block.size for block in self.live_blocks)

    def walk(self) -> tuple[BudgetReport, ...]:
        """This report and every descendant's, depth first, parents before children."""
        found: list[BudgetReport] = []
        stack = [self]
        while stack:
            report = stack.pop()
            found.append(report)
            stack.extend(reversed(report.children))
        return tuple(found)

    def as_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """The report as plain dicts, lists, strings and ints (children nested); the event
        log (``"timeline"``: up to ``EVENT_LOG_LIMIT`` events, megabytes) only with
        ``timeline=True``."""
        made: dict[int, dict[str, Any]] = {}
        for report in reversed(self.walk()):  # children before their parents
            fields: dict[str, Any] = {}
            for field in dataclasses.fields(report):
                value = getattr(report, field.name)
                if field.name == "timeline" and not timeline:
                    continue
                if field.name == "children":
                    value = [made.pop(id(child)) for child in report.children]
                elif isinstance(value, (Totals, DoorUsage)):
                    value = dataclasses.asdict(value)
                elif field.name == "timeline":
                    value = [{name: getattr(event, name) for name in _EVENT_FIELDS}
                             for event in value]
                elif isinstance(value, tuple):
                    value = [_plain(item) for item in value]
                fields[field.name] = value
            made[id(report)] = fields
        return made[id(self)]

    def to_json(self, indent: int | None = 2, *, timeline: bool = False) -> str:
        """The report as JSON text: what ``json.dumps(report.as_dict(timeline=timeline),
        indent=indent)`` gives, for trees of any depth.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     _ = pool.allocate(4096)
        >>> "timeline" in pool.report().to_json(), '"kind": "alloc"' in pool.report(
        ...     ).to_json(timeline=True)
        (False, True)
        """
        return dumps(self.as_dict(timeline=timeline), indent)

    def to_html(self, path: str | os.PathLike[str], *, title: str | None = None) -> None:
        """Write the interactive viewer of this report (``gpubudget view`` draws the same
        page from a trace) into ``path``: one self-contained HTML file, no network needed to
        open it. It draws the timeline this report kept (``EVENT_LOG_LIMIT`` events at most;
        a trace keeps them all).

        >>> import os, tempfile
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     _ = pool.allocate(4096, tag="weights")
        >>> path = os.path.join(tempfile.mkdtemp(), "view.html")
        >>> pool.report().to_html(path)
        >>> open(path, encoding="utf-8").read(15)
        '<!DOCTYPE html>'
        """
        from .viewer.model import model_from_report
        from .viewer.page import write_page

        write_page(model_from_report(self), path, title=title or self.name)

    def __str__(self) -> str:
        lines: list[str] = []
        stack: list[tuple[BudgetReport, str, str]] = [(self, "", "")]
        while stack:
            report, first, rest = stack.pop()
            report._render(lines, first, rest)
            last = len(report.children) - 1
            for index, child in reversed(list(enumerate(report.children))):
                stack.append((child, rest + ("└─ " if index == last else "├─ "),
                              rest + ("   " if index == last else "│  ")))
        return "\n".join(lines)

    def _render(self, lines: list[str], first: str, rest: str) -> None:
        """This budget's own lines (not its children's)."""
        backend = f" [{self.backend}]" if self.backend else ""
        if self.device is not None:
            backend = f" [{self.backend} cuda:{self.device}]"
        reserve = f", reserve {format_size(self.reserve)}" if self.reserve else ""
        lines.append(
            f"{first}{self.name}{backend} ({self.state}): used {format_size(self.used)} "
            f"of {format_size(self.limit)}{reserve}, peak {format_size(self.peak)}"
        )
        if self.children:  # the tree's counts first: a root often allocates nothing itself
            totals = self.totals
            lines.append(
                f"{rest}  with the budgets below: allocations {totals.allocations}, frees "
                f"{totals.frees}, denied {totals.denied}, live blocks {totals.live_blocks}")
        detail = (
            f"{rest}  {'its own: ' if self.children else ''}allocations {self.allocations}, "
            f"frees {self.frees}, denied {self.denied}"
        )
        if self.denied:
            detail += f" (largest {format_size(self.largest_denied)})"
        if self.refused:
            detail += f", refused {self.refused} by its limit"
        if self.invalid_frees:
            detail += f", invalid frees {self.invalid_frees}"
        lines.append(detail)
        if not first:  # a root: children share its arena
            lines.append(
                f"{rest}  free in arena {format_size(self.free_bytes)}, "
                f"largest free block {format_size(self.largest_free_block)}"
            )
        for denial in self.denials:
            words = _REASONS.get(denial.reason, denial.reason)
            lines.append(
                f"{rest}  denied {denial.count}x, {words} '{denial.refused_by}' "
                f"(largest {format_size(denial.largest)})"
            )
        if self.live_blocks:
            lines.append(
                f"{rest}  live blocks: {len(self.live_blocks)} "
                f"({format_size(self.live_bytes)}; at most {self.peak_blocks} at once)"
            )
            for block in self.live_blocks[:_SHOW_BLOCKS]:
                tag = f"  {block.tag}" if block.tag else ""
                lines.append(f"{rest}    {block.address:#x}  {format_size(block.size)}{tag}")
                for frame in (block.stack or ())[-FRAMES_SHOWN:]:
                    lines.append(f"{rest}        {frame}")
            if len(self.live_blocks) > _SHOW_BLOCKS:
                lines.append(f"{rest}    ... {len(self.live_blocks) - _SHOW_BLOCKS} more")
        if self.by_tag:
            lines.append(f"{rest}  by tag (live / peak):")
            ranked = sorted(self.by_tag, key=lambda u: -u.peak)
            for usage in ranked[:TAGS_SHOWN]:
                lines.append(
                    f"{rest}    {usage.tag}: {format_size(usage.live)} / {format_size(usage.peak)}"
                )
            if len(ranked) > TAGS_SHOWN:
                lines.append(f"{rest}    ... {len(ranked) - TAGS_SHOWN} more tags")
        for held in self.usage:
            line = (f"{rest}  {held.source}: {format_size(held.charged)} charged, "
                    f"{format_size(held.in_use)} in use, {format_size(held.cached)} cached")
            if held.library:
                line += f"; libraries keep {format_size(held.library)} of it across calls"
            if held.outside:
                line += f"; library workspaces outside budgets: {format_size(held.outside)}"
            if held.waiting_in_use or held.waiting_cached:
                line += (f"; waiting to return: {format_size(held.waiting_in_use)} under live "
                         f"objects, {format_size(held.waiting_cached)} at the next "
                         f"release_cached()")
            lines.append(line)
        if self.limited_by is not None:
            lines.append(f"{rest}  sized within the limit {self.limited_by}")
        if self.driver_door is not None:
            lines.append(f"{rest}  {_door_line(self.driver_door)}")
        if self.outside_bytes is not None:
            lines.append(
                f"{rest}  device memory taken outside budgets meanwhile: "
                f"{format_size(self.outside_bytes)}"
            )
        if self.mapped is not None:
            lines.append(f"{rest}  device memory mapped {format_size(self.mapped)} (peak "
                         f"{format_size(self.mapped_peak or 0)}) for its "
                         f"{format_size(self.limit)} of addresses")
        if self.asleep is not None:
            lines.append(f"{rest}  asleep: {format_size(self.asleep)} of live blocks in host "
                         f"memory until restore()")
        if self.host_kept:
            lines.append(f"{rest}  {format_size(self.host_kept)} of host memory kept for the "
                         f"next offload()")
        if self.trace_error is not None:
            lines.append(f"{rest}  {self.trace_error}")
        for error in self.callback_errors:
            lines.append(f"{rest}  callback error: {error}")


def _plain(item: Any) -> Any:
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return dataclasses.asdict(item)
    return item
