from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gpubudget._core.arena import Arena, Block, State, check
from gpubudget.errors import InvariantError

BASE = 0x10000
GRAN = 256
CAPACITY = 64 * GRAN


def gaps(used: dict[int, int], base: int = BASE, capacity: int = CAPACITY) -> list[tuple[int, int]]:
    """Free (address, size) runs of a reference model of allocated intervals."""
    out: list[tuple[int, int]] = []
    cursor = base
    for address in sorted(used):
        if address > cursor:
            out.append((cursor, address - cursor))
        cursor = address + used[address]
    if cursor < base + capacity:
        out.append((cursor, base + capacity - cursor))
    return out


def fits(gap: tuple[int, int], size: int, alignment: int) -> bool:
    address, length = gap
    pad = -address % max(alignment, 1)
    return length >= size + pad


class ArenaModel(RuleBasedStateMachine):
    """The arena against a reference model: a dict of allocated intervals."""

    def __init__(self) -> None:
        super().__init__()
        self.arena = Arena(BASE, CAPACITY, GRAN)
        self.used: dict[int, int] = {}

    @rule(units=st.integers(1, 20), alignment=st.sampled_from([0, 256, 512, 1024, 4096]))
    def allocate(self, units: int, alignment: int) -> None:
        size = units * GRAN
        before = gaps(self.used)
        address = self.arena.allocate(size, alignment)
        if address is None:
            assert not any(fits(gap, size, alignment) for gap in before)
            return
        assert address % max(alignment, GRAN) == 0
        assert BASE <= address and address + size <= BASE + CAPACITY
        for other, length in self.used.items():
            assert address + size <= other or other + length <= address, "overlap"
        if alignment <= GRAN:  # best fit: the smallest gap that can hold it, no larger one
            home = next(gap for gap in before if gap[0] <= address < gap[0] + gap[1])
            assert home[1] == min(gap[1] for gap in before if gap[1] >= size)
        self.used[address] = size

    @precondition(lambda self: bool(self.used))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        address = data.draw(st.sampled_from(sorted(self.used)))
        assert self.arena.free(address) == self.used.pop(address)
        assert self.arena.free(address) == 0  # double free is refused

    @precondition(lambda self: bool(self.used))
    @rule(data=st.data(), units=st.integers(1, 24))
    def resize(self, data: st.DataObject, units: int) -> None:
        address = data.draw(st.sampled_from(sorted(self.used)))
        new_size = units * GRAN
        following = dict(gaps(self.used)).get(address + self.used[address], 0)
        possible = new_size <= self.used[address] + following
        assert self.arena.resize(address, new_size) == possible
        if possible:
            self.used[address] = new_size

    @invariant()
    def consistent(self) -> None:
        self.arena.check()
        assert self.arena.used_bytes == sum(self.used.values())
        assert self.arena.largest_free == max((g[1] for g in gaps(self.used)), default=0)
        assert [b for b in self.arena.walk() if not b.free] == [
            Block(a, s, False) for a, s in sorted(self.used.items())
        ]


TestArenaModel = ArenaModel.TestCase
TestArenaModel.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)


def test_alignment_above_granularity_pads_and_keeps_pad_free() -> None:
    arena = Arena(BASE, CAPACITY, GRAN)
    first = arena.allocate(GRAN)
    aligned = arena.allocate(GRAN, alignment=4096)
    assert first == BASE and aligned is not None and aligned % 4096 == 0
    arena.check()
    assert arena.used_bytes == 2 * GRAN
    assert arena.free(first) == GRAN and arena.free(aligned) == GRAN
    assert list(arena.walk()) == [Block(BASE, CAPACITY, True)]


def test_free_coalesces_both_neighbours() -> None:
    arena = Arena(BASE, CAPACITY, GRAN)
    a, b, c = (arena.allocate(GRAN) for _ in range(3))
    assert a is not None and b is not None and c is not None
    arena.free(a)
    arena.free(c)
    assert len([blk for blk in arena.walk() if blk.free]) == 2
    arena.free(b)
    assert list(arena.walk()) == [Block(BASE, CAPACITY, True)]


def test_full_arena_denies_and_unknown_free_is_zero() -> None:
    arena = Arena(BASE, 4 * GRAN, GRAN)
    assert arena.allocate(4 * GRAN) == BASE
    assert arena.allocate(GRAN) is None
    assert arena.largest_free == 0
    assert arena.free(BASE + GRAN) == 0


@pytest.mark.parametrize(
    ("base", "capacity", "granularity"),
    [(0, 1024, 3), (100, 1024, 256), (0, 1000, 256), (0, 0, 256), (-256, 1024, 256)],
)
def test_constructor_rejects_bad_geometry(base: int, capacity: int, granularity: int) -> None:
    with pytest.raises(ValueError):
        Arena(base, capacity, granularity)


class _Corrupted:
    """An arena's geometry with bookkeeping changed by hand: what ``check`` reads."""

    def __init__(self, arena: Arena, state: State) -> None:
        self.base, self.capacity, self.granularity = arena.base, arena.capacity, arena.granularity
        self.blocks, self.free_blocks, self.used_bytes = 0, 0, 0
        self.state = state

    def _state(self) -> State:
        return self.state


@pytest.mark.parametrize("invariant", ["COALESCED", "TILED", "INDEXED"])
def test_check_names_the_broken_invariant(invariant: str) -> None:
    arena = Arena(BASE, CAPACITY, GRAN)  # either core's: both are checked by one walker
    a = arena.allocate(GRAN)
    b = arena.allocate(GRAN)
    assert a is not None and b is not None
    arena.check()
    keys, free_at, free_end, used_at = arena._state()
    unit_a, unit_b = (a - BASE) // GRAN, (b - BASE) // GRAN  # the arena counts in units
    if invariant == "COALESCED":  # b turns free without merging with the free rest
        del used_at[unit_b]
        free_at[unit_b] = 1
        free_end[unit_b + 1] = unit_b
        keys = sorted([*keys, (1, unit_b)])
    elif invariant == "TILED":  # lose a block
        del used_at[unit_a]
    else:
        keys = [*keys, (0, 1)]
    with pytest.raises(InvariantError) as info:
        check(_Corrupted(arena, (keys, free_at, free_end, used_at)))
    assert info.value.invariant == invariant
