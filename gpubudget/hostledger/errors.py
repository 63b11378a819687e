"""The host ledger's error: an unusable ledger directory or file, or a claim refused."""

from __future__ import annotations

from ..errors import BudgetError

__all__ = ["LedgerError"]


class LedgerError(BudgetError):
    """The host ledger cannot be used (a directory or file that is unsafe, damaged or of
    another format; a lock held too long), or refused a root's claim (a device cap, a device
    that is full, nothing left to share). A :class:`~gpubudget.BudgetError`, so raised at a
    root budget's entry like any failure to get its memory; the message names the path or the
    processes and budgets that hold the memory.

    >>> from gpubudget import BudgetError
    >>> issubclass(LedgerError, BudgetError) and issubclass(LedgerError, MemoryError)
    True
    """
