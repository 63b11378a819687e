"""One device's ledger file, mapped by every process of the host that registers on it.

:class:`DeviceBook` is this process's handle on it: the file mapped shared, the lock that
every change of a slot's owner takes (``flock``, held for microseconds: never across a
device call, never for a scan of the slots), the index of the slots this process keeps
current from the file's change log (:mod:`~gpubudget.hostledger.index`), and the slots this
process claims, each locked with an open-file-description lock (``F_OFD_SETLK``) for as
long as it is held. The kernel drops those locks when the process ends, however it ends, so
a slot whose process cannot be checked by pid (another PID namespace) is still known dead
when nobody locks it. :func:`read_book` reads a file without changing anything
(``gpubudget top``, metrics).

Slots of processes that have ended are cleared (*reaped*) by the next claim on the device,
under the lock; readers skip them until then. Their numbers are never trusted.

A process that keeps the lock longer than :data:`LOCK_SECONDS` (one stopped while it held
it) makes a claim give up with :class:`~gpubudget.hostledger.errors.LedgerLocked`; until
the lock is had again, this process waits only :data:`STUCK_SECONDS` each time. Meanwhile
a slot's owner still marks it reserved, or frees it, without the lock (its own slot only),
and leaves a new mark in the header, so that every process reads every slot again.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Final

from ..errors import raise_if_from_outside
from ..holding import holding
from .children import ChildBudget, read_children
from .errors import LedgerDamaged, LedgerError, LedgerFull, LedgerLocked
from .files import LedgerDirectory
from .index import ProcessKey, SlotIndex
from .layout import (
    CHANGES_WORD,
    CHILDREN,
    CLAIMED,
    FILE_BYTES,
    FREE,
    HEADER_BYTES,
    LIMIT_BYTES,
    LIMIT_TEXT,
    LOG_LENGTH,
    LOG_WORD,
    PAGE_BYTES,
    PAGES,
    RESERVED,
    SLOT_BYTES,
    SLOTS,
    UNLOCKED_WORD,
    Damage,
    Entry,
    Header,
    decode_entry,
    decode_header,
    encode_slot,
    header_word,
    slot_word,
    text_field,
)
from .procs import alive

__all__ = ["LOCK_SECONDS", "STUCK_SECONDS", "DeviceBook", "Snapshot", "read_book"]

LOCK_SECONDS: Final = 0.5
"""How long a claim waits for the ledger's lock before it gives up. The lock is held for
microseconds (tens of milliseconds at worst, by a process the scheduler put aside); longer
means a process stopped while holding it."""
STUCK_SECONDS: Final = 0.02
"""How long a claim waits for the lock once a wait of this process timed out, until the lock
is had again: a stopped process costs one :data:`LOCK_SECONDS` wait, not one per root."""
_POLL_SECONDS: Final = 0.0005
_FLOCK: Final = struct.Struct("hhqqi0q")  # struct flock: type, whence, start, len, pid
_OFD: Final = (getattr(fcntl, "F_OFD_SETLK", None), getattr(fcntl, "F_OFD_GETLK", None))
_HIGH: Final = header_word("high")
_STATES: Final = (FREE, CLAIMED, RESERVED)


@dataclass(frozen=True)
class Snapshot:
    """A ledger file as read at one moment: its header, the slots of live processes (those
    that ended are counted in ``ended``, not listed) and their children, by root slot."""

    header: Header
    entries: tuple[Entry, ...]
    ended: int
    children: dict[int, tuple[ChildBudget, ...]]
    serials: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Each root's children's serials (their budget numbers), in the order of ``children``."""


def _range_lock(fd: int, command: int, kind: int, slot: int) -> int:
    """One ``fcntl`` record-lock call on slot ``slot``'s bytes; the lock type it answers."""
    request = _FLOCK.pack(kind, os.SEEK_SET, HEADER_BYTES + slot * SLOT_BYTES, SLOT_BYTES, 0)
    answer = fcntl.fcntl(fd, command, request)
    return int(_FLOCK.unpack(answer)[0])


