"""The allocation core (private: the budget layer uses it, through this module alone; users
and the rest of the package do not, and tests may reach inside).

Its modules: :mod:`.arena` (placement), :mod:`.ledger` (limits and charges), :mod:`.streams`
(stream-ordered frees), :mod:`.recorder` (statistics, event log, trace), :mod:`.memory` (a
root's memory), :mod:`.registry` (the live blocks), :mod:`.locks` (a tree's lock),
:mod:`.recovery` (a tree put right after a fault), :mod:`.tree` and :mod:`.node` (a root's
tree and its budgets). This module is the core's one door: the names at its end are what the
budget layer uses (``tests/test_layers.py`` checks that nothing imports the modules behind it).

The hot path has two implementations with one behaviour: these modules in Python, and the C
extension ``_native``, built by ``setup.py`` where a C compiler is at hand from the ``.c``
files here (one per concept, named after the Python module it mirrors; ``native.h`` declares
what they share, ``_native.c`` makes the module). :data:`native` is the extension when it
runs, else ``None`` (:mod:`gpubudget.extensions` says when); ``gpubudget.compiled`` says the
same.

Both are tested side by side: ``tests/test_native.py`` runs the same random and adversarial
operations through each and compares every answer and every number.
"""

from __future__ import annotations

from types import ModuleType
from typing import Final

from ..extensions import extension

__all__ = ["native"]

native: Final[ModuleType | None] = extension("_core", "_native")
"""The C extension when it runs, else ``None``."""


# The door: the names the budget layer uses.
from .ledger import available
from .locks import let_in
from .memory import Mapping
from .node import Node, Probe, State, install_fast_path
from .recorder import EVENT_LOG_LIMIT
from .registry import LiveEntry
from .tree import Denied, Tree, unreleased

__all__ += ["EVENT_LOG_LIMIT", "Denied", "LiveEntry", "Mapping", "Node", "Probe", "State", "Tree",
            "available", "install_fast_path", "let_in", "unreleased"]
