"""Best-fit sub-allocation of one address range, with coalescing; host bookkeeping only.

An :class:`Arena` manages ``[base, base + capacity)``. Every block size is a multiple of the
arena's ``granularity`` and every block starts at a multiple of it, so a free block can always
be split on granularity boundaries. The arena never touches the memory it manages.

Inside, positions and sizes are counted in *units* of the granularity from ``base``
(``unit = (address - base) // granularity``): small integers, which Python compares, hashes
and packs faster than device addresses. Data structures (every operation is a few
dictionary look-ups, one or two binary searches, and an insertion into or deletion from a
sorted list, which moves the entries after it: O(n) in the worst case, a fast memory move in
practice for the free blocks of a budget):

- ``_free_keys``: a sorted list of ``size << bits | unit`` for every free block (``bits`` is
  enough for any unit), so that ``bisect`` finds the smallest free block of at least ``n``
  units (lowest position on ties);
- ``_free_at``: free block start -> size, and ``_free_end``: free block end -> start, to find
  the neighbours of a freed block in O(1) and coalesce;
- ``_used_at``: allocated block start -> size.

Invariants, checked by :meth:`Arena.check`:

``TILED``
    Blocks, walked by address, tile ``[base, base + capacity)`` with no gap and no overlap.
``COALESCED``
    No two free blocks are adjacent.
``ALIGNED``
    Every block starts at a multiple of ``granularity`` and its size is one.
``INDEXED``
    ``_free_keys``, ``_free_at`` and ``_free_end`` describe the same free blocks, and
    ``_free_keys`` is sorted.

``used_bytes`` and ``free_bytes`` are computed on demand (they cost a pass over the free
blocks) rather than kept up to date on every allocation.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, NamedTuple, Protocol

from ..errors import InvariantError
from ..extensions import extension

native: Final = extension("_core", "_native")  # the C core, or None

__all__ = ["Arena", "Block", "check", "walk"]

State = tuple[list[tuple[int, int]], dict[int, int], dict[int, int], dict[int, int]]
"""An arena's bookkeeping as ``Arena._state()`` gives it (see :meth:`Arena._state`)."""



