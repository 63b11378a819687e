"""The host ledger's errors: an unusable ledger directory or file, or a claim refused.

::

    LedgerError            (a BudgetError) the ledger refused a claim, or cannot be used
     └── LedgerUnusable    the ledger cannot be used now: a root with a plain limit enters
          │                unregistered (one warning), one that needs the ledger fails
          ├── LedgerLocked a process has kept the file's lock too long (stopped?)
          ├── LedgerFull   every slot of the device's file is taken by a live root
          └── LedgerDamaged the file says something impossible
"""

from __future__ import annotations

from ..errors import BudgetError

__all__ = ["LedgerDamaged", "LedgerError", "LedgerFull", "LedgerLocked", "LedgerUnusable"]


class LedgerError(BudgetError):
    """The host ledger cannot be used (a directory or file that is unsafe, damaged or of
    another format; a lock held too long; a full file), or refused a root's claim (a device
    cap, a device that is full, nothing left to share). A :class:`~gpubudget.BudgetError`, so
    raised at a root budget's entry like any failure to get its memory; the message names the
    path or the processes and budgets that hold the memory.

    >>> from gpubudget import BudgetError
    >>> issubclass(LedgerError, BudgetError) and issubclass(LedgerError, MemoryError)
    True
    """


class LedgerUnusable(LedgerError):
    """The ledger cannot be used now (not a refusal): a root with a plain limit is entered
    unregistered, with a warning; a root that needs the ledger raises this.

    >>> issubclass(LedgerFull, LedgerUnusable) and issubclass(LedgerUnusable, LedgerError)
    True
    """


class LedgerLocked(LedgerUnusable):
    """Another process has held the ledger file's lock for longer than any change takes (a
    process stopped, or frozen, while it held it)."""


class LedgerFull(LedgerUnusable):
    """Every slot of the device's ledger file belongs to a root budget of a live process."""


class LedgerDamaged(LedgerUnusable):
    """The ledger file holds a value this version never writes there (it was overwritten)."""
