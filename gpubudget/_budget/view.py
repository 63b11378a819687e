"""The questions a budget answers: its numbers and state, its place in the tree, the block
at an address, its report, and whether its bookkeeping holds (``check``).

:class:`BudgetView` is a part of :class:`~gpubudget.budget.Budget` (its base): the budget
itself does things (enter, exit, allocate, free, resize); this reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..backends import Backend
from .._core import Node, State, available
from .snapshot import snapshot
from .stats import memory_stats, memory_summary, reset_accumulated_stats
from ..units import format_size

if TYPE_CHECKING:
    from ..budget import Budget
    from ..report import BudgetReport  # loaded by the first report

__all__ = ["BudgetView"]


class BudgetView:
    """Read-only questions; see the module docstring."""

    __slots__ = ()
    _node: Node

    @property
    def name(self) -> str:
        """The budget's name (given, or ``budget-N``)."""
        return self._node.name

    @property
    def limit(self) -> int:
        """The most bytes this budget (with its children) may be charged."""
        return self._node.account.limit

    @property
    def align(self) -> int:
        """Minimum alignment of this budget's blocks; sizes are rounded up to it."""
        return self._node.align

    @property
    def reserve(self) -> int:
        """Bytes set aside for this budget in its parent (0 for a root or without ``reserve=``;
        rounded up to the alignment at entry)."""
        return self._node.account.reserve

    @property
    def state(self) -> State:
        """``new``, ``open``, ``exited`` or ``released``."""
        return self._node.state

    @property
    def used(self) -> int:
        """Aligned bytes charged now (children's included)."""
        return self._node.account.used

    @property
    def peak(self) -> int:
        """Highest ``used`` reached by granted allocations."""
        return self._node.account.peak

    @property
    def available(self) -> int:
        """Bytes one allocation could still be charged, by this budget's and its ancestors'
        limits (the arena may still be too fragmented to place them); 0 unless it can
        allocate (before entry, after release)."""
        node = self._node
        with node.lock:
            return available(node.account) if node.refusal is None else 0

    @property
    def parent(self) -> Budget | None:
        """The budget this one was entered in, ``None`` for a root (or before entry)."""
        parent = self._node.parent
        return parent.budget if parent is not None else None

    @property
    def root(self) -> Budget:
        """The root of this budget's tree (itself for a root, or before entry).

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     with gpu_budget("1KiB", name="model") as model:
        ...         (model.root.name, pool.root is pool)
        ('pool', True)
        """
        node = self._node
        return node.tree.root.budget if node.tree is not None else node.budget

    @property
    def children(self) -> tuple[Budget, ...]:
        """Budgets entered inside this one (unreleased ones, and the last released ones)."""
        node = self._node
        with node.lock:
            return tuple(child.budget for child in node.children)

    @property
    def backend(self) -> Backend | None:
        """The backend the tree draws from (``None`` before entry)."""
        tree = self._node.tree
        return tree.backend if tree is not None else None

    @property
    def device(self) -> int | None:
        """The CUDA device the tree's memory is on; ``None`` on host memory or before entry.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     pool.device is None
        True
        """
        tree = self._node.tree
        return tree.device if tree is not None else None

    def encloses(self, other: Budget) -> bool:
        """Whether ``other`` is this budget or was entered (directly or not) inside it.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     with gpu_budget("1KiB") as model:
        ...         (pool.encloses(model), model.encloses(pool), pool.encloses(pool))
        (True, False, True)
        """
        if not isinstance(other, BudgetView):
            raise TypeError(f"encloses() takes a Budget, got {other!r}")
        return self._node.encloses(other._node)

    def __repr__(self) -> str:
        node = self._node
        return (f"<Budget {node.name!r} limit={format_size(node.account.limit)} "
                f"used={format_size(node.account.used)} peak={format_size(node.account.peak)} "
                f"{node.state}>")

    def size_of(self, address: int) -> int:
        """Aligned size of the live block at ``address`` in this tree, 0 if none."""
        tree = self._node.tree
        return tree.size_of(address) if tree is not None else 0

    def owner_of(self, address: int) -> Budget | None:
        """The budget of this tree that holds the live block at ``address``, if any."""
        tree = self._node.tree
        entry = tree.owner(address) if tree is not None else None
        return entry.owner.budget if entry is not None else None

    def report(self) -> BudgetReport:
        """A snapshot of this budget and its children; works in every state.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     _ = pool.allocate(4096, tag="weights")
        >>> print(pool.report())  # doctest: +ELLIPSIS
        pool [host] (exited): used 4.00 KiB of 1.00 MiB, peak 4.00 KiB
          allocations 1, frees 0, denied 0
        ...
        """
        return snapshot(self._node)

    def memory_stats(self) -> dict[str, int]:
        """This budget's counters, with those of the budgets inside it, as a flat dict in
        the key style of ``torch.cuda.memory_stats()``. Every number covers the subtree, as
        every row of :meth:`memory_summary` does.

        ``allocated_bytes.all.current`` and ``.peak`` are :attr:`used` and :attr:`peak`
        (aligned bytes charged, a child's ``reserve`` included); ``.allocated`` and
        ``.freed`` the aligned bytes ever allocated and freed (a resize counts its growth
        or shrink). ``allocation.all.current`` counts live blocks, ``.allocated`` and
        ``.freed`` allocations and frees. ``num_ooms`` counts denied requests: the
        allocations PyTorch would have answered with an out-of-memory error. The last four
        accumulate until :meth:`reset_accumulated_stats`.

        Absent, because nothing here answers them: ``num_alloc_retries`` (a denial is
        final, there is no cache to flush and retry), ``reserved_bytes.*`` and
        ``segment.*`` (a root reserves its limit once: :attr:`limit`), ``active_*``,
        ``inactive_split*``, ``oversize_*`` and ``max_split_size`` (no caching, splitting
        or streams' pending frees counted apart), ``requested_bytes.*`` (sizes are kept
        aligned), ``allocation.all.peak`` (the most blocks held at once is kept per budget,
        not per subtree: ``report().peak_blocks``), and the ``large_pool``/``small_pool``
        splits (one pool: only ``all``).

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     block = pool.allocate(1000)
        ...     _ = pool.free(block)
        ...     _ = pool.allocate(2**21)
        ...     stats = pool.memory_stats()
        >>> stats["allocated_bytes.all.allocated"], stats["allocation.all.freed"]
        (1024, 1)
        >>> stats["allocated_bytes.all.current"], stats["num_ooms"]
        (0, 1)
        """
        return memory_stats(self)

    def reset_accumulated_stats(self) -> None:
        """Start the accumulated counters of :meth:`memory_stats` (bytes allocated and
        freed, allocations, frees, ``num_ooms``) again from zero, for this budget object
        (the report keeps counting from entry). :meth:`reset_peak` restarts the peaks.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     block = pool.allocate(1000)
        ...     pool.reset_accumulated_stats()
        ...     _ = pool.allocate(4096)
        ...     stats = pool.memory_stats()
        >>> stats["allocation.all.allocated"], stats["allocation.all.current"]
        (1, 2)
        """
        reset_accumulated_stats(self)

    def memory_summary(self) -> str:
        """A table of this budget and every budget inside it, one row each (state, used,
        peak, limit, allocations, frees, denials, live blocks), parents before children;
        :meth:`report` gives the details. Each row counts its budget's subtree, as
        :meth:`memory_stats` does (here from entry, whatever was reset): the budget and the
        budgets inside it.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", name="pool", backend="host") as pool:
        ...     with gpu_budget("64KiB", name="model") as model:
        ...         _ = model.allocate(4096)
        ...     print(pool.memory_summary())  # doctest: +NORMALIZE_WHITESPACE
        budget     state          used       peak      limit   allocs    frees  denied   live
        pool       open       4.00 KiB   4.00 KiB   1.00 MiB        1        0       0      1
        └─ model   exited     4.00 KiB   4.00 KiB  64.00 KiB        1        0       0      1
        """
        return memory_summary(self.report())

    def check(self) -> None:
        """Verify the tree's bookkeeping: the arena's invariants, that its taken blocks are
        exactly the live and pending ones, and that every budget's ``used`` is its blocks
        plus its children's share. Raises :class:`~gpubudget.errors.InvariantError` naming
        the rule that does not hold; does nothing before entry.

        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("1MiB", backend="host") as pool:
        ...     block = pool.allocate(1000)
        ...     pool.check()
        """
        tree = self._node.tree
        if tree is not None:
            tree.check()
