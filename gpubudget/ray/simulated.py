"""A GPU that Ray declares but the machine lacks, simulated in host memory.

``ray.init(num_gpus=2)`` on a CPU machine (tests, laptops) gives actors logical GPUs. A
:class:`SimulatedGpu` stands in for one: budgets get host memory (mapped lazily, so an 8 GiB
device costs nothing until written), and the device has a fixed total. What the budgets on it
hold is counted across the processes of the machine, through one small file per reservation
in a directory named by the device, so a second actor on the same logical GPU sees less free
memory, as it would on a real one. Reservations of processes that have exited stop counting.

The files live in ``$TMPDIR/gpubudget-simulated-gpus-<uid>/<device>/`` (:data:`LEDGER_ROOT`),
where other users write too, so they are handled with care: the directories are created
``0700`` and used only if they are this user's, not links and not writable by others; no
file is opened through a symbolic link; a record is created anew, never over an existing
file; the ``.lock`` file is opened without truncating it and used only if it is a regular
file of this user's. A directory that fails these checks is refused
(:class:`PermissionError` naming it and why: a root budget's ``BudgetError``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import os
import re
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from ..backends import Event
from ..backends.host import HostBackend, HostReservation
from ..units import format_size

__all__ = ["LEDGER_ROOT", "SimulatedGpu", "SimulatedReservation"]

LEDGER_ROOT: Final = Path(tempfile.gettempdir()) / f"gpubudget-simulated-gpus-{os.geteuid()}"
"""Where simulated devices count their reservations: one directory per device, per user."""
_serial: Final = itertools.count(1)
_RECORD_BYTES: Final = 32
"""A record holds a byte count in decimal: fewer bytes than this."""
_NO_LINK: Final = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

class SimulatedReservation:
    """Host memory held for a root budget on a simulated GPU, and its ledger record."""

    __slots__ = ("_host", "_record", "address", "nbytes")

    def __init__(self, host: HostReservation, record: Path) -> None:
        self._host = host
        self._record = record
        self.address: Final = host.address
        self.nbytes: Final = host.nbytes

    def release(self) -> None:
        self._host.release()
        with contextlib.suppress(OSError):
            self._record.unlink()


class SimulatedGpu:
    """A device of ``total`` bytes, shared by the processes of this machine that name ``key``.

    Implements the :class:`gpubudget.backends.Backend` protocol: ``reserve`` raises
    ``MemoryError`` (which a root budget turns into ``BudgetError``) when the device's free
    memory is smaller than asked.

    Examples
    --------
    >>> import tempfile
    >>> gpu = SimulatedGpu("node-gpu0", 8 * 2**30, directory=tempfile.mkdtemp())
    >>> held = gpu.reserve(6 * 2**30)            # what a root budget does at entry
    >>> gpu.mem_info()[0] // 2**30                # what every process naming it sees
    2
    >>> gpu.reserve(3 * 2**30)
    Traceback (most recent call last):
    ...
    MemoryError: simulated GPU 'node-gpu0' has 2.00 GiB free of 8.00 GiB; 3.00 GiB asked
    >>> held.release()
    >>> gpu.mem_info()[0] // 2**30
    8
    """

    name = "host"
    synchronous = True  # host memory: every free completes at once

    def __init__(self, key: str, total: int, *, directory: str | os.PathLike[str] | None = None
                 ) -> None:
        if type(total) is not int or total <= 0:
            raise ValueError(f"a simulated GPU needs a positive size in bytes, got {total!r}")
        self.key: Final = key
        self.total: Final = total
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
        self.directory: Final = Path(directory) if directory is not None else LEDGER_ROOT / safe
        self._host: Final = HostBackend(noreserve=True)

    def __repr__(self) -> str:
        return f"<SimulatedGpu {self.key!r} {format_size(self.total)}>"

    def reserve(self, nbytes: int) -> SimulatedReservation:
        with self._locked():
            free = self.total - self._held()
            if nbytes > free:
                raise MemoryError(f"simulated GPU {self.key!r} has {format_size(free)} free of "
                                  f"{format_size(self.total)}; {format_size(nbytes)} asked")
            host = self._host.reserve(nbytes)
            try:
                record = _new_record(self.directory, nbytes)
            except OSError as exc:
                host.release()
                raise MemoryError(f"simulated GPU {self.key!r}: cannot record the "
                                  f"reservation in {self.directory}: {exc}") from exc
        return SimulatedReservation(host, record)

    def mem_info(self) -> tuple[int, int]:
        with self._locked():
            return self.total - self._held(), self.total

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._host.copy(dst, src, nbytes)

    def record_event(self, stream: int) -> Event:
        return self._host.record_event(stream)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.directory.parent == LEDGER_ROOT:
            _own_directory(LEDGER_ROOT)
        else:
            self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _own_directory(self.directory)
        fd = _open_own(self.directory / ".lock", os.O_RDWR | os.O_CREAT)  # never truncated
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released when the file closes
            yield
        finally:
            os.close(fd)

    def _held(self) -> int:
        """Bytes reserved on this device by live processes; forgets records of dead ones."""
        held = 0
        for record in self.directory.iterdir():
            pid_text = record.name.partition("-")[0]
            if not pid_text.isdigit():
                continue
            if not _alive(int(pid_text)):
                with contextlib.suppress(OSError):
                    record.unlink()  # a link is removed, never followed
                continue
            with contextlib.suppress(OSError, ValueError):
                fd = _open_own(record, os.O_RDONLY)
                try:
                    held += int(os.read(fd, _RECORD_BYTES))
                finally:
                    os.close(fd)
        return held


def _own_directory(path: Path) -> None:
    """Create ``path`` (``0700``) if missing; :class:`PermissionError` unless it is a
    directory (not a link) of this user's that no one else may write in."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    problem = ("is a symbolic link" if stat.S_ISLNK(info.st_mode)
               else "is not a directory" if not stat.S_ISDIR(info.st_mode)
               else f"belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
               if info.st_uid != os.geteuid()
               else f"may be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
               if info.st_mode & 0o022 else None)
    if problem is not None:
        raise PermissionError(errno.EACCES, f"simulated GPU ledger {str(path)!r} {problem}: "
                                            f"refused")


def _open_own(path: Path, flags: int) -> int:
    """A descriptor of ``path`` opened with ``flags``, not through a link; ``OSError``
    unless it is a regular file of this user's."""
    try:
        fd = os.open(path, flags | _NO_LINK, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(errno.EACCES, f"{str(path)!r} is a symbolic link: "
                                                f"refused") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(errno.EACCES, f"{str(path)!r} is not a regular file of this "
                                            f"user's: refused")
    return fd


def _new_record(directory: Path, nbytes: int) -> Path:
    """A record of ``nbytes`` created in ``directory``, never over an existing file (a
    record a process of the same pid left is skipped)."""
    while True:
        record = directory / f"{os.getpid()}-{next(_serial)}"
        try:
            fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_LINK, 0o600)
        except FileExistsError:
            continue
        try:
            os.write(fd, str(nbytes).encode("ascii"))
        except BaseException:
            os.close(fd)
            record.unlink()
            raise
        os.close(fd)
        return record


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