def _locked_by_anyone(fd: int, slot: int) -> bool | None:
    """Whether some process holds slot ``slot``'s lock (``None`` where the system has no
    open-file-description locks). ``fd`` must hold none itself."""
    if _OFD[1] is None:
        return None
    try:
        return _range_lock(fd, _OFD[1], fcntl.F_WRLCK, slot) != fcntl.F_UNLCK
    except OSError as exc:
        raise_if_from_outside(exc)
        return None


def _running(process: ProcessKey, slot: int, fd: int) -> bool:
    """Whether ``process`` (the owner of ``slot``) still runs: by pid and start time, else
    by the slot's lock."""
    answer = alive(*process)
    if answer is None:
        answer = _locked_by_anyone(fd, slot) is not False
    return answer


def _live(entries: list[Entry], fd: int) -> list[bool]:
    """Whether the process of each entry still runs (asked once per process)."""
    answers: dict[ProcessKey, bool] = {}
    found = []
    for entry in entries:
        process = (entry.pid, entry.start, entry.pidns, entry.boot)
        if process not in answers:
            answers[process] = _running(process, entry.slot, fd)
        found.append(answers[process])
    return found


def _entries(data: bytes, high: int) -> list[Entry]:
    found = (decode_entry(data, slot * SLOT_BYTES, slot) for slot in range(high))
    return [entry for entry in found if entry is not None]


