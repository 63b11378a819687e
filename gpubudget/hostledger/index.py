"""What this process knows of one ledger file's slots, brought up to date from its change log.

A root's claim needs the device's slots: what the live roots hold, which claims are still
reserving, a free slot. Decoding every slot at every claim would cost time in proportion to
the live roots, under the file's lock. Instead each process keeps a :class:`SlotIndex` of
the file: the live slots decoded, the free ones, the processes that own slots, and the sums
a claim needs. The file counts its changes and logs the slot of each
(:mod:`~gpubudget.hostledger.layout`); under the lock, :meth:`SlotIndex.catch_up` reads only
the slots changed since the index last looked. When it cannot (its first look, more changes
than the log keeps, a new mark of a change made without the lock, a log that names no slot),
the caller copies the slots under the lock and :meth:`SlotIndex.rebuild` decodes them after.
"""

from __future__ import annotations

import bisect
import heapq
import struct
from collections.abc import Generator
from typing import Final

from .layout import (
    CHANGES_WORD,
    FREE,
    HEADER_BYTES,
    LOG_LENGTH,
    LOG_WORD,
    SLOT_BYTES,
    SLOT_FIELDS,
    SLOTS,
    UNLOCKED_WORD,
    Damage,
    Entry,
    decode_entry,
    header_word,
)

__all__ = ["RECENT_NS", "ProcessKey", "SlotIndex"]

ProcessKey = tuple[int, int, int, int]
"""A slot's process: pid, start time, PID namespace, boot."""
RECENT_NS: Final = 60_000_000_000
"""How long a reservation seen is remembered as recent (a claim asks about the last few
milliseconds: those that its reading of the free memory may not show)."""
_WRAP: Final = 1 << 64
_HIGH: Final = header_word("high")
_STATE: Final = SLOT_FIELDS.index("state")
_WORDS_PER_SLOT: Final = SLOT_BYTES // 8
_WORD: Final = struct.Struct("=Q")


def process_of(entry: Entry) -> ProcessKey:
    return (entry.pid, entry.start, entry.pidns, entry.boot)


