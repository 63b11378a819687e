"""The events a reader yields, typed."""

from __future__ import annotations

from typing import NamedTuple, Union

__all__ = ["Alloc", "Door", "Enter", "Exit", "Free", "Header", "Map", "MappingEvent", "Resize",
           "TraceEvent", "Unmap"]


# -- reading -------------------------------------------------------------------------------


class Header(NamedTuple):
    """A trace's first line."""

    version: int
    created: str | None
    pid: int | None


class Enter(NamedTuple):
    """Budget ``budget`` was entered under ``parent`` (``None`` for a root). A root's line
    says where its memory starts (``base``) and, for a growable root, the ``granule`` it
    maps at a time (``None`` where the trace does not say: a child, a reserved root, or a
    trace written before they were recorded)."""

    t: float
    budget: int
    name: str
    parent: int | None
    limit: int
    align: int
    reserve: int
    backend: str | None
    base: int | None = None
    granule: int | None = None

    @property
    def span(self) -> int:
        """Bytes of a root's memory: its limit rounded up to its alignment and, for a
        growable root, to its granule (the addresses it reserved)."""
        size = -(-self.limit // self.align) * self.align
        return size if self.granule is None else -(-size // self.granule) * self.granule


class Alloc(NamedTuple):
    """An allocation by ``budget``: granted at ``ptr``, or denied (``ptr`` ``None``) for
    ``reason``. ``nbytes`` is the aligned size charged (the line's ``bytes``); ``stack``
    the frames of the code that asked (``"file:line in function"``, outermost first), or
    ``None`` where the budget did not keep stacks (``track_stacks``)."""

    t: float
    budget: int
    size: int
    align: int
    tag: str | None
    ptr: int | None
    nbytes: int
    reason: str | None
    stack: tuple[str, ...] | None = None


class Free(NamedTuple):
    """The live block at ``ptr`` of ``budget`` was freed."""

    t: float
    budget: int
    ptr: int


class Resize(NamedTuple):
    """The live block at ``ptr`` of ``budget`` was resized in place to ``nbytes``."""

    t: float
    budget: int
    ptr: int
    size: int
    align: int
    nbytes: int


class Map(NamedTuple):
    """Growable root ``budget`` mapped the ``nbytes`` at ``ptr`` (whole granules)."""

    t: float
    budget: int
    ptr: int
    nbytes: int


class Unmap(NamedTuple):
    """Growable root ``budget`` unmapped the ``nbytes`` at ``ptr`` (a trim, or sleep)."""

    t: float
    budget: int
    ptr: int
    nbytes: int


class Exit(NamedTuple):
    """``budget``'s ``with`` block ended."""

    t: float
    budget: int


class Door(NamedTuple):
    """Under the driver door (``gpubudget run``): what the door had charged ``budget`` when
    its ``with`` block ended, the numbers of :class:`gpubudget.door.DoorNumbers` (written on
    the line before the budget's ``exit``). ``held`` counts a root's own memory (``own``)
    too; ``allocations`` is the driver allocations made in the budget itself still live;
    ``libraries`` its own allocations by library, ``(name, live bytes, refusals)``, largest
    first."""

    t: float
    budget: int
    held: int
    own: int
    allocations: int
    peak: int
    refusals: int
    last_refused: int
    last_refused_by: str | None
    libraries: tuple[tuple[str, int, int], ...]
    attribute_only: bool

    @property
    def foreign(self) -> int:
        """Bytes charged through the door that are not a root's own memory."""
        return max(self.held - self.own, 0)


TraceEvent = Union[Enter, Alloc, Free, Resize, Exit]
"""One validated event of a trace (what a reader yields unless asked for mappings, or for the
driver door's :class:`Door` events too)."""
MappingEvent = Union[Map, Unmap]
"""A growable root's change of what it has mapped (yielded only when asked for)."""
