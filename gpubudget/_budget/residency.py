"""What a growable root (``gpu_budget(limit, initial=...)``) does with its physical memory:
give back what no block uses (:meth:`Residency.trim`), sleep (:meth:`Residency.offload`: live
blocks copied to pinned host memory, every granule unmapped, the addresses kept) and wake
(:meth:`Residency.restore`: mapped again, the bytes copied back to the same addresses).

:class:`Residency` is a part of :class:`~gpubudget.budget.Budget` (one of its bases). The
work is done by the tree's :class:`~gpubudget._core.memory.Mapping`, with the tree's lock held.
While a budget sleeps, its tree refuses allocations and resizes (``asleep``) and frees
complete at once (nothing on the device can be using the memory); nothing may read or
write its blocks (kernels queued before ``offload`` are waited for).
"""

from __future__ import annotations

from typing import Literal

from ..errors import BudgetError
from .._core import Mapping, Node, Tree, let_in

__all__ = ["Residency"]


class Residency:
    """Methods of a growable root; see the module docstring."""

    __slots__ = ()
    _node: Node

    @property
    def mapped(self) -> int | None:
        """Bytes of device memory this budget's tree has mapped now: a growable root maps
        them as blocks need them; ``None`` for a root that reserved its whole limit (or a
        budget not entered)."""
        tree = self._node.tree
        mapping = tree.mapping if tree is not None else None
        return mapping.mapped_bytes if mapping is not None else None

    def _growable(self, what: str) -> tuple[Tree, Mapping]:
        node = self._node
        tree = node.tree
        if node.parent is not None:
            why = "a child: the tree's memory is its root's"
        elif tree is None or node.state not in ("open", "exited"):
            why = node.state
        elif tree.mapping is None:
            why = "a root that reserved its whole limit (no initial=)"
        else:
            return tree, tree.mapping
        raise BudgetError(f"{what} is for a growable root budget (entered with initial=) that "
                          f"has not released; budget {node.name!r} is {why}")

    def trim(self) -> int:
        """Give back the device memory of every granule that no block touches; the bytes.
        A thread may call it in a loop: each call lets threads waiting to allocate or free
        in the budget go first.

        Examples
        --------
        >>> from gpubudget import gpu_budget
        >>> with gpu_budget("64MiB", initial=0, backend="host") as pool:
        ...     block = pool.allocate("4MiB")
        ...     grown = pool.mapped
        ...     pool.free(block)
        ...     (grown > 0, pool.trim() == grown, pool.mapped)
        True
        (True, True, 0)
        """
        tree, _ = self._growable("trim()")
        with tree.lock:
            freed = tree.trim()
        let_in(tree.turns)  # called in a loop, trim() must not keep allocations out
        return freed

    def offload(self, *, pinned: bool = True) -> int:
        """Put the budget to sleep: wait for the stream-ordered frees, copy every live block
        to host memory, unmap all its device memory; the bytes copied. ``pinned``: page-locked
        host memory (copies at the bus's speed, but locking it costs time too, see
        docs/growable.md); ``False``: plain host memory. The addresses
        stay reserved, so pointers into the budget (TensorRT engines, CuPy arrays, PyTorch
        tensors) are valid again after :meth:`restore`. All or nothing: if host memory or a
        copy fails, the error is raised and the budget stays awake. Nothing may use the
        budget's memory until :meth:`restore`."""
        return self._move("offload", pinned)

    def restore(self, *, keep_host: bool = False) -> int:
        """Wake the budget: map device memory for its live blocks and copy their bytes back
        to the same addresses; the bytes copied (0 if it was awake). ``keep_host``: keep the
        host memory for the next :meth:`offload` (it then gets and locks none: the cost of a
        sleep that happens again and again), until then held, and given back with the
        budget. All or nothing: if the device cannot back them or a copy fails, the error is
        raised; a Ctrl-C during the copies stops them; either way what was mapped is given
        back and the budget stays asleep, its blocks safe in host memory."""
        return self._move("restore", keep_host)

    def _move(self, way: Literal["offload", "restore"], option: bool) -> int:
        tree, mapping = self._growable(f"{way}()")
        with tree.lock:
            return (_offload(tree, mapping, option) if way == "offload"
                    else _restore(tree, mapping, option))


def _offload(tree: Tree, mapping: Mapping, pinned: bool) -> int:
    if mapping.asleep is not None:
        return 0
    tree.pending.retire(tree.arena, True, tree.root.stats.errors.append)
    return mapping.offload(((address, entry.nbytes) for address, entry in tree.entries()),
                           pinned)


def _restore(tree: Tree, mapping: Mapping, keep: bool) -> int:
    return mapping.restore(((address, entry.nbytes) for address, entry in tree.entries()),
                           keep)
