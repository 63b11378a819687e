"""The door file: each budget's driver-door numbers, live, for other processes to read.

Under the driver door, a process whose roots register in the host ledger makes one file in
the ledger's directory, ``door-<pid>.door``, and hands it to the door (``gbd_share``), which
from then on keeps each budget's account in one of its rows: what ``gpubudget top`` and
``gpubudget metrics`` show of the door is read from there, as the hooks change it, with
nothing copied and no thread (the hooks write nothing more for it than they did). Layout, in
the machine's byte order (the file never leaves the host):

    bytes 0 .. 8191       header: unsigned 64-bit words ``magic, version, pid, start,
                          pidns, boot, rows, row bytes, libraries named, attribute only``,
                          then from byte 4096 the libraries' names (64 of 64 bytes, NUL-padded; [0] is
                          "(other)")
    8192 + 1536 * i       row i: an account's words (:data:`ROW_FIELDS`: ``state`` 1 while it
                          is a budget's), then 64 refusals per library, then 64 live bytes per
                          library, then words only its process reads

A row names its budget as the ledger does: ``kind`` 1 is a registered root (``serial`` its
slot's serial), 2 a child (``serial`` its budget number, as its ledger row says). The door
writes the rows; this process writes the header at creation and removes the file at exit. A
forked child keeps a private copy: its numbers never show in its parent's file.

:func:`read_doors` reads every door file of a directory, trusting nothing: a file of another
format, of a process that has ended, or too short is left out; a number out of range reads
as 0.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import struct
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from ..errors import raise_if_from_outside

if TYPE_CHECKING:
    from ..report import DoorLibrary

__all__ = ["DoorShare", "FILE_BYTES", "HEADER_BYTES", "ROWS", "ROW_BYTES", "ROW_FIELDS",
           "door_key", "read_doors", "share"]

MAGIC: Final = int.from_bytes(b"GPUBDOOR", "little")
VERSION: Final = 1
HEADER_BYTES: Final = 8192
NAMES: Final = 4096
NAME_BYTES: Final = 64
LIBS: Final = 64
ROW_BYTES: Final = 1536
ROWS: Final = 256
"""Accounts a door file holds at once; budgets past them work as always and are not shown."""
FILE_BYTES: Final = HEADER_BYTES + ROWS * ROW_BYTES
HEADER_FIELDS: Final = ("magic", "version", "pid", "start", "pidns", "boot", "rows",
                        "row_bytes", "libraries", "attribute_only")
ROW_FIELDS: Final = ("held", "core", "own", "limit", "state", "kind", "serial", "refusals",
                     "peak", "last_refused", "last_refused_lib")
"""The first words of a row, as door.c's ``struct gbd_account`` lays them out."""
_REFUSED: Final = 16
_LIVE: Final = 80
_SHARED_WORDS: Final = 144
ROOT: Final = 1
CHILD: Final = 2
_SUFFIX: Final = ".door"
_MOST: Final = 1 << 62


def door_key(pid: int, kind: int, serial: int) -> tuple[int, int, int]:
    """How :func:`read_doors` names a budget: its process, ``kind`` (:data:`ROOT` or
    :data:`CHILD`) and serial."""
    return (pid, kind, serial)


@dataclass(frozen=True)
class DoorShare:
    """One budget's driver-door numbers as another process reads them from a door file."""

    held: int
    """Bytes libraries took through the door in the budget's scope and its children's, live
    now (a root's own reservation or granules not counted)."""
    peak: int
    """The most the door held for it at once, a root's own memory included."""
    refusals: int
    """Requests its limit refused."""
    last_refused: int
    """The size of the last one, 0 if none."""
    last_refused_by: str | None
    """The library that asked it."""
    libraries: tuple[DoorLibrary, ...]
    """The budget's own driver allocations by library (live bytes, refusals), largest first."""
    attribute_only: bool
    """Its process counts without refusing (``gpubudget run --attribute-only``)."""

    def as_dict(self) -> dict[str, object]:
        return {"held": self.held, "peak": self.peak, "refusals": self.refusals,
                "last_refused": self.last_refused, "last_refused_by": self.last_refused_by,
                "libraries": [{"name": lib.name, "live": lib.live, "refusals": lib.refusals}
                              for lib in self.libraries],
                "attribute_only": self.attribute_only}


# -- writing: this process's file ----------------------------------------------------------

_made: list[str] = []  # the path of this process's file, once made


