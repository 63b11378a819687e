"""Exceptions raised by gpubudget at the Python API.

::

    Exception
     └── GpuBudgetError                 anything gpubudget raises on purpose
          ├── BudgetError               (also MemoryError) a budget cannot get its memory:
          │    │                        the device refused the root reservation, the parent
          │    │                        cannot set aside a child's ``reserve=``, or no budget
          │    │                        is active where one is required
          │    ├── AllocationDenied     ``allocate(..., raise_on_denial=True)`` was refused;
          │    │                        says which budget refused, why, and the sizes
          │    ├── LedgerError          (gpubudget.hostledger) the host ledger refused a
          │    │                        root's claim (naming who holds the memory) or cannot
          │    │                        be used (naming the path and what is wrong)
          │    └── TraceWriteError      (also a TraceError) a root's ``trace=`` file cannot
          │                             be written: entering the root fails
          ├── BudgetNestingError        (also RuntimeError) a budget exited out of order, or
          │                             in a context where it is not active
          ├── BackendError              a backend is unknown or unusable
          ├── TraceError                (also ValueError) a trace file cannot be written
          │                             (a TraceWriteError: one line saying why: a link,
          │                             not a trace of this user's, written by another
          │                             process...) or read (missing, malformed, newer)
          └── InvariantError            (also AssertionError) ``check()`` found bookkeeping
                                        that disagrees; ``invariant`` names the rule

Bad arguments raise the built-in ``ValueError``/``TypeError`` with the offending input quoted.
Nothing here is ever raised inside a TensorRT callback: callbacks answer ``None``/``False``.

Code of gpubudget that expects a system call's failure (``except OSError``), or a backend's
(``except Exception``), hands what it caught to :func:`raise_if_from_outside` first: an
``OSError`` that no system call raised, such as the ``TimeoutError`` of a ``SIGALRM``
handler, is raised again rather than taken for the failure expected.
"""

from __future__ import annotations

__all__ = [
    "AllocationDenied",
    "BackendError",
    "BudgetError",
    "BudgetNestingError",
    "GpuBudgetError",
    "InvariantError",
    "TraceError",
    "TraceWriteError",
]


class GpuBudgetError(Exception):
    """Base class of every exception gpubudget raises on purpose."""


class BudgetError(GpuBudgetError, MemoryError):
    """A budget could not obtain the memory it needs (raised at entry, never in a callback)."""


class AllocationDenied(BudgetError):
    """An allocation asked with ``raise_on_denial=True`` was refused.

    ``budget`` is the name of the budget asked, ``refused_by`` the name of the budget whose
    limit or arena refused (itself or an ancestor), ``reason`` the denial reason as the
    report counts it, ``size`` the bytes asked and ``charged`` the aligned bytes.
    """

    def __init__(
        self, message: str, *, budget: str, refused_by: str, reason: str, size: int, charged: int
    ) -> None:
        super().__init__(message)
        self.budget = budget
        self.refused_by = refused_by
        self.reason = reason
        self.size = size
        self.charged = charged


class BudgetNestingError(GpuBudgetError, RuntimeError):
    """A budget was exited while a budget entered inside it was still active, or in a
    thread or task where it is not active."""


class BackendError(GpuBudgetError):
    """A memory backend is unknown or cannot be used on this machine."""


class TraceError(GpuBudgetError, ValueError):
    """A trace file cannot be written (``trace=``) or is missing, unreadable, malformed or of
    a newer version; the message is one line naming the file and what is wrong."""


class TraceWriteError(TraceError, BudgetError):
    """A trace file cannot be written: the root budget that names it (``trace=``) cannot be
    entered. Both a :class:`TraceError` and a :class:`BudgetError`, so that a program that
    catches either around ``with gpu_budget(...)`` catches it.

    >>> issubclass(TraceWriteError, BudgetError) and issubclass(TraceWriteError, TraceError)
    True
    """


def raise_if_from_outside(exc: BaseException) -> None:
    """Raise ``exc`` again, as it is, if it is an ``OSError`` without an error number: no
    system call's failure, but an exception from outside (a signal handler's
    ``TimeoutError`` landing in the ``try``). For the ``except`` of code that expects a
    system call's or a backend's failure; anything else is left to it.

    >>> try:
    ...     try:
    ...         raise TimeoutError("the alarm")
    ...     except OSError as exc:
    ...         raise_if_from_outside(exc)
    ...         print("taken for the file's failure")
    ... except TimeoutError as exc:
    ...     print("propagated:", exc)
    propagated: the alarm
    >>> raise_if_from_outside(FileNotFoundError(2, "No such file"))  # a system call's: kept
    """
    if isinstance(exc, OSError) and exc.errno is None:
        raise exc


class InvariantError(GpuBudgetError, AssertionError):
    """A bookkeeping invariant does not hold; ``invariant`` names it (see ``check()``)."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"invariant {invariant} violated: {detail}")
        self.invariant = invariant
