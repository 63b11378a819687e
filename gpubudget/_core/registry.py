"""The live-block registry: one entry per live block of a tree, by address.

An entry is the block's owner (the :class:`~gpubudget._core.node.Node` of the budget that
allocated it), its aligned size, its tag and its stack (``None`` unless the budget tracks
stacks). The registry keeps each as a plain tuple (:data:`Record`), in a ``dict`` or in the C
core's ``Registry``, which has a dict's interface: one is made on every allocation, and an
instance of a class costs several times more to make. The code of the core reads records by
unpacking them; what it hands out of the core is a :class:`LiveEntry`, the same four fields
by name, made only when asked for (``Tree.owner``, ``Tree.entries``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Final, NamedTuple

from ..extensions import extension

native: Final = extension("_core", "_native")  # the C core, or None

if TYPE_CHECKING:
    from .node import Node

__all__ = ["LiveEntry", "Record", "new_registry"]

Record = tuple["Node", int, "str | None", "tuple[str, ...] | None"]
"""A live block as the registry keeps it: (owner, aligned size, tag, stack)."""


class LiveEntry(NamedTuple):
    """A live block's entry in its tree's registry, its fields named."""

    owner: Node
    """The node of the budget that allocated the block (``owner.budget`` is the budget)."""
    nbytes: int
    """The block's aligned size: what every budget up the chain is charged for it."""
    tag: str | None
    stack: tuple[str, ...] | None
    """Where the block was allocated, outermost frame first (budgets that track stacks)."""


def new_registry() -> MutableMapping[int, Record]:
    """An empty registry: the C core's where it runs, else a ``dict``."""
    return native.Registry() if native is not None else {}
