"""gpubudget.hostledger.index: each process's index of a ledger file's slots follows other
processes' changes by reading only the slots the change log names, rebuilds itself (decoding
without the file's lock) when it cannot, and always agrees with a full reading of the file."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpubudget.hostledger import index as index_module
from gpubudget.hostledger import procs
from gpubudget.hostledger.book import DeviceBook
from gpubudget.hostledger.files import LedgerDirectory
from gpubudget.hostledger.index import SlotIndex
from gpubudget.hostledger.layout import (
    HEADER_BYTES,
    LOG_LENGTH,
    LOG_WORD,
    SLOT_BYTES,
    UNLOCKED_WORD,
    Entry,
    decode_entry,
    header_word,
)


def open_book(path: Path) -> DeviceBook:
    """A handle on the file as another process would have one (slot locks of its own)."""
    directory = LedgerDirectory(path, create=True)
    try:
        return DeviceBook(directory, "host", "host memory", 2**40, hard=False)
    finally:
        directory.close()


def close(*books: DeviceBook) -> None:
    for book in books:
        os.close(book.fd)
        if book.locks_fd is not None:
            os.close(book.locks_fd)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[DeviceBook, DeviceBook]]:
    first, second = open_book(tmp_path), open_book(tmp_path)
    yield first, second
    close(first, second)


def mine(claim: int) -> dict[str, int]:
    me = procs.myself()
    return {"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot,
            "claim": claim, "limit": claim}


def as_read(book: DeviceBook) -> list[Entry]:
    """Every non-free slot of the file, decoded afresh."""
    high = book.words[header_word("high")]
    found = (decode_entry(book.data, HEADER_BYTES + slot * SLOT_BYTES, slot)
             for slot in range(high))
    return [entry for entry in found if entry is not None]


class Spy:
    """Counts the slots an index decodes one by one, and its rebuilds."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.decoded: list[int] = []
        self.rebuilds = 0
        decode, rebuild = decode_entry, SlotIndex.rebuild

        def decoding(data: bytes | memoryview, offset: int, slot: int) -> Entry | None:
            self.decoded.append(slot)
            return decode(data, offset, slot)

        def rebuilding(index: SlotIndex, *args: object, **kwargs: object) -> None:
            self.rebuilds += 1
            rebuild(index, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr("gpubudget.hostledger.index.decode_entry", decoding)
        monkeypatch.setattr(SlotIndex, "rebuild", rebuilding)

    def reset(self) -> None:
        self.decoded.clear()
        self.rebuilds = 0


def test_an_index_reads_only_the_slots_changed_since_it_last_looked(
        pair: tuple[DeviceBook, DeviceBook], monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = pair
    with writer.current():
        slots = [writer.claim(mine(2**20), f"r{n}", "writer") for n in range(100)]
    with reader.current() as index:  # its first look: every slot
        assert len(index.entries) == 100 and index.held == 100 * 2**20
    with writer.current():
        writer.release(slots[7])
        writer.reserved(slots[50], 2**20, 99)
        writer.claim(mine(2**21), "new", "writer")  # takes slot 7 again
    spy = Spy(monkeypatch)
    with reader.current() as index:
        assert spy.rebuilds == 0 and sorted(spy.decoded) == [7, 50]
        assert index.entries[7].name == "new" and index.entries[50].state == "reserved"
        assert index.held == 101 * 2**20 and index.live() == as_read(reader)


def test_more_changes_than_the_log_keeps_rebuild_the_index_without_the_lock(
        pair: tuple[DeviceBook, DeviceBook], monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = pair
    with reader.current():
        pass
    with writer.current():
        for number in range(LOG_LENGTH + 1):
            writer.claim(mine(4096), f"r{number}", "writer")
    spy = Spy(monkeypatch)
    free_during_rebuild = []
    rebuild = SlotIndex.rebuild  # the spy's

    def rebuild_and_try_the_lock(index: SlotIndex, *args: object) -> None:
        other = os.open(reader.path, os.O_RDONLY)
        try:  # another process may take the lock while the slots are decoded
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free_during_rebuild.append(True)
        finally:
            os.close(other)
        rebuild(index, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SlotIndex, "rebuild", rebuild_and_try_the_lock)
    with reader.current() as index:
        assert spy.rebuilds == 1 and free_during_rebuild == [True]
        assert index.live() == as_read(reader) and len(index.entries) == LOG_LENGTH + 1


def test_a_change_made_without_the_lock_makes_the_next_locker_read_every_slot(
        pair: tuple[DeviceBook, DeviceBook], monkeypatch: pytest.MonkeyPatch) -> None:
    owner, other = pair
    with owner.current():
        kept, freed = owner.claim(mine(2**20), "kept", "owner"), owner.claim(
            mine(2**20), "freed", "owner")
    with other.current():
        pass
    marks = {owner.words[UNLOCKED_WORD]}
    owner.reserved_unlocked(kept, 2**20, 1234)  # the lock was not to be had
    marks.add(owner.words[UNLOCKED_WORD])
    owner.release_unlocked(freed)
    marks.add(owner.words[UNLOCKED_WORD])
    assert len(marks) == 3  # a new mark each time
    spy = Spy(monkeypatch)
    for book in (other, owner):  # every process reads every slot again, once
        with book.current() as index:
            assert [(entry.name, entry.state) for entry in index.live()] == [
                ("kept", "reserved")]
        with book.current():
            pass
    assert spy.rebuilds == 2


def test_a_log_that_names_a_slot_nobody_used_is_not_trusted(
        pair: tuple[DeviceBook, DeviceBook], monkeypatch: pytest.MonkeyPatch) -> None:
    writer, reader = pair
    with writer.current():
        writer.claim(mine(2**20), "a", "writer")
    with reader.current():
        pass
    with writer.current():
        writer.claim(mine(2**20), "b", "writer")
        changes = writer.words[32]
        writer.words[LOG_WORD + changes % LOG_LENGTH] = 4000  # overwritten by someone
    spy = Spy(monkeypatch)
    with reader.current() as index:
        assert spy.rebuilds == 1 and [entry.name for entry in index.live()] == ["a", "b"]


def test_claims_still_reserving_and_recent_reservations_are_unsettled() -> None:
    index = SlotIndex()
    index.rebuild(bytes(SLOT_BYTES), high=0, changes=0, mark=0)
    me = procs.myself()
    entry = Entry(0, "claimed", me.pid, me.start, me.pidns, me.boot, 10, 10, 0, 0, 0, 0, 1, 0,
                  None, None, 1, "a", "p")
    index.put(0, entry)
    index.put(1, entry._replace(slot=1, state="reserved", claim=20, reserved=30,
                                reserved_at=5_000))
    index.put(2, entry._replace(slot=2, state="reserved", claim=40, reserved_at=1_000))
    assert index.unsettled(since_ns=2_000, now_ns=6_000) == 10 + 30
    assert index.unsettled(since_ns=0, now_ns=6_000) == 10 + 30 + 40
    assert index.unsettled(since_ns=0, now_ns=index_module.RECENT_NS + 3_000) == 10 + 30
    index.put(1, None)
    assert index.unsettled(since_ns=0, now_ns=6_000) == 10 and index.held == 10 + 40
    assert list(zip(index.free_slots(), range(3))) == [(1, 0), (3, 1), (4, 2)]


_OPERATIONS = st.lists(st.tuples(
    st.sampled_from(["claim", "reserve", "release", "reserve unlocked", "release unlocked",
                     "look"]), st.booleans(), st.integers(0, 40)), max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=_OPERATIONS)
def test_an_index_kept_current_agrees_with_a_full_reading(operations: list[tuple[str, bool, int]]
                                                          ) -> None:
    import tempfile

    books = [open_book(Path(tempfile.mkdtemp())) for _ in range(1)]
    books.append(open_book(books[0].path.parent))
    held: list[list[int]] = [[], []]
    try:
        for operation, which, number in operations:
            book, slots = books[which], held[which]
            if operation == "claim":
                with book.current():
                    slots.append(book.claim(mine(4096 * (number + 1)), f"r{number}", "p"))
            elif operation == "look":
                with book.current():
                    pass
            elif slots:
                slot = slots[number % len(slots)]
                if operation == "reserve":
                    with book.locked():
                        book.reserved(slot, 8192 * number, number)
                elif operation == "reserve unlocked":
                    book.reserved_unlocked(slot, 8192 * number, number)
                else:
                    slots.remove(slot)
                    if operation == "release":
                        with book.locked():
                            book.release(slot)
                    else:
                        book.release_unlocked(slot)
            for book in books:
                with book.current() as index:
                    assert index.live() == as_read(book)
                    assert index.held == sum(entry.holds for entry in index.live())
                    assert book.mine == set(held[books.index(book)])
    finally:
        close(*books)
