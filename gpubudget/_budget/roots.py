"""Root budgets: how one is opened (:func:`open_root`), the roots open in this process, the
thread-pool trap they let us see, and the budget that holds a block (:func:`holder`).

A root opens in one direction: the host ledger decides its limit and claims its slot
(:func:`~gpubudget.hostledger.claims.claim_root`: a share sized, a cap enforced), the core
reserves that limit and opens the root's tree (``Node.open_root``, which makes the root's
account once), and the root's numbers are then stored into the slot (``Node.publish``). The
ledger never calls into the core; if the core cannot reserve, the slot is freed and nothing
is left behind.

A new thread starts with no active budget, so a plain ``gpu_budget(...)`` there is a new root
with a reservation of its own, not a share of the pool the program opened elsewhere.
:func:`warn_if_thread_trap` warns about it (see ``Budget``); :func:`opened` keeps the roots it
looks at.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Final

from .. import context
from . import forks  # noqa: F401 - imported for its handler: a forked child's budgets
from .._core import Node, Tree, unreleased
from .. import door
from ..backends import Backend
from ..callers import user_stacklevel
from ..errors import BudgetError
from ..units import format_size

if TYPE_CHECKING:
    from ..budget import Budget  # only named: budget.py imports this module
    from ..hostledger import Share
    from ..tracefile import TraceWriter

__all__ = ["THREAD_ROOT", "holder", "open_root", "opened", "warn_if_thread_trap"]

THREAD_ROOT: Final = "gpubudget: new root budget in a thread"
"""How the warning about a root entered in a thread while another is open begins: the
``message`` of a ``warnings.filterwarnings("ignore", message=...)`` that silences it."""
_open_roots: Final[weakref.WeakSet[Budget]] = weakref.WeakSet()  # roots entered, maybe open
_open_roots_lock: Final = threading.Lock()
os.register_at_fork(after_in_child=getattr(_open_roots_lock, "_at_fork_reinit"))


def _load_the_rest() -> None:
    """Load what an open root's budgets would otherwise load on first use (the first report,
    a size with decimals, the door's numbers), so that no import runs inside ``allocate``,
    ``free``, ``report`` or a child's entry once a root is open. CPython's import system
    catches ``OSError`` while it looks for a module's file, and a signal handler's
    ``TimeoutError`` is one: landing in an import, it could be lost, or turned into a
    ``ModuleNotFoundError`` of a module that is there (seen with a SIGALRM handler)."""
    if _loaded:
        return
    import decimal  # noqa: F401 - units.parse_size("1.5GiB")
    import json  # noqa: F401 - text.quote, the report's JSON
    from .. import report  # noqa: F401 - with dataclasses and json (jsontext)
    from ..door import records  # noqa: F401

    _loaded.append(True)


_loaded: Final[list[bool]] = []


def open_root(node: Node, backend: Backend, writer: TraceWriter | None, request: int | Share,
              initial: int | None) -> Tree:
    """Open ``node`` as a root on ``backend`` (see the module docstring): ``request`` its
    limit in bytes, or a share of the device; ``initial`` a growable root's memory at entry.
    ``BudgetError`` (``LedgerError`` from the ledger), with nothing held, if it cannot."""
    from ..hostledger.claims import claim_root  # loaded at the first root's entry

    _load_the_rest()
    limit, claim = claim_root(backend, node.name, request, node.align, initial)
    if claim is None:  # not registered: nothing to publish
        return _opened_under_door(node, backend, writer, limit, initial)
    try:
        tree = _opened_under_door(node, backend, writer, limit, initial)
    except BudgetError as exc:
        raise claim.refused(exc) from exc.__cause__
    except BaseException:
        claim.release()
        raise
    reservation = tree.reservation
    assert reservation is not None
    held = tree.mapping.mapped_bytes if tree.mapping is not None else reservation.nbytes
    slot = claim.reserved(reservation, held, lambda: node.publish(None), node.account)
    tree.reservation = slot.reservation
    node.publish(slot.numbers, slot.mapped, slot.family)
    door.registered(node.budget, claim.serial)  # the door file names it as the ledger does
    return tree


def _opened_under_door(node: Node, backend: Backend, writer: TraceWriter | None, limit: int,
                       initial: int | None) -> Tree:
    """``node.open_root``; where the driver door is loaded, the driver memory the backend
    takes is the root's own there (counted against its limit, not charged twice), and so is
    each granule a growable root maps later."""
    with door.owning(node.budget, limit):
        tree = node.open_root(backend, writer, limit, initial)
    tree.door_view = door.device_view(node.budget)
    if tree.mapping is not None:
        tree.mapping.door = door.owner_of(node.budget)
    return tree


def opened(root: Budget) -> None:
    """``root`` was entered as a root budget."""
    with _open_roots_lock:
        _open_roots.add(root)


def holder(address: int) -> Budget | None:
    """The budget of this process that holds the live block at ``address``, if any (a live
    block's root has not released, so every tree that may hold it is looked at).

    >>> from gpubudget import gpu_budget
    >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
    ...     block = pool.allocate(100)
    ...     (holder(block).name, holder(block + 1), pool.free(block))
    ('pool', None, True)
    """
    for tree in unreleased():
        entry = tree.owner(address)
        if entry is not None:
            found: Budget = entry.owner.budget
            return found
    return None


def warn_if_thread_trap(root: Budget) -> None:
    """Warn (one ``RuntimeWarning`` at the user's line) when ``root``, about to open as a
    root in a thread other than the main one, is probably meant as a share of a root open
    elsewhere: the thread-pool trap (a new thread starts with no active budget)."""
    if threading.current_thread() is threading.main_thread() or context.SEPARATE_ROOTS.get():
        return
    with _open_roots_lock:
        for entered in list(_open_roots):
            if entered.state != "open":
                _open_roots.discard(entered)
        other = next(iter(_open_roots), None)
    if other is None:
        return
    warnings.warn(
        f"{THREAD_ROOT}: {root.name!r} ({format_size(root.limit)}) is entered in thread "
        f"{threading.current_thread().name!r}, where no budget is active, while root budget "
        f"{other.name!r} is open in this process, so it reserves memory of its own instead "
        f"of drawing from {other.name!r}. To make it a child, enter it inside "
        f"`with gpubudget.use(parent):`, or pass `gpu_budget(..., parent=parent)`, or submit "
        f"`gpubudget.bind(fn)` to the thread pool (it carries the budgets active where it is "
        f"called); parent: {other.name!r} or a budget under it. If a separate root is meant: "
        f"warnings.filterwarnings('ignore', message={THREAD_ROOT!r})",
        RuntimeWarning, stacklevel=user_stacklevel())