class DeviceBook:
    """This process's handle on one device's ledger file (see the module docstring)."""

    def __init__(self, directory: LedgerDirectory, identity: str, label: str, total: int,
                 hard: bool) -> None:
        name = directory.file_name(identity)
        self.path: Final = directory.path / name
        self.fd, header = directory.create(name, identity, label, total, hard)
        try:
            if header.identity != identity:
                raise LedgerError(f"the ledger file {str(self.path)!r} belongs to device "
                                  f"{header.identity!r}, not {identity!r}")
            self.map: Final = mmap.mmap(self.fd, FILE_BYTES, mmap.MAP_SHARED,
                                        mmap.PROT_READ | mmap.PROT_WRITE)
            self.words: Final = memoryview(self.map).cast("Q")
            self.data: Final = memoryview(self.map)
            # Slot locks live on a descriptor of their own, which a forked child closes
            # (see forget()); the mapping's descriptor never holds one.
            self.locks_fd: int | None = directory.open(name, writable=True)[0]
        except BaseException:
            os.close(self.fd)
            raise
        self.identity: Final = identity
        # flock is per open file, not per thread: one thread at a time. Re-entrant, with the
        # file's lock counted (_holding), so that a thread never waits for itself: a
        # ``with locked()`` whose ``__exit__`` an exception cut as it began is left
        # suspended, holding both, for as long as that exception's traceback is kept.
        self.threads: Final = threading.RLock()
        self.index: Final = SlotIndex()
        self.mine: Final[set[int]] = set()
        """The slots this process holds."""
        self._holding = 0  # how many times this process's thread took the file's lock
        self._stuck = False

    # -- the lock --------------------------------------------------------------------------

    @holding
    def locked(self, wait: float | None = None) -> Generator[None, None, None]:
        """The file's lock, exclusive, for a change of slot owners; :class:`LedgerLocked`
        after :data:`LOCK_SECONDS` (:data:`STUCK_SECONDS` while the lock seems stuck), or
        after ``wait`` seconds if given (a wait that short says nothing of a stuck lock).
        Another thread of this process using the file is waited for first (it holds the
        file's lock no longer than that either): ``with``, so that no exception landing
        from outside can leave the thread lock taken."""
        with self.threads:
            try:
                self._take(wait)
                yield
            finally:  # _drop(), inline: no call before the unlock
                if self._holding:
                    self._holding -= 1
                    if not self._holding:
                        fcntl.flock(self.fd, fcntl.LOCK_UN)

    @holding
    def current(self) -> Generator[SlotIndex, None, None]:
        """The file's lock, with the index brought up to date and the slots of processes
        that have ended cleared: what a claim needs. Processes are checked (a read of
        ``/proc`` each) and a stale index's slots decoded without the lock; under it, only
        the slots changed since are read. :class:`LedgerDamaged` for a damaged file."""
        with self.threads:
            index = self.index
            checked = set(index.owners)
            ended = self._ended(checked)  # without the lock
            try:
                self._take()
                if not self._catch_up():  # too far behind: copy, decode without the lock
                    copied = self._copy()
                    self._drop()
                    index.rebuild(*copied)
                    ended |= self._ended(set(index.owners) - checked)
                    checked |= set(index.owners)
                    self._take()
                    if not self._catch_up():  # very busy: decode under the lock after all
                        index.rebuild(*self._copy())
                ended |= self._ended(set(index.owners) - checked)  # seen only under the lock
                doomed = {slot for slot in index.damaged  # unless rewritten since
                          if self.words[slot_word(slot, "state")] not in _STATES}
                index.damaged.clear()
                for process in ended:
                    doomed.update(index.owners.get(process, ()))
                for slot in sorted(doomed - self.mine):
                    self._clear(slot)
                yield index
            finally:  # _drop(), inline: no call before the unlock
                if self._holding:
                    self._holding -= 1
                    if not self._holding:
                        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _take(self, wait: float | None = None) -> None:
        short = wait is not None
        if wait is None:
            wait = STUCK_SECONDS if self._stuck else LOCK_SECONDS
        if self._holding:  # this thread holds it already (see ``threads``)
            self._holding += 1
            return
        deadline = time.monotonic() + wait
        while True:
            try:
                self._holding = 1  # first: an exception landing as flock returns is dropped
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._holding = 0
                if time.monotonic() > deadline:
                    self._stuck = self._stuck or not short
                    raise LedgerLocked(_locked_message(self.path, wait)) from None
                time.sleep(_POLL_SECONDS)
            else:
                self._stuck = False
                return

    def _drop(self) -> None:
        if self._holding:
            self._holding -= 1
            if not self._holding:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _catch_up(self) -> bool:
        """Lock held: read the index up to date from the log; ``False`` if it must be
        rebuilt."""
        try:
            return self.index.catch_up(self.words, self.data)
        except Damage as exc:
            raise LedgerDamaged(f"the ledger file {str(self.path)!r}: {exc}; remove it") from None

    def _copy(self) -> tuple[bytes, int, int, int]:
        """Lock held: the slots in use, the count of slots in use, the change count and the
        mark of the last change made without the lock, as they are now (the mark read
        first: a change made without the lock while the slots are copied leaves a mark that
        is new to the index)."""
        mark = self.words[UNLOCKED_WORD]
        changes = self.words[CHANGES_WORD]
        high = self.words[_HIGH]
        if high > SLOTS:
            raise LedgerDamaged(f"the ledger file {str(self.path)!r}: damaged header ({high} "
                                f"slots in use of {SLOTS}); remove it")
        slots = bytes(self.data[HEADER_BYTES: HEADER_BYTES + high * SLOT_BYTES])
        return slots, high, changes, mark

    def _ended(self, processes: set[ProcessKey]) -> set[ProcessKey]:
        """Which of ``processes`` (owners of slots in the index) have ended."""
        owners = self.index.owners
        return {process for process in processes if owners.get(process)
                and not _running(process, next(iter(owners[process])), self.fd)}

    # -- under the lock --------------------------------------------------------------------

    def header(self) -> Header:
        """The file's header; :class:`LedgerDamaged` if it is not one this version wrote."""
        try:
            return decode_header(self.map[:HEADER_BYTES])
        except ValueError as exc:
            raise LedgerDamaged(f"the ledger file {str(self.path)!r}: {exc}; remove it") from None

    def live_entries(self) -> list[Entry]:
        """Under :meth:`current`: the slots of live processes, in slot order."""
        return self.index.live()

    def claim(self, numbers: dict[str, int], name: str, process: str) -> int:
        """Under :meth:`current`: write a new slot (state ``claimed``) and lock it for this
        process; return its number. :class:`LedgerFull` when every slot is taken."""
        words = self.words
        candidates = self.index.free_slots()
        try:
            for slot in candidates:
                if (slot in self.mine or words[slot_word(slot, "state")] != FREE
                        or not self._lock_slot(slot)):
                    continue
                offset = HEADER_BYTES + slot * SLOT_BYTES
                written = encode_slot({**numbers, "state": FREE}, name, process)
                self.map[offset + 8: offset + SLOT_BYTES] = written[8:]
                words[slot_word(slot, "state")] = CLAIMED  # last: readers see it whole
                if slot >= words[_HIGH]:
                    words[_HIGH] = slot + 1
                self.mine.add(slot)
                self._changed(slot)
                return slot
        finally:
            candidates.close()
        raise LedgerFull(f"the ledger file {str(self.path)!r} is full: {SLOTS} root budgets "
                         f"of live processes are registered on this device")

    def reserved(self, slot: int, nbytes: int, at: int) -> None:
        """Lock held: slot ``slot``'s memory is reserved (``nbytes`` at ``at`` ns)."""
        self._mark_reserved(slot, nbytes, at)
        self._changed(slot)

    def release(self, slot: int) -> None:
        """Lock held: slot ``slot`` is free again, and no longer locked by this process."""
        self._clear(slot)
        self._unlock_slot(slot)

    def set_cap(self, cap: int | None) -> None:
        """Lock held: the host-wide cap of the device (``None``: none)."""
        self.words[header_word("cap")] = cap or 0

    def set_device(self, total: int, hard: bool, limit: int | None = None,
                   limited_by: str = "") -> None:
        """Lock held: the device's memory as this process sees it, and the limit set on it
        from outside that this process read (``None``: none), named by ``limited_by``."""
        self.words[header_word("total")] = total
        self.words[header_word("hard")] = int(hard)
        self.words[header_word("limit")] = limit or 0
        self.data[LIMIT_TEXT: LIMIT_TEXT + LIMIT_BYTES] = text_field(
            limited_by if limit else "", LIMIT_BYTES).ljust(LIMIT_BYTES, b"\0")

    # -- without the lock: this process's own slots, when the lock cannot be had -----------

    def reserved_unlocked(self, slot: int, nbytes: int, at: int) -> None:
        """What :meth:`reserved` does, without the lock (the slot is this process's; the
        next process to take the lock reads every slot again)."""
        self._mark_reserved(slot, nbytes, at)
        self.words[UNLOCKED_WORD] = _new_mark()

    def release_unlocked(self, slot: int) -> None:
        """What :meth:`release` does, without the lock (see :meth:`reserved_unlocked`)."""
        self._wipe(slot)
        self.mine.discard(slot)
        self.words[UNLOCKED_WORD] = _new_mark()
        self._unlock_slot(slot)

    # -- the words -------------------------------------------------------------------------

    def _mark_reserved(self, slot: int, nbytes: int, at: int) -> None:
        words = self.words
        words[slot_word(slot, "reserved")] = nbytes
        words[slot_word(slot, "reserved_at")] = at
        words[slot_word(slot, "state")] = RESERVED

    def _changed(self, slot: int) -> None:
        """Lock held: count a change of slot ``slot`` in the header and log it; the index
        follows at once if it was current."""
        words = self.words
        before = words[CHANGES_WORD]
        after = (before + 1) % (1 << 64)
        words[LOG_WORD + after % LOG_LENGTH] = slot
        words[CHANGES_WORD] = after
        index = self.index
        if index.changes == before:
            index.reread(slot, self.data)
            index.changes = after

    def _wipe(self, slot: int) -> None:
        offset = HEADER_BYTES + slot * SLOT_BYTES
        self.words[slot_word(slot, "state")] = FREE  # first: readers skip it from now on
        self.map[offset + 8: offset + SLOT_BYTES] = bytes(SLOT_BYTES - 8)

    def _clear(self, slot: int) -> None:
        """Lock held: slot ``slot`` is free."""
        self._wipe(slot)
        self.mine.discard(slot)
        self._changed(slot)

    def _lock_slot(self, slot: int) -> bool:
        """Take slot ``slot``'s lock for this process; ``False`` if someone holds it (an
        inherited descriptor of a process that has ended)."""
        if self.locks_fd is None or _OFD[0] is None:
            return True
        try:
            _range_lock(self.locks_fd, _OFD[0], fcntl.F_WRLCK, slot)
        except (BlockingIOError, PermissionError):
            return False
        except OSError as exc:  # no open-file-description locks here: pids decide alone
            raise_if_from_outside(exc)
            return True
        return True

    def _unlock_slot(self, slot: int) -> None:
        if self.locks_fd is not None and _OFD[0] is not None:
            try:
                _range_lock(self.locks_fd, _OFD[0], fcntl.F_UNLCK, slot)
            except OSError as exc:
                raise_if_from_outside(exc)

    def forget(self) -> None:
        """In a forked child: drop the inherited slot locks (they are the parent's)."""
        fd, self.locks_fd = self.locks_fd, None
        self.mine.clear()
        if fd is not None:
            os.close(fd)