class SlotIndex:
    """The slots of one ledger file as this process last read them (see the module
    docstring). ``changes`` is the file's change count it is current with (``None``: never
    read).

    >>> index = SlotIndex()
    >>> index.rebuild(bytes(2 * SLOT_BYTES), high=2, changes=0, mark=0)
    >>> list(index.free_slots())[:3], index.held
    ([0, 1, 2], 0)
    """

    def __init__(self) -> None:
        self._empty()

    def _empty(self) -> None:
        self.changes: int | None = None
        self.mark = 0
        """The mark of the last change made without the lock that the index has seen."""
        self.high = 0
        self.entries: dict[int, Entry] = {}
        self.owners: dict[ProcessKey, set[int]] = {}
        self.held = 0
        """What the indexed roots hold, in all (:attr:`Entry.holds`)."""
        self.claiming: set[int] = set()
        """Slots of claims still reserving."""
        self.recent: list[tuple[int, int]] = []
        """``(reserved_at, slot)`` of the reservations seen in the last :data:`RECENT_NS`,
        in order: a claim reads only its end."""
        self.damaged: set[int] = set()
        """Slots seen in a state this version never writes (for the book to clear)."""
        self._free: list[int] = []  # a heap of the free slots below ``high``, some stale
        self._free_set: set[int] = set()

    # -- reading the file ------------------------------------------------------------------

    def rebuild(self, slots: bytes, high: int, changes: int, mark: int = 0) -> None:
        """Read every slot anew from ``slots`` (the file's first ``high`` slots, copied under
        the lock when its change count was ``changes`` and its mark ``mark``)."""
        self._empty()
        states = memoryview(slots).cast("Q")[_STATE::_WORDS_PER_SLOT].tolist()
        for slot, state in enumerate(states[:high]):
            if state == FREE:
                self._push(slot)
                continue
            entry = decode_entry(slots, slot * SLOT_BYTES, slot)
            if entry is None:
                self.damaged.add(slot)
                self._push(slot)
            else:
                self._add(entry)
        self.high = high
        self.changes = changes
        self.mark = mark

    def catch_up(self, words: memoryview, data: memoryview) -> bool:
        """Lock held: read the slots changed since the index last looked (``words``: the
        file as 64-bit words, ``data`` as bytes); ``False`` if the index must be rebuilt.
        :class:`~gpubudget.hostledger.layout.Damage` if the header's count of slots in use is
        impossible."""
        high = words[_HIGH]
        if high > SLOTS:
            raise Damage(f"damaged header ({high} slots in use of {SLOTS})")
        if self.changes is None or words[UNLOCKED_WORD] != self.mark or high < self.high:
            return False
        changes = words[CHANGES_WORD]
        behind = (changes - self.changes) % _WRAP
        if behind > LOG_LENGTH:
            return False
        changed = set()
        for number in range(self.changes + 1, self.changes + behind + 1):
            slot = words[LOG_WORD + number % LOG_LENGTH]
            if slot >= high:  # the log names a slot nobody used: not a log we wrote
                return False
            changed.add(slot)
        self._grow(high)
        for slot in sorted(changed):
            self.reread(slot, data)
        self.changes = changes
        return True

    def reread(self, slot: int, data: memoryview) -> None:
        """Read slot ``slot`` of the file (``data``) again."""
        offset = HEADER_BYTES + slot * SLOT_BYTES
        entry = decode_entry(data, offset, slot)
        if entry is None and _WORD.unpack_from(data, offset + 8 * _STATE)[0] != FREE:
            self.damaged.add(slot)
        self.put(slot, entry)

    # -- keeping it current ----------------------------------------------------------------

    def put(self, slot: int, entry: Entry | None) -> None:
        """Slot ``slot`` now holds ``entry`` (``None``: it is free)."""
        old = self.entries.pop(slot, None)
        if old is not None:
            self.held -= old.holds
            owned = self.owners.get(process_of(old))
            if owned is not None:
                owned.discard(slot)
                if not owned:
                    del self.owners[process_of(old)]
            self.claiming.discard(slot)
            if old.state == "reserved":
                at = bisect.bisect_left(self.recent, (old.reserved_at, slot))
                if at < len(self.recent) and self.recent[at] == (old.reserved_at, slot):
                    del self.recent[at]
        if entry is None:
            self._push(slot)
        else:
            self._free_set.discard(slot)
            self._add(entry)
        self._grow(slot + 1)

    def _grow(self, high: int) -> None:
        """Slots up to ``high`` have been used: those not indexed are free."""
        for slot in range(self.high, high):
            if slot not in self.entries:
                self._push(slot)
        self.high = max(self.high, high)

    def _add(self, entry: Entry) -> None:
        self.entries[entry.slot] = entry
        self.held += entry.holds
        self.owners.setdefault(process_of(entry), set()).add(entry.slot)
        if entry.state == "claimed":
            self.claiming.add(entry.slot)
        else:
            bisect.insort(self.recent, (entry.reserved_at, entry.slot))

    def _push(self, slot: int) -> None:
        if slot not in self._free_set:
            self._free_set.add(slot)
            heapq.heappush(self._free, slot)
            if len(self._free) > 2 * len(self._free_set) + 64:  # mostly stale: compact
                self._free = sorted(self._free_set)

    # -- what a claim asks -----------------------------------------------------------------

    def unsettled(self, since_ns: int, now_ns: int) -> int:
        """Bytes held by claims still reserving, or reserved at or after ``since_ns``: those
        that a reading of the free memory taken at ``since_ns`` may not show."""
        recent = self.recent
        del recent[:bisect.bisect_left(recent, (now_ns - RECENT_NS, -1))]
        return (sum(self.entries[slot].holds for slot in self.claiming)
                + sum(self.entries[slot].holds for _, slot
                      in recent[bisect.bisect_left(recent, (since_ns, -1)):]))

    def free_slots(self) -> Generator[int, None, None]:
        """Slots that are free as far as the index knows, lowest first (the caller checks
        each in the file before it takes it): the free ones below ``high``, then those
        never used."""
        passed = []
        try:
            while self._free:
                slot = heapq.heappop(self._free)
                if slot in self._free_set:
                    self._free_set.discard(slot)
                    passed.append(slot)
                    yield slot
            yield from range(self.high, SLOTS)
        finally:  # the ones offered and not taken stay free for the next claim
            for slot in passed:
                if slot not in self.entries:
                    self._push(slot)

    def live(self) -> list[Entry]:
        """The indexed entries, in slot order."""
        return [self.entries[slot] for slot in sorted(self.entries)]
