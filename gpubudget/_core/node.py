"""A budget's place in its tree: the plumbing behind what the user holds.

:class:`Node` holds one budget's :class:`~gpubudget.ledger.Account` and
:class:`~gpubudget.recorder.Stats`, its parent and children, its state (``new`` -> ``open``
-> ``exited`` -> ``released``) and what keeps it from being released: live blocks, pins
(objects such as a TensorRT runtime that may still allocate through it) and unreleased
children. Entering a root makes the :class:`~gpubudget.tree.Tree` its budgets share;
entering a child sets its reserve aside in the parent. Released children beyond the last
:data:`KEEP_RELEASED_CHILDREN` are dropped from the list, their counts folded into the
parent's.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Literal

from ..backends import Backend
from ..callers import frame_text
from ..context import LABEL
from ..errors import BudgetError, BudgetNestingError, raise_if_from_outside
from .ledger import Account, charge, claim, encloses, passed_up
from .memory import Mapping
from ..extensions import extension
from .recorder import Recorder, Stats
from .streams import PendingFrees
from .tree import Tree, new_lock
from ..units import format_size, round_up

native: Final = extension("_core", "_native")  # the C core, or None

if TYPE_CHECKING:
    from ..budget import (
        Budget,  # the public face; only named here, never imported at run time
    )
    from ..tracefile import TraceWriter
    from .recorder import Family

__all__ = ["KEEP_RELEASED_CHILDREN", "Node", "Probe", "State", "install_fast_path"]

State = Literal["new", "open", "exited", "released"]
Probe = Callable[[], tuple[int, ...]]
"""An adapter's usage of a budget: (bytes charged, bytes in live arrays or tensors[, bytes
libraries keep across calls, bytes of library memory outside budgets])."""
KEEP_RELEASED_CHILDREN: Final = 32
"""Released children a budget keeps listing (in ``children`` and reports), the most recent."""
_ids = itertools.count(1)


class Node:
    """A budget's place in its tree; see the module docstring.

    ``budget`` is the public object (what ``owner_of`` answers). ``lock`` is the tree's once
    entered (a lock of its own before). ``refusal`` is the denial reason while the budget
    cannot allocate (``inactive`` before entry, ``released`` after), else ``None``.
    """

    __slots__ = ("budget", "id", "name", "align", "track_stacks", "account", "stats", "lock",
                 "tree", "parent", "children", "granularity", "state", "refusal", "pins",
                 "unreleased", "probes", "exit_hooks", "trim_on_exit")

    def __init__(self, budget: Budget, name: str | None, limit: int, reserve: int, align: int,
                 track_stacks: bool) -> None:
        self.budget: Final = budget
        self.id: Final = next(_ids)
        self.name: Final = name if name is not None else f"budget-{self.id}"
        self.align: Final = align
        self.track_stacks = track_stacks  # also true when an ancestor tracks stacks
        self.account = Account(self.name, limit, reserve)  # re-made under the parent at entry
        self.stats: Final = Stats()
        self.lock = new_lock()  # the tree's once entered
        self.tree: Tree | None = None
        self.parent: Node | None = None
        self.children: list[Node] = []  # unreleased ones and the last released ones
        self.granularity = align  # max(align, the parent's): every block is a multiple
        self.state: State = "new"
        self.refusal: str | None = "inactive"
        self.pins = 0  # objects (a TensorRT runtime) that may still allocate through it
        self.unreleased = 0  # children entered and not yet released
        self.probes: dict[str, Probe] = {}  # adapters' usage, read for reports
        self.trim_on_exit = False  # a growable root: trim when a child's scope ends
        self.exit_hooks: list[Callable[[], None]] = []  # adapters' calls when the scope ends

    # -- entering --------------------------------------------------------------------------

    def open_root(self, backend: Backend, writer: TraceWriter | None, limit: int,
                  initial: int | None = None) -> Tree:
        """Open as a root of ``limit`` bytes (decided before: by the host ledger), reserved
        whole from ``backend`` (``initial``: reserve addresses for it and map ``initial``
        bytes); ``BudgetError``, and nothing changed, if it cannot."""
        tree = Tree(self, backend, writer, limit, initial)
        self.account = Account(self.name, limit)  # a root holds its whole limit: no reserve
        self.tree = tree
        self.lock = tree.lock
        self._opened()
        return tree

    def publish(self, numbers: memoryview | None, mapped: memoryview | None = None,
                family: Family | None = None) -> None:
        """An open root: from now on store its ``used`` and ``peak`` in ``numbers[0]`` and
        ``numbers[1]`` (with plain stores, at every change: see ``ledger.charge``), count its
        tree's denials in ``numbers[2]``, a growable root's mapped bytes in ``mapped[0]``,
        and tell ``family`` as child budgets come and go (each one's numbers are stored in
        its row the same way): its words in its slot of the host ledger, for other processes
        to read. ``None``: no more (the slot went)."""
        tree = self.tree
        assert tree is not None and self.parent is None
        account = self.account
        if numbers is not None:
            numbers[0], numbers[1] = account.used, account.peak
        account.published = tree.recorder.published = numbers
        tree.recorder.family = family if numbers is not None else None
        if tree.mapping is not None:
            tree.mapping.published = mapped

    def open_child(self, parent: Node) -> None:
        """Enter under ``parent``, setting aside this budget's reserve there."""
        tree = parent.tree
        if tree is None:
            raise BudgetNestingError(f"budget {self.name!r} entered inside {parent.name!r}, "
                                     f"which is {parent.state}")
        try:
            tree.turns.waiting += 1  # counted (see locks.let_in)
            with tree.lock:
                tree.turns.arrived()
                self._open_under(parent, tree)
        except BaseException:
            tree.fault()
            raise

    def _open_under(self, parent: Node, tree: Tree) -> None:
        """The tree's lock held: check ``parent``, set the reserve aside, join the tree."""
        if parent.state != "open":
            raise BudgetNestingError(f"budget {self.name!r} entered inside "
                                     f"{parent.name!r}, which is {parent.state}")
        granularity = max(self.align, parent.granularity)
        reserve = round_up(self.account.reserve, granularity)
        account = Account(self.name, self.account.limit, reserve, parent.account)
        if reserve:
            refused = claim(parent.account, reserve)  # charged at once below
            if refused is not None:
                raise BudgetError(
                    f"budget {self.name!r} cannot set aside reserve {format_size(reserve)}: "
                    f"{refused.name!r} has {format_size(refused.limit - refused.used)} "
                    f"left of {format_size(refused.limit)}")
            charge(parent.account, reserve)
        self.account = account
        self.parent = parent
        self.tree = tree
        self.lock = tree.lock
        self.granularity = granularity
        self.track_stacks = self.track_stacks or parent.track_stacks
        parent.children.append(self)
        parent.unreleased += 1
        self._opened()
        tree.recorder.child_entered(account, parent.account, self.id, self.name)  # host ledger

    def _opened(self) -> None:
        assert self.tree is not None
        self.state = "open"
        self.refusal = None
        account = self.account
        self.tree.recorder.entered(
            self.id, self.name, self.parent.id if self.parent is not None else None,
            account.limit, self.align, account.reserve, self.tree.backend.name)

    # -- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        """The scope ended: stop being ``open``, release if nothing holds the budget, then
        run the adapters' exit hooks (outside the lock; one that fails is reported)."""
        tree = self.tree
        if tree is None:
            return
        if self.parent is None:
            tree.note_free_at_exit()
        hooks: list[Callable[[], None]] = []
        try:
            tree.turns.waiting += 1  # counted (see locks.let_in)
            with tree.lock:
                tree.turns.arrived()
                if self.state == "open":
                    self.state = "exited"
                    hooks, self.exit_hooks = self.exit_hooks, []
                    tree.recorder.exited(self.id, root=self.parent is None)
                    self.release_if_unused()
                    if self.parent is not None and tree.root.trim_on_exit:
                        tree.trim()
        except BaseException:
            tree.fault()
            raise
        finally:
            for hook in hooks:  # run whatever lands meanwhile: an adapter's pools go back
                try:
                    hook()
                except Exception as exc:  # noqa: BLE001 - leaving never fails for an adapter
                    raise_if_from_outside(exc)
                    tree.note_error(self, f"exit hook: {type(exc).__name__}: {exc}")

    def release_if_unused(self) -> None:
        """Lock held: release this budget, then each ancestor it was the last hold on, once
        exited with no live block, no pin and no unreleased child."""
        node: Node | None = self
        while node is not None and node.releasable():
            node.state = "released"
            node.refusal = "released"
            parent = node.parent
            if parent is None:
                assert node.tree is not None
                node.tree.release_reservation()
                return
            if node.tree is not None:
                node.tree.recorder.child_released(node.account)  # host ledger
            if node.account.reserve:
                charge(parent.account, -passed_up(node.account, node.account.used))
            parent.unreleased -= 1
            released = [child for child in parent.children if child.state == "released"]
            for child in released[: max(len(released) - KEEP_RELEASED_CHILDREN, 0)]:
                parent.children.remove(child)
                parent.stats.retired = [sum(counts) for counts in zip(
                    parent.stats.retired, *(member.own_counts() for member in child.subtree()))]
            node = parent

    def releasable(self) -> bool:
        return (self.state == "exited" and not self.stats.blocks and not self.pins
                and not self.unreleased)

    def own_counts(self) -> tuple[int, int, int, int, int]:
        """Allocations, frees, denials, bytes allocated and bytes freed of this budget, with
        those of descendants it no longer lists."""
        stats, retired = self.stats, self.stats.retired
        return (stats.allocations + retired[0], stats.frees + retired[1],
                stats.denied + retired[2], stats.bytes_allocated + retired[3],
                stats.bytes_freed + retired[4])

    def reset_peaks(self) -> None:
        """Lock held: peaks of this budget and its descendants start again from now."""
        for node in self.subtree():
            node.account.peak = node.account.used
            node.stats.reset_peaks()

    # -- the tree below --------------------------------------------------------------------

    def subtree(self) -> list[Node]:
        """This node and every descendant still listed, depth first, parents first."""
        found: list[Node] = []
        stack = [self]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(reversed(node.children))
        return found

    def encloses(self, other: Node) -> bool:
        """Whether ``other`` is this node or one of its descendants."""
        return encloses(self.account, other.account)


def install_fast_path(budget: type) -> bool:
    """Where the C core runs, make ``budget.allocate`` and ``budget.free`` (the ``Budget``
    class's) C methods that do the common case whole and call the Python methods they
    replace for everything else; ``False`` where the pure-Python core runs."""
    if native is None:
        return False
    native.install(budget=budget, node=Node, tree=Tree, recorder=Recorder,
                   pending=PendingFrees, mapping=Mapping, label=LABEL,
                   clock=time.perf_counter, frame_text=frame_text)
    return True
