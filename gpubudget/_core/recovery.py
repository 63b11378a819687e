"""A tree put right after an exception cut one of its operations short.

An exception raised into gpubudget from outside (a Ctrl-C, a signal handler's
``TimeoutError``) lands wherever Python runs a signal handler: after a call returns, at a
function's start, at a loop's end; so, in the pure-Python core, inside the arena's or the
ledger's loops, or between two steps of a commit, while the operation holds the tree's lock.
The live-block registry and the pending stream-ordered frees change in one step each (an item
set or deleted), so they are the truth: :func:`recover`, the tree's lock held, makes
everything else agree with them again.

- the arena holds exactly their blocks, with their sizes (rebuilt when it does not, or when
  its own invariants broke);
- each budget's ``used`` is its own blocks plus what its unreleased children pass up (their
  peaks raised if need be), nothing is left claimed (:func:`~.ledger.claim`), its block
  count and live bytes per tag are its blocks', its count of unreleased children its
  children's;
- a growable root maps every granule its blocks touch.

The operation then happened whole or not at all, as the registry says: an allocation whose
block the caller never got is taken out of the registry first (``granted``). Counts of
events (allocations, frees, denials, the timeline) may count it or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .arena import Arena
from .ledger import passed_up, publish

if TYPE_CHECKING:
    from .node import Node
    from .tree import Tree

__all__ = ["recover"]


def recover(tree: Tree, granted: int | None = None) -> None:
    """The tree's lock held: make the tree agree with its registry (see the module
    docstring); ``granted``, a block the interrupted operation registered and did not hand
    out, is dropped first."""
    if granted is not None and granted in tree.live:
        del tree.live[granted]
    truth = {address: record[1] for address, record in tree.live.items()}
    truth.update((pending.address, pending.nbytes) for pending in tree.pending)
    _arena(tree, truth)
    nodes = tree.root.subtree()
    _ledger(tree, nodes)
    _counts(tree, nodes)
    mapping = tree.mapping
    if mapping is not None and mapping.asleep is None:
        mapping.count = sum(mapping.mapped)
        for address, nbytes in truth.items():
            mapping.admit(address, nbytes)


def _arena(tree: Tree, truth: dict[int, int]) -> None:
    arena = tree.arena
    try:
        arena.check()
        taken = {block.address: block.size for block in arena.walk() if not block.free}
    except Exception:  # noqa: BLE001 - its own invariants broke: rebuilt below (so does one
        taken = None  # landing from outside here, while the exception recovered from is raised)
    if taken != truth:
        tree.arena = rebuilt(arena, truth)


def rebuilt(arena: Arena, blocks: dict[int, int]) -> Arena:
    """A new arena like ``arena`` holding exactly ``blocks`` (address -> bytes): filled in
    address order (its first free block is always the rest of the range), the gaps given
    back at the end."""
    new = type(arena)(arena.base, arena.capacity, arena.granularity)
    gaps = []
    end = arena.base
    for address in sorted(blocks):
        if address > end:
            gaps.append(new.allocate(address - end))
        placed = new.allocate(blocks[address])
        if placed != address:  # pragma: no cover - the registry's blocks overlap
            raise AssertionError(f"block {address:#x} cannot be placed again ({placed})")
        end = address + blocks[address]
    for gap in gaps:
        if gap is not None:
            new.free(gap)
    return new


def _ledger(tree: Tree, nodes: list[Node]) -> None:
    own: dict[Node, int] = {}
    for node, nbytes, _, _ in tree.live.values():
        own[node] = own.get(node, 0) + nbytes
    for node in reversed(nodes):  # children before their parents
        used = own.get(node, 0) + sum(passed_up(child.account, child.account.used)
                                      for child in node.children if child.state != "released")
        account = node.account
        if account.used != used:
            account.used = used
            if used > account.peak:
                account.peak = used
    for node in nodes:  # what other processes and the driver door read, as they are now
        account = node.account
        account.claimed = 0  # what the operation cut short claimed, withdrawn
        publish(account)


def _counts(tree: Tree, nodes: list[Node]) -> None:
    blocks: dict[Node, int] = {}
    tagged: dict[tuple[Node, str], int] = {}
    for node, nbytes, tag, _ in tree.live.values():
        blocks[node] = blocks.get(node, 0) + 1
        if tag is not None:
            tagged[(node, tag)] = tagged.get((node, tag), 0) + nbytes
    for node in nodes:
        stats = node.stats
        stats.blocks = blocks.get(node, 0)
        for tag, entry in stats.tags.items():
            entry[0] = tagged.get((node, tag), 0)
        node.unreleased = sum(1 for child in node.children if child.state in ("open", "exited"))
