"""A GPU that Ray declares but the machine lacks, simulated in host memory.

``ray.init(num_gpus=2)`` on a CPU machine (tests, laptops) gives actors logical GPUs. A
:class:`SimulatedGpu` stands in for one: budgets get host memory (mapped lazily, so an 8 GiB
device costs nothing until written), and the device has a fixed total. What the budgets on it
hold is counted across the processes of the machine, through one small file per reservation
in a directory named by the device, so a second actor on the same logical GPU sees less free
memory, as it would on a real one. Reservations of processes that have exited stop counting.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from ..backends import Event
from ..backends.host import HostBackend, HostReservation
from ..units import format_size

__all__ = ["LEDGER_ROOT", "SimulatedGpu", "SimulatedReservation"]

LEDGER_ROOT: Final = Path(tempfile.gettempdir()) / "gpubudget-simulated-gpus"
"""Where simulated devices count their reservations: one directory per device."""
_serial: Final = itertools.count(1)

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
            record = self.directory / f"{os.getpid()}-{next(_serial)}"
            try:
                record.write_text(str(nbytes), encoding="ascii")
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
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _held(self) -> int:
        """Bytes reserved on this device by live processes; forgets records of dead ones."""
        held = 0
        for record in self.directory.iterdir():
            pid_text = record.name.partition("-")[0]
            if not pid_text.isdigit():
                continue
            if not _alive(int(pid_text)):
                with contextlib.suppress(OSError):
                    record.unlink()
                continue
            with contextlib.suppress(OSError, ValueError):
                held += int(record.read_text(encoding="ascii"))
        return held


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