def share(lib: ctypes.CDLL) -> None:
    """Make this process's door file in the ledger's directory and hand it to the door, once,
    where roots register in the host ledger. Failing that (the directory cannot be written),
    the door works as before and ``top`` shows nothing of it: said once, as a warning."""
    from ..hostledger.claims import ledger_enabled

    if not ledger_enabled():
        return
    from ..hostledger.errors import LedgerError
    from ..hostledger.files import LedgerDirectory, ledger_directory
    from ..hostledger.procs import myself

    try:
        directory = LedgerDirectory(ledger_directory(), create=True)
    except LedgerError as exc:
        warnings.warn(f"gpubudget: the driver door's numbers are not shown to top or "
                      f"metrics: {exc}", RuntimeWarning, stacklevel=2)
        return
    me = myself()
    name = f"door-{me.pid}{_SUFFIX}"
    temporary = f".{name}.{os.urandom(4).hex()}"
    header = [MAGIC, VERSION, me.pid, me.start, me.pidns, me.boot, ROWS, ROW_BYTES, 0,
              int(bool(lib.gbd_attribute_only()))]
    try:
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600, dir_fd=directory.fd)
        try:
            os.fchmod(fd, 0o600 if directory.private else 0o644)
            os.ftruncate(fd, FILE_BYTES)
            # unsigned: a boot id is 64 random bits (the rows are the door's signed words)
            os.pwrite(fd, struct.pack(f"={len(header)}Q", *header), 0)
            os.replace(temporary, name, src_dir_fd=directory.fd, dst_dir_fd=directory.fd)
            if lib.gbd_share(fd, FILE_BYTES) != 0:
                number = ctypes.get_errno()
                raise OSError(number, os.strerror(number) if number else "gbd_share failed")
        finally:
            os.close(fd)
    except OSError as exc:
        for leftover in (temporary, name):
            try:
                os.unlink(leftover, dir_fd=directory.fd)
            except OSError as gone:
                raise_if_from_outside(gone)
        directory.close()
        raise_if_from_outside(exc)  # a signal handler's, not the file's: it propagates
        warnings.warn(f"gpubudget: the driver door's numbers are not shown to top or "
                      f"metrics: cannot make {str(directory.path / name)!r}: "
                      f"{exc.strerror or exc}", RuntimeWarning, stacklevel=2)
        return
    path = str(directory.path / name)
    directory.close()
    _made.append(path)
    atexit.register(_remove, path, me.pid)


def _remove(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked child leaves its parent's file alone
        try:
            os.unlink(path)
        except OSError as exc:
            raise_if_from_outside(exc)


# -- reading: every process's file ---------------------------------------------------------

def read_doors(directory: str | os.PathLike[str]) -> dict[tuple[int, int, int], DoorShare]:
    """Every budget shown in the door files of ``directory`` (see the module docstring), by
    :func:`door_key`; a directory that cannot be read has none."""
    from ..hostledger.procs import alive

    try:
        names = [name for name in os.listdir(directory)
                 if name.endswith(_SUFFIX) and name.startswith("door-")]
    except OSError as exc:
        raise_if_from_outside(exc)
        return {}
    found: dict[tuple[int, int, int], DoorShare] = {}
    for name in sorted(names):
        data = _read(os.path.join(directory, name))
        if data is None or len(data) < HEADER_BYTES:
            continue
        words = memoryview(data).cast("q")
        header = dict(zip(HEADER_FIELDS, memoryview(data).cast("Q")[: len(HEADER_FIELDS)]))
        if (header["magic"] != MAGIC or header["version"] != VERSION
                or header["row_bytes"] != ROW_BYTES or not 0 < header["rows"] <= 1 << 20):
            continue
        pid = header["pid"]
        if alive(pid, header["start"], header["pidns"], header["boot"]) is False:
            continue
        names_known = _names(data, header["libraries"])
        rows = min(header["rows"], (len(data) - HEADER_BYTES) // ROW_BYTES)
        for row in range(rows):
            share = _row(words, (HEADER_BYTES + row * ROW_BYTES) // 8, names_known,
                         bool(header["attribute_only"]))
            if share is not None:
                found[door_key(pid, share[0], share[1])] = share[2]
    return found


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise_if_from_outside(exc)
        return None
    try:
        import stat

        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > HEADER_BYTES + (1 << 20) * ROW_BYTES:
            return None
        return os.pread(fd, info.st_size - info.st_size % 8, 0)
    except OSError as exc:
        raise_if_from_outside(exc)
        return None
    finally:
        os.close(fd)


def _names(data: bytes, count: int) -> list[str]:
    count = max(1, min(count, LIBS))
    names = []
    for index in range(count):
        raw = data[NAMES + index * NAME_BYTES: NAMES + (index + 1) * NAME_BYTES]
        names.append(raw.split(b"\0", 1)[0].decode("utf-8", "replace") or "(other)")
    return names


def _number(value: int) -> int:
    return value if 0 <= value < _MOST else 0


def _row(words: memoryview, at: int, names: list[str], attribute_only: bool
         ) -> tuple[int, int, DoorShare] | None:
    from ..report import DoorLibrary

    row = dict(zip(ROW_FIELDS, words[at: at + len(ROW_FIELDS)]))
    if row["state"] != 1 or row["kind"] not in (ROOT, CHILD) or row["serial"] <= 0:
        return None
    libraries = []
    for index, name in enumerate(names):
        live = _number(words[at + _LIVE + index])
        refused = _number(words[at + _REFUSED + index])
        if live or refused:
            libraries.append(DoorLibrary(name, live, refused))
    libraries.sort(key=lambda lib: (-lib.live, lib.name))
    last = row["last_refused_lib"]
    refusals = _number(row["refusals"])
    held = max(_number(row["held"]) - _number(row["own"]), 0)
    share = DoorShare(held, _number(row["peak"]), refusals, _number(row["last_refused"]),
                      names[last] if refusals and 0 <= last < len(names) else None,
                      tuple(libraries), attribute_only)
    return row["kind"], row["serial"], share
