"""``Budget.report()``: a :class:`~gpubudget.report.BudgetReport` taken from a live tree; and
the leaks said at interpreter exit.

``report.py`` knows what a report holds and how it prints; this module knows where each
number lives in the tree. The snapshot is taken under the tree's lock, in one pass over the
registry, and built children first, so trees of any depth cost no recursion.

At interpreter exit, every root whose scope has exited and whose tree still holds blocks
(``report().leaks``) says so on stderr: with their stacks, one block a paragraph, where the
blocks have stacks (``track_stacks=True``); else in one line (count, bytes, the largest
tags, and how to see where they were allocated). The one line is left out where something
still holds the tree's memory on the program's behalf, as it may until the end: a TensorRT
runtime or engine bound to it (a pin), or a PyTorch or CuPy pool (an adapter's usage).
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import TYPE_CHECKING

from .._core import Node, Probe, Tree, available
from .. import door
from ..errors import raise_if_from_outside
from ..text import printable
from ..units import format_size

if TYPE_CHECKING:  # the report (and dataclasses) loads with the first report, not at import
    from ..budget import Budget
    from ..report import BudgetReport, DoorUsage, LiveBlock, Totals, Usage

__all__ = ["leaks_at_exit", "snapshot", "watch_leaks", "watch_none"]

_watched: weakref.WeakSet[Budget] = weakref.WeakSet()


def snapshot(node: Node) -> BudgetReport:
    """The report of ``node`` and its descendants, with the tree's timeline for them."""
    import dataclasses

    from ..report import TimelineEvent

    tree = node.tree
    outside = _outside_bytes(tree) if tree is not None and node.parent is None else None
    with node.lock:
        probed = [(member, tuple(member.probes.items())) for member in node.subtree()]
    usage = {member: _usage(member, probes) for member, probes in probed}
    if tree is None:
        with node.lock:
            return _walk(node, None, usage)[0]
    report, names, events, dropped, trace_error, residency = tree.read(
        lambda: _walk(node, tree, usage))  # adapters' code ran outside it
    start = events[0][0] if events else 0.0
    timeline = tuple(
        TimelineEvent(t - start, kind, names[budget], size, tag, used, total)
        for t, kind, budget, size, tag, used, total in events
    )
    return dataclasses.replace(report, timeline=timeline, events_dropped=dropped,
                               outside_bytes=outside, trace_error=trace_error,
                               limited_by=_limited_by(tree) if node.parent is None else None,
                               **residency)  # type: ignore[arg-type]


if TYPE_CHECKING:
    _Walked = tuple[BudgetReport, dict[int, str],
                    list[tuple[float, str, int, int, str | None, int, int]],
                    int, str | None, dict[str, object]]
    """A walk's report, the budgets' names by id, their events, the count of events
    dropped, the trace's error and the root's residency fields."""


def _walk(node: Node, tree: Tree | None, usage: dict[Node, tuple[Usage, ...]]) -> _Walked:
    """The lock held (a walk of the tree, :meth:`~gpubudget._core.tree.Tree.read`): the
    report of ``node`` and its descendants, and what its timeline is made of."""
    from ..report import LiveBlock

    nodes = node.subtree()
    own: dict[Node, list[LiveBlock]] = {}
    free_bytes = largest_free = 0
    if tree is not None:
        for address, entry in tree.entries():
            own.setdefault(entry.owner, []).append(
                LiveBlock(address, entry.nbytes, entry.tag, entry.stack))
        if tree.reservation is not None:
            free_bytes, largest_free = tree.arena.free_bytes, tree.arena.largest_free
    made: dict[Node, BudgetReport] = {}
    for member in reversed(nodes):  # children before their parents
        children = tuple(made.pop(child) for child in member.children)
        blocks = sorted(own.get(member, ()), key=lambda block: block.address)
        made[member] = _report(member, tree, tuple(blocks), children, free_bytes,
                               largest_free, _totals(member, children),
                               usage.get(member, ()))
    report = made[node]
    if tree is None:
        return report, {}, [], 0, None, {}
    names = {member.id: member.name for member in nodes}
    events = [event for event in tree.recorder.events if event[2] in names]
    dropped = tree.recorder.logged - len(tree.recorder.events)
    trace_error = tree.recorder.trace_error
    writer = tree.recorder.writer
    if trace_error is None and writer is not None and writer.lost:
        trace_error = (f"trace to {writer.path!r} stopped: its writer's queue was full "
                       f"(the file written slower than events came); {writer.lost:,} "
                       f"event(s) not written, the file says so on its last line")
    mapping = tree.mapping if node.parent is None else None
    residency: dict[str, object] = {} if mapping is None else {
        "mapped": mapping.mapped_bytes, "mapped_peak": mapping.peak_bytes,
        "asleep": mapping.asleep.nbytes if mapping.asleep is not None else None,
        "host_kept": mapping.kept_bytes,
        "callback_errors": report.callback_errors + tuple(mapping.errors)}
    return report, names, events, dropped, trace_error, residency


