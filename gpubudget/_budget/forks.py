"""What a budget is in a process made by ``fork()``: closed to it.

A forked child gets a copy of its parent's memory: the trees of its budgets, their arenas and
ledgers, the locks as they were at that instant (held, perhaps, by a thread that does not
exist in the child), the trace writers with the lines they had buffered. None of it is the
child's: the memory the budgets stand for is the parent's, and what the child would do with
its copy the parent never sees. So, from :func:`os.register_at_fork`, in the child:

- every budget inherited from the parent (every tree whose root had not released) is
  closed to it: an allocation is denied with reason ``forked`` (``AllocationDenied`` with
  ``raise_on_denial=True``), a free of one of its blocks is refused (``False``), a resize
  denied, a budget entered inside one is a root of the child's own (with ``parent=`` one:
  a ``BudgetNestingError``), and its ``with`` block ends without changing anything. Its report stays readable: the
  parent's numbers at the fork, ``state`` ``exited`` where the parent's was ``open``;
- every tree's lock is made anew (``_at_fork_reinit``), so that nothing waits for a thread
  that the fork left behind;
- its trees write no trace and publish nothing in the host ledger: the parent's trace
  files and ledger slots are the parent's (the trace writers drop the inherited buffer, see
  :mod:`gpubudget.tracefile.perpath`, and the ledger's own handler lets go of its slots, see
  :mod:`gpubudget.hostledger.claims`);
- the parent's budgets are not listed as leaks at the child's exit.

Budgets the child enters itself (outside the inherited ones) are its own roots, with their
own reservations and traces, and work as in any process.
"""

from __future__ import annotations

import os
from typing import Final

from .._core import Tree, unreleased
from .snapshot import watch_none

__all__ = ["FORKED", "close_inherited"]

FORKED: Final = "forked"
"""The denial reason of a budget inherited from the parent, in a forked child."""


def close_inherited() -> int:
    """In a forked child: close every budget inherited from the parent, as the module
    docstring says; return how many trees were closed (called at every fork, in the child;
    calling it again changes nothing more)."""
    parent = os.getppid()
    trees = unreleased()
    for tree in trees:
        _close(tree, parent)
    watch_none()  # their leaks, if any, are the parent's to list
    return len(trees)


def _close(tree: Tree, parent: int) -> None:
    reinit = getattr(tree.lock, "_at_fork_reinit", None)
    if reinit is not None:
        reinit()  # another thread may have held it at the fork: it does not exist here
    recorder = tree.recorder
    if recorder.writer is not None:
        recorder.writer = None
        recorder.trace_error = (f"not traced in process {os.getpid()}: the trace is written "
                                f"by process {parent}, from which this one was forked")
    tree.close_to(FORKED)  # no block of it changes: frees refused, resizes denied, no C path
    recorder.published = None  # the parent's words in the host ledger
    if tree.mapping is not None:
        tree.mapping.published = None
    for node in tree.root.subtree():
        node.account.published = None
        if node.state == "released":
            continue
        node.refusal = FORKED
        if node.state == "open":
            node.state = "exited"  # nothing enters inside it, its scope's end changes nothing


os.register_at_fork(after_in_child=close_inherited)
