"""A GPU that Ray declares but the machine lacks, simulated in host memory.

``ray.init(num_gpus=2)`` on a CPU machine (tests, laptops) gives actors logical GPUs. A
:class:`SimulatedGpu` stands in for one: budgets get host memory (mapped lazily, so an 8 GiB
device costs nothing until written), and the device has a fixed total. It is a device of the
host ledger (:mod:`gpubudget.hostledger`) whose claims must fit that total: every root on it,
in every process of the machine that names the same key, takes its share there, so a second
actor on the same logical GPU sees less free memory, as it would on a real one, and one that
does not fit is told who holds the rest. Roots of processes that have ended stop counting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from ..backends import Event
from ..backends.host import HostBackend, HostReservation
from ..hostledger import LedgerDevice, device_claims
from ..units import format_size

__all__ = ["SimulatedGpu"]

_KEY_BYTES: Final = 64


class SimulatedGpu:
    """A device of ``total`` bytes, shared by the processes of this machine that name ``key``.

    Implements the :class:`gpubudget.backends.Backend` protocol; a root budget on it claims
    its memory in the host ledger first, which refuses (a ``BudgetError`` naming the budgets
    that hold the rest) what does not fit. ``directory``: a ledger directory for this device
    (default: the process's, ``GPUBUDGET_LEDGER_DIR`` or ``/dev/shm``).

    Examples
    --------
    >>> import contextvars, tempfile
    >>> from gpubudget import gpu_budget
    >>> gpu = SimulatedGpu("node-gpu0", 8 * 2**30, directory=tempfile.mkdtemp())
    >>> actor = contextvars.Context()                      # as in one actor's process
    >>> first = actor.run(gpu_budget("6GiB", name="first", backend=gpu).__enter__)
    >>> gpu.mem_info()[0] // 2**30                         # what every process sees
    2
    >>> gpu_budget("3GiB", name="second", backend=gpu).__enter__()    # another actor
    Traceback (most recent call last):
    ...
    gpubudget.hostledger.errors.LedgerError: budget 'second' cannot claim 3.00 GiB on ...
    >>> actor.run(first.__exit__, None, None, None)
    >>> gpu.mem_info()[0] // 2**30
    8
    """

    name = "host"
    synchronous = True  # host memory: every free completes at once

    def __init__(self, key: str, total: int, *, directory: str | os.PathLike[str] | None = None
                 ) -> None:
        if type(total) is not int or total <= 0:
            raise ValueError(f"a simulated GPU needs a positive size in bytes, got {total!r}")
        if not isinstance(key, str) or not key or len(key.encode()) > _KEY_BYTES:
            raise ValueError(f"a simulated GPU's key must be a string of 1 to {_KEY_BYTES} "
                             f"bytes, got {key!r}")
        self.key: Final = key
        self.total: Final = total
        self.directory: Final = Path(directory) if directory is not None else None
        self._host: Final = HostBackend(noreserve=True)

    def __repr__(self) -> str:
        return f"<SimulatedGpu {self.key!r} {format_size(self.total)}>"

    def ledger_device(self) -> LedgerDevice:
        """The device in the host ledger: its claims must fit the total."""
        return LedgerDevice(self.key, f"simulated GPU {self.key}", self.total, hard=True,
                            directory=self.directory)

    def reserve(self, nbytes: int) -> HostReservation:
        """Host memory for a root whose claim the ledger has granted."""
        return self._host.reserve(nbytes)

    def mem_info(self) -> tuple[int, int]:
        """What the roots of live processes have not claimed, and the total."""
        claimed = sum(entry.holds for entry in device_claims(self.ledger_device()))
        return max(self.total - claimed, 0), self.total

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._host.copy(dst, src, nbytes)

    def record_event(self, stream: int) -> Event:
        return self._host.record_event(stream)