class Block(NamedTuple):
    """One block of an arena as :meth:`Arena.walk` reports it."""

    address: int
    size: int
    free: bool


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class Arena:
    """Best-fit allocator over ``[base, base + capacity)``.

    Parameters
    ----------
    base
        First address of the range; a multiple of ``granularity``.
    capacity
        Size of the range in bytes; a positive multiple of ``granularity``.
    granularity
        A power of two: the unit of block sizes and the minimum alignment of blocks.

    Examples
    --------
    >>> arena = Arena(0x10000, 4096, granularity=256)
    >>> a = arena.allocate(1024)
    >>> b = arena.allocate(512, alignment=1024)
    >>> (a, b, arena.used_bytes)
    (65536, 66560, 1536)
    >>> arena.free(a), arena.largest_free
    (1024, 2560)
    >>> arena.check()
    """

    __slots__ = (
        "base",
        "capacity",
        "granularity",
        "_shift",
        "_bits",
        "_mask",
        "_free_keys",
        "_free_at",
        "_free_end",
        "_used_at",
    )

    def __init__(self, base: int, capacity: int, granularity: int = 256) -> None:
        if not _is_power_of_two(granularity):
            raise ValueError(f"granularity must be a power of two, got {granularity!r}")
        if base < 0 or base % granularity:
            raise ValueError(f"base {base:#x} is not a multiple of granularity {granularity}")
        if capacity <= 0 or capacity % granularity:
            raise ValueError(
                f"capacity {capacity!r} is not a positive multiple of granularity {granularity}"
            )
        self.base: Final = base
        self.capacity: Final = capacity
        self.granularity: Final = granularity
        self._shift: Final = granularity.bit_length() - 1  # bytes = units << shift
        units = capacity >> self._shift
        self._bits: Final = units.bit_length()  # a key is size << bits | unit
        self._mask: Final = (1 << self._bits) - 1
        self._free_keys: list[int] = [units << self._bits]
        self._free_at: dict[int, int] = {0: units}
        self._free_end: dict[int, int] = {units: 0}
        self._used_at: dict[int, int] = {}

    # -- allocation ------------------------------------------------------------------------

    def allocate(self, size: int, alignment: int = 0) -> int | None:
        """Return the address of a block of ``size`` bytes, or ``None`` if none fits.

        ``size`` must be a positive multiple of ``granularity``; ``alignment`` 0 or a power of
        two (the block starts at a multiple of ``max(granularity, alignment)``).
        """
        # The helpers _add_free/_remove_free are inlined in allocate and free: they are the
        # hot path of every budget, and a method call costs as much as a dictionary update.
        shift, bits = self._shift, self._bits
        need = size >> shift
        keys = self._free_keys
        i = bisect_left(keys, need << bits)
        if i == len(keys):
            return None
        key = keys[i]
        unit = key & self._mask
        pad = 0
        if alignment > self.granularity:
            pad = (-(self.base + (unit << shift)) & (alignment - 1)) >> shift
            if pad and (key >> bits) < need + pad:
                # Walk up the sizes to the first block that fits with its padding: the walk
                # ends at the latest at a block of size + alignment - granularity bytes.
                n = len(keys)
                while True:
                    i += 1
                    if i == n:
                        return None
                    key = keys[i]
                    unit = key & self._mask
                    pad = (-(self.base + (unit << shift)) & (alignment - 1)) >> shift
                    if (key >> bits) >= need + pad:
                        break
        block = key >> bits
        del keys[i]
        free_at = self._free_at
        free_end = self._free_end
        del free_at[unit]
        end = unit + block
        if pad:
            insort(keys, pad << bits | unit)
            free_at[unit] = pad
            free_end[unit + pad] = unit
            unit += pad
        rest = block - pad - need
        if rest:
            start = unit + need
            insort(keys, rest << bits | start)
            free_at[start] = rest
            free_end[end] = start
        else:
            del free_end[end]
        self._used_at[unit] = need
        return self.base + (unit << shift)

    def free(self, address: int) -> int:
        """Free the block at ``address``; return its size, or 0 if no block starts there."""
        unit = self._unit(address)
        size = self._used_at.pop(unit, 0) if unit >= 0 else 0
        if not size:
            return 0
        released = size
        bits = self._bits
        keys = self._free_keys
        free_at = self._free_at
        free_end = self._free_end
        end = unit + size
        following = free_at.pop(end, 0)
        if following:
            del keys[bisect_left(keys, following << bits | end)]
            end += following
            size += following
        start = free_end.pop(unit, None)
        if start is not None:
            preceding = free_at[start]
            del keys[bisect_left(keys, preceding << bits | start)]
            unit = start
            size += preceding
        insort(keys, size << bits | unit)
        free_at[unit] = size
        free_end[end] = unit
        return released << self._shift

    def resize(self, address: int, new_size: int) -> bool:
        """Grow or shrink the allocated block at ``address`` in place.

        Shrinking always succeeds; growing succeeds when the block that follows is free and
        large enough. ``new_size`` must be a positive multiple of ``granularity``. Returns
        ``False`` (and changes nothing) when the block cannot be resized in place.
        """
        unit = self._unit(address)
        size = self._used_at.get(unit, 0) if unit >= 0 else 0
        if not size:
            return False
        need = new_size >> self._shift
        if need < size:
            self._used_at[unit] = need
            self._release(unit + need, size - need)
            return True
        if need == size:
            return True
        end = unit + size
        following = self._free_at.get(end, 0)
        if following < need - size:
            return False
        self._remove_free(end, following)
        remainder = following - (need - size)
        if remainder:
            self._add_free(unit + need, remainder)
        self._used_at[unit] = need
        return True

    # -- inspection ------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        """Bytes in free blocks."""
        return sum(self._free_at.values()) << self._shift

    @property
    def used_bytes(self) -> int:
        """Bytes in allocated blocks."""
        return self.capacity - self.free_bytes

    @property
    def largest_free(self) -> int:
        """Size of the largest free block (0 when full)."""
        keys = self._free_keys
        return (keys[-1] >> self._bits) << self._shift if keys else 0

    @property
    def blocks(self) -> int:
        """Allocated blocks."""
        return len(self._used_at)

    @property
    def free_blocks(self) -> int:
        """Free blocks."""
        return len(self._free_at)

    def _state(self) -> State:
        """The bookkeeping, in units: free blocks as ``(size, start)`` in their order, free
        start -> size, free end -> start, taken start -> size."""
        bits, mask = self._bits, self._mask
        return ([(key >> bits, key & mask) for key in self._free_keys], dict(self._free_at),
                dict(self._free_end), dict(self._used_at))

    def walk(self) -> Iterator[Block]:
        """Yield every block, free and allocated, in address order."""
        return walk(self)

    def check(self) -> None:
        """Raise :class:`InvariantError` naming the first invariant that does not hold."""
        check(self)

    def __repr__(self) -> str:
        return describe(self)

    # -- internals (in units) --------------------------------------------------------------

    def _unit(self, address: int) -> int:
        """The unit at which ``address`` starts, -1 if it is not on a unit of this arena."""
        offset = address - self.base
        if offset < 0 or offset & (self.granularity - 1):
            return -1
        return offset >> self._shift

    def _add_free(self, unit: int, size: int) -> None:
        insort(self._free_keys, size << self._bits | unit)
        self._free_at[unit] = size
        self._free_end[unit + size] = unit

    def _remove_free(self, unit: int, size: int) -> None:
        keys = self._free_keys
        del keys[bisect_left(keys, size << self._bits | unit)]
        del self._free_at[unit]
        del self._free_end[unit + size]

    def _release(self, unit: int, size: int) -> None:
        """Return ``size`` units at ``unit`` to the free blocks, merging neighbours."""
        end = unit + size
        following = self._free_at.get(end, 0)
        if following:
            self._remove_free(end, following)
            size += following
        start = self._free_end.get(unit)
        if start is not None:
            preceding = self._free_at[start]
            self._remove_free(start, preceding)
            unit = start
            size += preceding
        self._add_free(unit, size)


