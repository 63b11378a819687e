"""The lock of a tree: re-entrant, the C core's where it runs, and the turns of the threads
waiting for it.

Every operation holds it in a ``with`` block (or ``try``/``finally``): nothing else. A
``with`` block releases it whatever is raised inside, a Ctrl-C or a signal handler's
exception included (Python runs signal handlers between instructions that a ``with`` block
covers: after a call returns, at a function's start, at a loop's end).
``tests/test_layers.py`` checks that no module takes a tree's lock any other way.
"""

from __future__ import annotations

import threading
import time
from typing import Final, cast

from . import native

__all__ = ["Turns", "let_in", "new_lock"]


def new_lock() -> threading.RLock:
    """A re-entrant lock: the C core's (which its fast path takes without calling Python), or
    ``threading.RLock``; the same methods (``acquire``, ``release``, ``_at_fork_reinit``,
    ``with``)."""
    return cast(threading.RLock, native.Lock()) if native is not None else threading.RLock()


class Turns:
    """Who waits for a tree's lock: ``waiting`` counts the Python operations on their way in
    (each adds one before its ``with`` block and, through :meth:`arrived`, takes it back as
    its first step inside); ``served`` counts those that got in. The lock is not fair: a
    thread that releases it and asks again at once gets it before the thread it woke, and
    one that does so in a loop (``trim()`` called over and over) can keep the others out as
    long as it runs. :func:`let_in` is that thread's way to give them their turn."""

    __slots__ = ("waiting", "served")

    def __init__(self) -> None:
        self.waiting = 0
        self.served = 0

    def arrived(self) -> None:
        """The lock just taken (the first step inside the ``with`` block)."""
        self.waiting -= 1
        self.served += 1


def let_in(turns: Turns) -> None:
    """Just after releasing a tree's lock, before taking it again: if threads wait for it,
    wait until one of them has taken it (at most :data:`_LET_IN_SECONDS`; the count is a
    hint, and one left behind by a wait that an exception cut short is forgotten then)."""
    if turns.waiting <= 0:
        return
    served = turns.served
    deadline = time.monotonic() + _LET_IN_SECONDS
    while turns.waiting > 0 and turns.served == served:
        if time.monotonic() >= deadline:
            turns.waiting = 0  # nobody came: a count an interrupted wait left behind
            return
        time.sleep(0)  # lets the woken thread run and take the lock


_LET_IN_SECONDS: Final = 1.0
