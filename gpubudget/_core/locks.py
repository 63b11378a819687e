"""The lock of a tree: re-entrant, the C core's where it runs, and how every operation holds it
(:func:`unlock`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Final, cast

from . import native

__all__ = ["RLock", "Turns", "let_in", "new_lock", "owns", "take", "unlock", "wait"]

RLock = threading.RLock


def new_lock() -> threading.RLock:
    """A re-entrant lock: the C core's (which its fast path takes without calling Python), or
    ``threading.RLock``; the same methods (``acquire``, ``release``, ``_is_owned``,
    ``_at_fork_reinit``, ``with``)."""
    return cast(threading.RLock, native.Lock()) if native is not None else threading.RLock()


def unlock(lock: threading.RLock) -> None:
    """Release ``lock`` if this thread holds it: what an operation's ``except`` does.

    Every method that takes a tree's lock has the same shape::

        try:
            lock.acquire()
            ...  # no return, no nested try
            lock.release()
        except BaseException:
            unlock(lock)
            raise

    An asynchronous exception (a signal handler's, ``PyThreadState_SetAsyncExc``, a trace
    function's) may land before any instruction. Before ``acquire`` returns, the lock is not
    held; from then until ``release`` has returned, the ``except`` releases it. No
    instruction is outside ``try``, as the one between ``lock.acquire()`` and ``try:`` was;
    nor after the body, as the call of ``__exit__`` after a ``with`` block is (CPython
    covers it with no handler), nor at a nested ``try:`` (CPython 3.11 leaves its first
    instruction outside every handler): the locked part has no ``return`` and calls helpers
    for the rest. An operation that changes blocks calls ``Tree.fault`` there instead,
    which also puts the tree right if the exception cut the operation short while it held
    the lock (see :mod:`~gpubudget._core.recovery`). ``tests/test_tree.py`` raises at every
    instruction in turn. The lock is
    re-entrant so that this can tell whether this thread still holds it, and so that a
    moving ``resize`` can allocate, copy and free while holding it (nothing else takes it
    twice).
    """
    if owns(lock):
        lock.release()


class Turns:
    """Who waits for a tree's lock: threads blocked in :func:`take` now (``waiting``), and
    how many took it after waiting (``served``). The lock is not fair: a thread that
    releases it and asks again at once gets it before the thread it woke, and one that does
    so in a loop (``trim()`` called over and over) can keep the others out as long as it
    runs. :func:`let_in` is that thread's way to give them their turn."""

    __slots__ = ("waiting", "served")

    def __init__(self) -> None:
        self.waiting = 0
        self.served = 0


def take(lock: threading.RLock, turns: Turns) -> None:
    """Take ``lock`` (an operation's first step, inside its ``try``), counted in ``turns``
    when it has to wait."""
    if not lock.acquire(False):
        wait(lock, turns)


def wait(lock: threading.RLock, turns: Turns) -> None:
    """Take ``lock``, held by another thread, counted in ``turns`` while waiting."""
    turns.waiting += 1
    try:
        lock.acquire()
        turns.served += 1
    finally:
        turns.waiting -= 1


def let_in(turns: Turns) -> None:
    """Just after releasing a tree's lock, before taking it again: if threads wait for it,
    wait until one of them has taken it (at most :data:`_LET_IN_SECONDS`: the counts are
    only a hint where an exception cut a wait short)."""
    if turns.waiting <= 0:
        return
    served = turns.served
    deadline = time.monotonic() + _LET_IN_SECONDS
    while turns.waiting > 0 and turns.served == served and time.monotonic() < deadline:
        time.sleep(0)  # lets the woken thread run and take the lock


_LET_IN_SECONDS: Final = 1.0


def owns(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock``."""
    is_owned: Callable[[], bool] = getattr(lock, "_is_owned")  # CPython's RLock: by me?
    return is_owned()