class _Placing(Protocol):
    """What :func:`walk` and :func:`check` read of an arena (either core's)."""

    @property
    def base(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def blocks(self) -> int: ...
    @property
    def free_blocks(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    def _state(self) -> State: ...


def walk(arena: _Placing) -> Iterator[Block]:
    """Every block of ``arena``, free and allocated, in address order."""
    _, free_at, _, used_at = arena._state()
    base, shift = arena.base, arena.granularity.bit_length() - 1
    blocks = [Block(base + (u << shift), s << shift, True) for u, s in free_at.items()]
    blocks += [Block(base + (u << shift), s << shift, False) for u, s in used_at.items()]
    blocks.sort()
    yield from blocks


def check(arena: _Placing) -> None:
    """Raise :class:`InvariantError` naming the first invariant of ``arena`` that does not
    hold (the module docstring lists them); one walker for both cores."""
    expected = arena.base
    previous_free = False
    for block in walk(arena):
        if block.address != expected:
            raise InvariantError(
                "TILED", f"block at {block.address:#x}, previous block ends at {expected:#x}"
            )
        if block.address % arena.granularity or block.size % arena.granularity or block.size <= 0:
            raise InvariantError("ALIGNED", f"block {block}")
        if block.free and previous_free:
            raise InvariantError("COALESCED", f"free block {block} follows a free block")
        previous_free = block.free
        expected = block.address + block.size
    if expected != arena.base + arena.capacity:
        raise InvariantError("TILED", f"blocks end at {expected:#x}, not at the range end")
    keys, free_at, free_end, _ = arena._state()
    if keys != sorted(keys) or {unit: size for size, unit in keys} != free_at:
        raise InvariantError("INDEXED", "sorted free index disagrees with the free map")
    if len(keys) != len(free_at) or free_end != {u + s: u for u, s in free_at.items()}:
        raise InvariantError("INDEXED", "free-end map disagrees with the free map")


def describe(arena: _Placing) -> str:
    return (f"Arena(base={arena.base:#x}, capacity={arena.capacity}, used={arena.used_bytes}, "
            f"blocks={arena.blocks}, free_blocks={arena.free_blocks})")


PythonArena: Final = Arena
"""The placement in Python, whichever core runs (tests compare it with the C one)."""

if native is not None and not TYPE_CHECKING:

    class Arena(native.Arena):  # the same placement in C (arena.c); walk and check here
        __doc__ = Arena.__doc__
        __slots__ = ()
        walk = walk
        check = check
        __repr__ = describe
