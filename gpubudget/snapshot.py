"""``Budget.report()``: a :class:`~gpubudget.report.BudgetReport` taken from a live tree.

``report.py`` knows what a report holds and how it prints; this module knows where each
number lives in the tree. The snapshot is taken under the tree's lock, in one pass over the
registry, and built children first, so trees of any depth cost no recursion.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import weakref
from typing import TYPE_CHECKING

from . import interrupts
from ._core.ledger import available
from .report import (
    FRAMES_SHOWN,
    BudgetReport,
    Denial,
    LiveBlock,
    TagUsage,
    TimelineEvent,
    Totals,
    Usage,
)
from ._core.node import Node, Probe
from ._core.tree import Tree
from .units import format_size

if TYPE_CHECKING:
    from .budget import Budget

__all__ = ["snapshot", "watch_leaks"]

_watched: weakref.WeakSet[Budget] = weakref.WeakSet()


def snapshot(node: Node) -> BudgetReport:
    """The report of ``node`` and its descendants, with the tree's timeline for them."""
    tree = node.tree
    outside = _outside_bytes(tree) if tree is not None and node.parent is None else None
    with node.lock:
        probed = [(member, tuple(member.probes.items())) for member in node.subtree()]
    usage = {member: _usage(member, probes) for member, probes in probed}  # adapters' code:
    with node.lock:  # outside the lock
        nodes = node.subtree()
        own: dict[Node, list[LiveBlock]] = {}
        free_bytes = largest_free = 0
        if tree is not None:
            for address, (owner, nbytes, tag, stack) in tree.live.items():
                own.setdefault(owner, []).append(LiveBlock(address, nbytes, tag, stack))
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
            return report
        names = {member.id: member.name for member in nodes}
        events = [event for event in tree.recorder.events if event[2] in names]
        dropped = tree.recorder.logged - len(tree.recorder.events)
        trace_error = tree.recorder.trace_error
        mapping = tree.mapping if node.parent is None else None
        residency: dict[str, object] = {} if mapping is None else {
            "mapped": mapping.mapped_bytes, "mapped_peak": mapping.peak_bytes,
            "asleep": mapping.asleep.nbytes if mapping.asleep is not None else None,
            "host_kept": mapping.kept_bytes,
            "callback_errors": report.callback_errors + tuple(mapping.errors)}
    start = events[0][0] if events else 0.0
    timeline = tuple(
        TimelineEvent(t - start, kind, names[budget], size, tag, used, total)
        for t, kind, budget, size, tag, used, total in events
    )
    return dataclasses.replace(report, timeline=timeline, events_dropped=dropped,
                               outside_bytes=outside, trace_error=trace_error,
                               **residency)  # type: ignore[arg-type]


def _totals(node: Node, children: tuple[BudgetReport, ...]) -> Totals:
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
    )


def _usage(node: Node, probes: tuple[tuple[str, Probe], ...]) -> tuple[Usage, ...]:
    """Ask each adapter what it holds of ``node``; one that fails is left out, and said."""
    found = []
    for source, probe in probes:
        try:
            charged, in_use, *more = probe()
            library, outside = (int(more[0]), int(more[1])) if more else (0, 0)
        except Exception as exc:  # noqa: BLE001 - a report never fails for an adapter
            if interrupts.foreign(exc):  # a signal handler's, say: the program's to see
                raise
            with node.lock:
                node.stats.errors.append(f"{source} usage: {type(exc).__name__}: {exc}")
            continue
        found.append(Usage(source, charged, in_use, charged - in_use, library, outside))
    return tuple(found)


def _outside_bytes(tree: Tree) -> int | None:
    """Device memory taken outside the tree while its root was open."""
    if tree.free_at_entry is None:
        return None
    now = tree.free_at_exit if tree.root.state != "open" else tree.unclaimed()
    return tree.free_at_entry - now if now is not None else None


def watch_leaks(budget: Budget) -> None:
    """List ``budget``'s blocks still live at interpreter exit on stderr, with their stacks
    (budgets made with ``track_stacks=True``)."""
    _watched.add(budget)


@atexit.register
def _report_leaks_at_exit() -> None:
    watched = list(_watched)
    for budget in watched:
        if budget.state not in ("exited", "released"):
            continue
        ancestor = budget.parent
        while ancestor is not None and ancestor not in watched:
            ancestor = ancestor.parent
        if ancestor is not None:
            continue  # listed with its ancestor's
        leaks = budget.report().leaks
        if not leaks:
            continue
        lines = [f"gpubudget: {len(leaks)} block(s) of budget {budget.name!r} still live at exit:"]
        for block in leaks:
            tag = f" {block.tag}" if block.tag else ""
            lines.append(f"  {block.address:#x} {format_size(block.size)}{tag}")
            lines += [f"      {frame}" for frame in (block.stack or ())[-FRAMES_SHOWN:]]
        print("\n".join(lines), file=sys.stderr)
