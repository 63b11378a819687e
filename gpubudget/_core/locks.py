"""The lock of a tree: re-entrant, the C core's where it runs, and how every operation holds it
(:func:`unlock`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import cast

from . import native

__all__ = ["RLock", "new_lock", "owns", "unlock"]

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


def owns(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock``."""
    is_owned: Callable[[], bool] = getattr(lock, "_is_owned")  # CPython's RLock: by me?
    return is_owned()


