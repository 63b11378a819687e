"""One device's ledger file, mapped by every process of the host that registers on it.

:class:`DeviceBook` is this process's handle on it: the file mapped shared, the lock that
every change of a slot's owner takes (``flock``, held for microseconds: never across a
device call), and the slots this process claims, each locked with an open-file-description
lock (``F_OFD_SETLK``) for as long as it is held. The kernel drops those locks when the
process ends, however it ends, so a slot whose process cannot be checked by pid (another
PID namespace) is still known dead when nobody locks it. :func:`read_book` reads a file
without changing anything (``gpubudget top``, metrics).

Slots of processes that have ended are cleared (*reaped*) by the next claim on the device,
under the lock; readers skip them until then. Their numbers are never trusted.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from .errors import LedgerError
from .files import LedgerDirectory
from .layout import (
    CLAIMED,
    FILE_BYTES,
    FREE,
    HEADER_BYTES,
    RESERVED,
    SLOT_BYTES,
    SLOTS,
    Entry,
    Header,
    decode_entry,
    decode_header,
    encode_slot,
    header_word,
    slot_word,
)
from .procs import alive

__all__ = ["LOCK_SECONDS", "DeviceBook", "Snapshot", "read_book"]

LOCK_SECONDS: Final = 10.0
"""How long a claim waits for the ledger's lock before it gives up (it is held for
microseconds; longer means a process stopped while holding it)."""
_FLOCK: Final = struct.Struct("hhqqi0q")  # struct flock: type, whence, start, len, pid
_OFD: Final = (getattr(fcntl, "F_OFD_SETLK", None), getattr(fcntl, "F_OFD_GETLK", None))


@dataclass(frozen=True)
class Snapshot:
    """A ledger file as read at one moment: its header and the slots of live processes
    (those that ended are counted in ``ended``, not listed)."""

    header: Header
    entries: tuple[Entry, ...]
    ended: int


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
    except OSError:
        return None


def _live(entries: list[Entry], fd: int) -> list[bool]:
    """Whether the process of each entry still runs (by pid and start time, asked once per
    process; else by the slot's lock)."""
    answers: dict[tuple[int, int, int, int], bool | None] = {}
    found = []
    for entry in entries:
        process = (entry.pid, entry.start, entry.pidns, entry.boot)
        if process not in answers:
            answers[process] = alive(*process)
        answer = answers[process]
        if answer is None:
            answer = _locked_by_anyone(fd, entry.slot) is not False
        found.append(answer)
    return found


def _entries(data: bytes, high: int) -> list[Entry]:
    found = []
    for slot in range(high):
        entry = decode_entry(data, slot * SLOT_BYTES, slot)
        if entry is not None:
            found.append(entry)
    return found


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
            # Slot locks live on a descriptor of their own, which a forked child closes
            # (see forget()); the mapping's descriptor never holds one.
            self.locks_fd: int | None = directory.open(name, writable=True)[0]
        except BaseException:
            os.close(self.fd)
            raise
        self.identity: Final = identity
        self.threads: Final = threading.Lock()  # flock is per open file, not per thread

    # -- the lock --------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The file's lock, exclusive, for a change of slot owners; ``LedgerError`` after
        :data:`LOCK_SECONDS`."""
        with self.threads:
            _flock(self.fd, fcntl.LOCK_EX, self.path)
            try:
                yield
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    # -- under the lock --------------------------------------------------------------------

    def header(self) -> Header:
        return decode_header(self.map[:HEADER_BYTES])

    def live_entries(self) -> list[Entry]:
        """Lock held: clear the slots of processes that have ended; the others."""
        high = self.words[header_word("high")]
        entries = _entries(self.map[HEADER_BYTES: HEADER_BYTES + high * SLOT_BYTES], high)
        live = []
        for entry, running in zip(entries, _live(entries, self.fd)):
            if running:
                live.append(entry)
            else:
                self._clear(entry.slot)
        return live

    def claim(self, numbers: dict[str, int], name: str, process: str) -> int:
        """Lock held: write a new slot (state ``claimed``) and lock it for this process;
        return its number. ``LedgerError`` when every slot is taken."""
        words = self.words
        high = words[header_word("high")]
        for slot in range(SLOTS):  # the first free one (all are free from ``high`` on)
            if words[slot_word(slot, "state")] != FREE or not self._lock_slot(slot):
                continue
            offset = HEADER_BYTES + slot * SLOT_BYTES
            self.map[offset: offset + SLOT_BYTES] = encode_slot(
                {**numbers, "state": CLAIMED}, name, process)
            if slot >= high:
                words[header_word("high")] = slot + 1
            return slot
        raise LedgerError(f"the ledger file {str(self.path)!r} is full: {SLOTS} root budgets "
                          f"of live processes are registered on this device")

    def reserved(self, slot: int, nbytes: int, at: int) -> None:
        """Lock held: slot ``slot``'s memory is reserved (``nbytes`` at ``at`` ns)."""
        words = self.words
        words[slot_word(slot, "reserved")] = nbytes
        words[slot_word(slot, "reserved_at")] = at
        words[slot_word(slot, "state")] = RESERVED

    def release(self, slot: int) -> None:
        """Lock held: slot ``slot`` is free again, and no longer locked by this process."""
        self._clear(slot)
        if self.locks_fd is not None and _OFD[0] is not None:
            try:
                _range_lock(self.locks_fd, _OFD[0], fcntl.F_UNLCK, slot)
            except OSError:
                pass

    def set_cap(self, cap: int | None) -> None:
        """Lock held: the host-wide cap of the device (``None``: none)."""
        self.words[header_word("cap")] = cap or 0

    def set_device(self, total: int, hard: bool) -> None:
        """Lock held: the device's memory as this process sees it."""
        self.words[header_word("total")] = total
        self.words[header_word("hard")] = int(hard)

    def _clear(self, slot: int) -> None:
        offset = HEADER_BYTES + slot * SLOT_BYTES
        self.map[offset: offset + SLOT_BYTES] = bytes(SLOT_BYTES)

    def _lock_slot(self, slot: int) -> bool:
        """Take slot ``slot``'s lock for this process; ``False`` if someone holds it (an
        inherited descriptor of a process that has ended)."""
        if self.locks_fd is None or _OFD[0] is None:
            return True
        try:
            _range_lock(self.locks_fd, _OFD[0], fcntl.F_WRLCK, slot)
        except (BlockingIOError, PermissionError):
            return False
        except OSError:  # no open-file-description locks here: pids decide alone
            return True
        return True

    def forget(self) -> None:
        """In a forked child: drop the inherited slot locks (they are the parent's)."""
        fd, self.locks_fd = self.locks_fd, None
        if fd is not None:
            os.close(fd)


def _flock(fd: int, kind: int, path: object) -> None:
    deadline = time.monotonic() + LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise LedgerError(f"the ledger file {str(path)!r} has been locked by another "
                                  f"process for more than {LOCK_SECONDS:g} s (one stopped "
                                  f"while changing it?)") from None
            time.sleep(0.0005)


def read_book(directory: LedgerDirectory, name: str) -> Snapshot:
    """Read one ledger file without changing it (a shared lock while reading): its header
    and the slots of processes that still run. ``LedgerError`` for a bad file."""
    fd, _ = directory.open(name, writable=False)
    try:
        _flock(fd, fcntl.LOCK_SH, directory.path / name)
        try:
            try:
                header = decode_header(os.pread(fd, HEADER_BYTES, 0))
            except ValueError as exc:
                raise LedgerError(f"the ledger file {str(directory.path / name)!r}: "
                                  f"{exc}") from None
            data = os.pread(fd, header.high * SLOT_BYTES, HEADER_BYTES)  # the slots in use
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        entries = _entries(data, header.high)
        live = tuple(entry for entry, running in zip(entries, _live(entries, fd)) if running)
        return Snapshot(header, live, len(entries) - len(live))
    finally:
        os.close(fd)
