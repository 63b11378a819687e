"""The budget layer's plumbing (private): what makes and serves
:class:`~gpubudget.budget.Budget`, behind the public face (``budget.py``, ``scope.py``,
``adapter.py``).

Its modules: ``Budget``'s three bases, :mod:`.view` (what a budget answers), :mod:`.hooks`
(what adapters call on it) and :mod:`.residency` (a growable root's memory); the reports of a
live tree, :mod:`.snapshot` (``report()``, leaks at exit) and :mod:`.stats`
(``memory_stats()``, ``memory_summary()``); :mod:`.arguments` (``gpu_budget``'s arguments
checked once); :mod:`.roots` (a root opened, the roots open in the process, the thread-pool
trap, the budget that holds a block); :mod:`.forks` (budgets inherited by a forked child,
closed to it).

This module is its door: the face imports these names from here, and nothing else of the
package imports this folder (``tests/test_layers.py`` checks it).
"""

from __future__ import annotations

from .arguments import checked
from .forks import FORKED
from .hooks import Hooks
from .residency import Residency
from .roots import THREAD_ROOT, holder, open_root, opened, warn_if_thread_trap
from .snapshot import watch_leaks
from .view import BudgetView

__all__ = ["FORKED", "THREAD_ROOT", "Hooks", "BudgetView", "Residency", "checked",
           "holder", "open_root", "opened", "warn_if_thread_trap", "watch_leaks"]