def _limited_by(tree: Tree) -> str | None:
    """The limit set from outside that the root's claim was decided within, if any."""
    claim = getattr(tree.reservation, "claim", None)
    if claim is None:
        return None  # no claim: the host ledger may not even be loaded
    from ..hostledger.claims import Claim

    outside = claim.outside if isinstance(claim, Claim) else None
    return outside.text if outside is not None else None


def _totals(node: Node, children: tuple[BudgetReport, ...]) -> Totals:
    from ..report import Totals

    allocations, frees, denied, _, _ = node.own_counts()
    return Totals(
        allocations + sum(child.totals.allocations for child in children),
        frees + sum(child.totals.frees for child in children),
        denied + sum(child.totals.denied for child in children),
        node.stats.blocks + sum(child.totals.live_blocks for child in children),
    )


def _report(node: Node, tree: Tree | None, blocks: tuple[LiveBlock, ...],
            children: tuple[BudgetReport, ...], free_bytes: int, largest_free: int,
            totals: Totals, usage: tuple[Usage, ...]) -> BudgetReport:
    from ..report import BudgetReport, Denial, TagUsage

    stats, account = node.stats, node.account
    return BudgetReport(
        name=node.name,
        state=node.state,
        backend=tree.backend.name if tree is not None else None,
        device=tree.device if tree is not None else None,
        limit=account.limit,
        reserve=account.reserve,
        align=node.align,
        used=account.used,
        peak=account.peak,
        available=available(account) if node.refusal is None else 0,
        allocations=stats.allocations,
        frees=stats.frees,
        invalid_frees=stats.invalid_frees,
        denied=stats.denied,
        largest_denied=stats.largest_denied,
        denials=tuple(Denial(reason, refused_by, count, largest)
                      for (reason, refused_by), (count, largest) in stats.denials.items()),
        free_bytes=free_bytes if node.state in ("open", "exited") else 0,
        largest_free_block=largest_free if node.state in ("open", "exited") else 0,
        live_blocks=blocks,
        peak_blocks=stats.peak_blocks,
        refused=account.refusals,
        totals=totals,
        usage=usage,
        callback_errors=tuple(stats.errors),
        by_tag=tuple(TagUsage(tag, live, peak) for tag, (live, peak) in stats.tags.items()),
        children=children,
        driver_door=_driver_door(node),
    )


def _driver_door(node: Node) -> DoorUsage | None:
    """What the driver door charged ``node``'s budget, where the door is loaded."""
    numbers = door.numbers(node.budget)
    if numbers is None:
        return None
    from ..report import DoorLibrary, DoorUsage

    return DoorUsage(numbers.foreign, numbers.peak, numbers.live, numbers.refusals,
                     numbers.last_refused, numbers.last_refused_by,
                     tuple(DoorLibrary(lib.name, lib.live_bytes, lib.refusals)
                           for lib in numbers.libraries), numbers.attribute_only)


def _usage(node: Node, probes: tuple[tuple[str, Probe], ...]) -> tuple[Usage, ...]:
    """Ask each adapter what it holds of ``node``; one that fails is left out, and said."""
    from ..report import Usage

    found = []
    for source, probe in probes:
        try:
            charged, in_use, *more = probe()
            library, outside, waiting_in_use, waiting_cached = (
                [int(value) for value in more] + [0, 0, 0, 0])[:4]
        except Exception as exc:  # noqa: BLE001 - a report never fails for an adapter
            raise_if_from_outside(exc)
            with node.lock:
                node.stats.errors.append(f"{source} usage: {type(exc).__name__}: {exc}")
            continue
        found.append(Usage(source, charged, in_use, charged - in_use, library, outside,
                           waiting_in_use, waiting_cached))
    return tuple(found)


