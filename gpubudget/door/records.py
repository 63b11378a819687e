"""What :func:`gpubudget.door.numbers` and :func:`gpubudget.door.outside` answer: frozen
records, in a module of their own so that ``import gpubudget`` (which loads the door) does not
load :mod:`dataclasses`; ``gpubudget.door`` names them too."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DoorLibrary", "DoorNumbers"]


@dataclass(frozen=True)
class DoorLibrary:
    """One library's share of a budget's driver allocations (or of those outside budgets)."""

    name: str  # the file name of the library that called the driver: "libcublasLt.so.13"
    live_bytes: int  # what its allocations charged there hold now
    refusals: int  # requests of it refused there


@dataclass(frozen=True)
class DoorNumbers:
    """What the driver door charged one budget (its own allocations and its children's)."""

    held: int  # bytes charged through the door here and below, a root's own included
    own: int  # a root's own backend memory (reservation, mapped granules)
    live: int  # driver allocations live made in this budget itself (a root's own memory not)
    peak: int  # highest ``held``
    refusals: int  # requests refused here (asked here, or below and refused by this limit)
    last_refused: int  # the size of the last request refused here, 0 if none
    last_refused_by: str | None  # which library asked it
    libraries: tuple[DoorLibrary, ...]  # this budget's own allocations, by library
    attribute_only: bool  # the door counts without refusing (GPUBUDGET_DOOR_MODE=attribute)

    @property
    def foreign(self) -> int:
        """Bytes charged through the door that are not a root's own backend memory (never
        below 0: ``held`` and ``own`` are read one after the other while hooks change them)."""
        return max(self.held - self.own, 0)