def _new_mark() -> int:
    """A mark for a change made without the lock: random, never 0 (a new file's)."""
    return int.from_bytes(os.urandom(8), "little") | 1


def _locked_message(path: object, wait: float) -> str:
    if wait < LOCK_SECONDS:
        return (f"the ledger file {str(path)!r} is still locked by another process (it has "
                f"held the lock for more than {LOCK_SECONDS:g} s: stopped while changing it?)")
    return (f"the ledger file {str(path)!r} has been locked by another process for more "
            f"than {wait:g} s (one stopped while changing it?)")


_stuck_files: set[str] = set()
"""Ledger files whose lock a reader of this process could not have in time, last it tried."""


def _shared_lock(fd: int, where: str) -> bool:
    """Take a shared lock on ``fd`` within :data:`LOCK_SECONDS` (:data:`STUCK_SECONDS` if
    the last try on this file timed out); ``False`` if it cannot."""
    deadline = time.monotonic() + (STUCK_SECONDS if where in _stuck_files else LOCK_SECONDS)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() > deadline:
                _stuck_files.add(where)
                return False
            time.sleep(_POLL_SECONDS)
        else:
            _stuck_files.discard(where)
            return True


def read_book(directory: LedgerDirectory, name: str) -> Snapshot:
    """Read one ledger file without changing it: its header, the slots of processes that
    still run and their children. ``LedgerError`` for a bad file. It reads under a shared
    lock; if another process keeps the lock longer than :data:`LOCK_SECONDS`
    (:data:`STUCK_SECONDS` while it keeps it), it reads without it (a slot being written
    then is skipped or read as it was)."""
    where = str(directory.path / name)
    fd, _ = directory.open(name, writable=False)
    try:
        locked = _shared_lock(fd, where)
        try:
            try:
                header = decode_header(os.pread(fd, HEADER_BYTES, 0))
            except ValueError as exc:
                raise LedgerError(f"the ledger file {where!r}: {exc}") from None
            data = os.pread(fd, header.high * SLOT_BYTES, HEADER_BYTES)  # the slots in use
            pages = os.pread(fd, min(header.pages_high, PAGES) * PAGE_BYTES, CHILDREN)
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
        if len(data) != header.high * SLOT_BYTES:
            raise LedgerError(f"the ledger file {where!r} is shorter than its header says "
                              f"(cut while it was read?)")
        entries = _entries(data, header.high)
        live = tuple(entry for entry, running in zip(entries, _live(entries, fd)) if running)
        serials: dict[int, tuple[int, ...]] = {}
        children = read_children(pages, live, serials)
        return Snapshot(header, live, len(entries) - len(live), children, serials)
    finally:
        os.close(fd)