def _outside_bytes(tree: Tree) -> int | None:
    """Device memory taken outside the tree while its root was open."""
    if tree.free_at_entry is None:
        return None
    now = tree.free_at_exit if tree.root.state != "open" else tree.unclaimed()
    return tree.free_at_entry - now if now is not None else None


def watch_leaks(budget: Budget) -> None:
    """Say ``budget``'s blocks still live at interpreter exit on stderr (see the module
    docstring): every root is watched, and a child that keeps stacks under a root that does
    not."""
    _watched.add(budget)


def watch_none() -> None:
    """Watch no budget any more (a forked child: the leaks of its parent's budgets are the
    parent's to say)."""
    _watched.clear()


_TAGS_SHOWN = 3
"""Tags the one-line summary names at most."""


def _held(budget: Budget) -> bool:
    """Whether something holds memory of ``budget``'s tree on the program's behalf: a pin
    (a TensorRT runtime or engine) or an adapter's pool (PyTorch, CuPy)."""
    node = budget._node
    with node.lock:
        return any(member.pins or member.probes for member in node.subtree())


def _summary(name: str, leaks: tuple[LiveBlock, ...]) -> str:
    """One line for leaks without stacks: count, bytes, the largest tags."""
    by_tag: dict[str, int] = {}
    for block in leaks:
        tag = block.tag if block.tag is not None else "(no tag)"
        by_tag[tag] = by_tag.get(tag, 0) + block.size
    tags = sorted(by_tag.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{printable(tag)} {format_size(size)}" for tag, size in
                      tags[:_TAGS_SHOWN])
    more = f", {len(tags) - _TAGS_SHOWN} more tag(s)" if len(tags) > _TAGS_SHOWN else ""
    total = format_size(sum(block.size for block in leaks))
    return (f"gpubudget: {len(leaks)} block(s) of budget {printable(name)!r} still live at "
            f"exit ({total}: {shown}{more}); gpu_budget(..., track_stacks=True) shows where "
            f"each was allocated")


def _listing(name: str, leaks: tuple[LiveBlock, ...]) -> str:
    """Every leak with its address, size, tag and stack."""
    from ..report import FRAMES_SHOWN

    lines = [f"gpubudget: {len(leaks)} block(s) of budget {printable(name)!r} still live at "
             f"exit:"]
    for block in leaks:
        tag = f" {printable(block.tag)}" if block.tag else ""
        lines.append(f"  {block.address:#x} {format_size(block.size)}{tag}")
        lines += [f"      {printable(frame)}" for frame in (block.stack or ())[-FRAMES_SHOWN:]]
    return "\n".join(lines)


def leaks_at_exit(budget: Budget) -> str | None:
    """What interpreter exit says of ``budget``'s leaks (see the module docstring), or
    ``None``.

    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     _ = pool.allocate(4096, tag="weights")
    ...     _ = pool.allocate(1024)
    >>> print(leaks_at_exit(pool))  # doctest: +NORMALIZE_WHITESPACE
    gpubudget: 2 block(s) of budget 'pool' still live at exit (5.00 KiB: weights 4.00 KiB,
    (no tag) 1.00 KiB); gpu_budget(..., track_stacks=True) shows where each was allocated
    """
    if budget.state not in ("exited", "released"):
        return None
    leaks = budget.report().leaks
    if not leaks:
        return None
    if any(block.stack for block in leaks):
        return _listing(budget.name, leaks)
    if _held(budget):
        return None
    return _summary(budget.name, leaks)


@atexit.register
def _report_leaks_at_exit() -> None:
    watched = list(_watched)
    for budget in watched:
        ancestor = budget.parent
        while ancestor is not None and ancestor not in watched:
            ancestor = ancestor.parent
        if ancestor is not None and ancestor.state in ("exited", "released"):
            continue  # said with its ancestor's
        try:
            said = leaks_at_exit(budget)
        except Exception:  # noqa: BLE001 - a half-torn-down interpreter: say nothing
            continue
        if said is not None:
            print(said, file=sys.stderr)
