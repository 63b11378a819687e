"""gpubudget.hostledger.book: slots claimed, reserved and released under the file's lock;
slots of ended processes cleared by the next claim and left out by readers; a process of
another PID namespace known alive by its slot lock; a lock held too long is an error, after
which this process waits only briefly until it has the lock again; a full file says so; an
index kept current from the change log, rebuilt when it falls behind."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpubudget.hostledger import LedgerError, book, procs
from gpubudget.hostledger.book import DeviceBook, read_book
from gpubudget.hostledger.errors import LedgerFull, LedgerLocked
from gpubudget.hostledger.files import LedgerDirectory
from gpubudget.hostledger.layout import (
    HEADER_BYTES,
    RESERVED,
    SLOT_BYTES,
    SLOTS,
    UNLOCKED_WORD,
    encode_slot,
)
from tests.helpers import subprocess_env


def open_book(path: Path) -> DeviceBook:
    directory = LedgerDirectory(path, create=True)
    try:
        return DeviceBook(directory, "host", "host memory", 2**30, hard=True)
    finally:
        directory.close()


def mine(**numbers: int) -> dict[str, int]:
    me = procs.myself()
    return {"pid": me.pid, "start": me.start, "pidns": me.pidns, "boot": me.boot, **numbers}


def write_slot(ledger: DeviceBook, slot: int, numbers: dict[str, int], name: str) -> None:
    """A slot as another process would have written it: under the lock, counted and logged
    as a change."""
    offset = HEADER_BYTES + slot * SLOT_BYTES
    with ledger.locked():
        ledger.map[offset: offset + SLOT_BYTES] = encode_slot(numbers, name, "someone")
        words = ledger.words
        words[4] = max(words[4], slot + 1)  # slots ever used
        ledger._changed(slot)


def finished_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def test_claim_reserve_release(tmp_path: Path) -> None:
    ledger = open_book(tmp_path)
    with ledger.current():
        first = ledger.claim(mine(limit=100, claim=256), "a", "me")
        second = ledger.claim(mine(limit=200, claim=256), "b", "me")
        ledger.reserved(first, 256, 5)
        entries = ledger.live_entries()
    assert (first, second) == (0, 1)
    assert [(e.name, e.state, e.reserved, e.reserved_at) for e in entries] == [
        ("a", "reserved", 256, 5), ("b", "claimed", 0, 0)]
    with ledger.current() as index:
        assert (index.held, index.claiming) == (512, {1})
        ledger.release(first)
        assert [e.name for e in ledger.live_entries()] == ["b"]
        assert ledger.claim(mine(), "c", "me") == 0  # the first free slot again
        ledger.set_cap(512)
        assert ledger.header().cap == 512 and ledger.header().high == 2
    snapshot = read_book(LedgerDirectory(tmp_path, create=False), "host.ledger")
    assert ([e.name for e in snapshot.entries], snapshot.ended, snapshot.header.cap) == (
        ["c", "b"], 0, 512)


def test_a_full_ledger_says_so_and_a_slot_freed_is_taken_again(tmp_path: Path) -> None:
    ledger = open_book(tmp_path)
    with ledger.current():
        slots = [ledger.claim(mine(claim=1), f"r{n}", "me") for n in range(SLOTS)]
        with pytest.raises(LedgerFull, match=f"is full: {SLOTS} root budgets of live processes"):
            ledger.claim(mine(), "one too many", "me")
        ledger.release(slots[1234])
        assert ledger.claim(mine(), "again", "me") == 1234
    assert slots == list(range(SLOTS))
    assert issubclass(LedgerFull, LedgerError)


def test_slots_of_ended_processes_are_cleared_by_a_claim_and_skipped_by_readers(
        tmp_path: Path) -> None:
    ledger = open_book(tmp_path)
    me = procs.myself()
    write_slot(ledger, 0, {"state": RESERVED, "pid": finished_pid(), "start": 1, "boot": me.boot,
                           "pidns": me.pidns, "claim": 2**29}, "ended")
    write_slot(ledger, 1, {"state": RESERVED, "pid": me.pid, "start": me.start + 7,
                           "boot": me.boot, "pidns": me.pidns, "claim": 2**29}, "reused pid")
    write_slot(ledger, 2, {"state": RESERVED, "pid": me.pid, "start": me.start,
                           "boot": me.boot ^ 1, "pidns": me.pidns}, "another boot")
    write_slot(ledger, 3, mine(state=RESERVED, claim=2**20), "live")
    snapshot = read_book(LedgerDirectory(tmp_path, create=False), "host.ledger")
    assert [e.name for e in snapshot.entries] == ["live"] and snapshot.ended == 3
    with ledger.current():
        assert [e.name for e in ledger.live_entries()] == ["live"]
    assert read_book(LedgerDirectory(tmp_path, create=False), "host.ledger").ended == 0
    assert bytes(ledger.map[HEADER_BYTES: HEADER_BYTES + SLOT_BYTES]) == bytes(SLOT_BYTES)


def test_a_process_of_another_pid_namespace_is_alive_while_it_holds_its_slot_lock(
        tmp_path: Path) -> None:
    ledger = open_book(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tests.test_hostledger_book import "
         "open_book, mine; from pathlib import Path; ledger = open_book(Path(sys.argv[1]))\n"
         "with ledger.current(): ledger.claim(mine(pidns=1), 'theirs', 'them')\n"
         "print(flush=True); time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, env=subprocess_env())
    try:
        assert holder.stdout is not None and holder.stdout.readline()
        with ledger.current():  # pid 1's namespace is not ours: only the lock can tell
            assert [e.name for e in ledger.live_entries()] == ["theirs"]
    finally:
        holder.kill()
        holder.wait()
    with ledger.current():  # killed: the kernel dropped its lock
        assert ledger.live_entries() == []


def test_a_forked_child_does_not_keep_its_parents_slots_alive(tmp_path: Path) -> None:
    ledger = open_book(tmp_path)
    with ledger.current():
        slot = ledger.claim(mine(pidns=1), "parent's", "me")
    ledger.forget()  # what a forked child does with the descriptor it inherited
    with ledger.current():
        assert ledger.live_entries() == []  # nobody holds the lock: taken for dead
    assert slot == 0


def test_a_lock_held_too_long_is_an_error_and_then_waited_for_briefly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = open_book(tmp_path)
    monkeypatch.setattr(book, "LOCK_SECONDS", 0.2)
    waits: list[float] = []

    class Clock:  # the lock's clock, moved by its polls alone: a loaded machine's pauses
        now = 0.0  # would make the counts below vary

        @classmethod
        def monotonic(cls) -> float:
            return cls.now

        @classmethod
        def sleep(cls, seconds: float) -> None:
            waits.append(seconds)
            cls.now += seconds

    monkeypatch.setattr(book, "time", Clock)
    other = os.open(tmp_path / "host.ledger", os.O_RDONLY)  # another open file: a conflict
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        with pytest.raises(LedgerLocked, match=r"has been locked by another process for more "
                                               r"than 0.2 s"):
            with ledger.locked():
                pass
        first = len(waits)
        with pytest.raises(LedgerLocked, match=r"is still locked by another process \(it has "
                                               r"held the lock for more than 0.2 s"):
            with ledger.current():
                pass
        second = len(waits) - first
    finally:
        os.close(other)
    assert first >= 0.2 / book._POLL_SECONDS  # polls: LOCK_SECONDS' worth, then
    assert 0 < second <= book.STUCK_SECONDS / book._POLL_SECONDS + 1  # STUCK_SECONDS' worth
    with ledger.locked():
        pass
    assert issubclass(LedgerLocked, LedgerError)


@pytest.mark.parametrize("anew", [True, False])
def test_a_slot_in_a_state_never_written_is_cleared_unless_it_is_this_processs(
        tmp_path: Path, anew: bool) -> None:
    ledger, other = open_book(tmp_path), open_book(tmp_path)
    with other.current():
        theirs = other.claim(mine(claim=7), "theirs", "them")
    with ledger.current():
        kept = ledger.claim(mine(claim=5), "kept", "me")
    for slot in (theirs, kept):  # overwritten, each with its change logged
        write_slot(ledger, slot, {"state": 9}, "garbage")
    if anew:  # a change made without the lock elsewhere: every slot is read again
        ledger.words[UNLOCKED_WORD] = 12345
    with ledger.current() as index:
        assert index.live() == [] and index.held == 0
    assert bytes(ledger.map[HEADER_BYTES + theirs * SLOT_BYTES:][:SLOT_BYTES]) == bytes(
        SLOT_BYTES)  # cleared
    assert ledger.words[(HEADER_BYTES + kept * SLOT_BYTES) // 8] == 9  # its own: left alone
    other.forget()  # its process ends: nobody locks the slot it held
    with ledger.current():
        assert ledger.claim(mine(), "new", "me") == theirs  # free again; its own is not


class _AlarmAsLocked:
    """``fcntl`` whose ``flock`` takes the lock, then raises as a signal handler would once
    the call returns (a ``TimeoutError``: an ``OSError`` without an error number)."""

    def __getattr__(self, name: str) -> object:
        return getattr(fcntl, name)

    @staticmethod
    def flock(fd: int, operation: int) -> None:
        fcntl.flock(fd, operation)
        if operation & fcntl.LOCK_EX:
            raise TimeoutError("alarm")


def test_a_signal_handlers_timeout_as_the_files_lock_is_taken_propagates_and_drops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = open_book(tmp_path)
    with monkeypatch.context() as patch:
        patch.setattr(book, "fcntl", _AlarmAsLocked())
        for taking in (ledger.locked, ledger.current):
            with pytest.raises(TimeoutError, match="alarm"), taking():
                pytest.fail("locked")
            other = os.open(ledger.path, os.O_RDONLY)  # another open file: another holder
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
            finally:
                os.close(other)


def test_a_signal_handlers_timeout_in_a_slots_lock_propagates_and_claims_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = open_book(tmp_path)

    def alarm(*args: object) -> int:
        raise TimeoutError("alarm")

    with monkeypatch.context() as patch:
        patch.setattr(book, "_range_lock", alarm)
        with ledger.current(), pytest.raises(TimeoutError, match="alarm"):
            ledger.claim(mine(), "cut", "me")  # not taken for a system without the locks
    with ledger.current():
        assert ledger.live_entries() == [] and ledger.mine == set()
        slot = ledger.claim(mine(), "whole", "me")
    with monkeypatch.context() as patch:
        patch.setattr(book, "_range_lock", alarm)
        with ledger.locked(), pytest.raises(TimeoutError, match="alarm"):
            ledger.release(slot)  # the slot is free, its lock left to the next release
    with ledger.current():
        assert ledger.live_entries() == []
